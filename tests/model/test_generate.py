"""The generation loop on a tiny random model: batching, sampling, stopping, streaming."""

import pytest
import torch

from kvzoo.generate import generate, sample
from kvzoo.models.loader import load_weights
from tests.tiny import tiny_llama


class CharTokenizer:
    """Token id i <-> chr(ord('a') + i % 26); id 2 is EOS only when the test says so."""

    pad_id = 0

    def __init__(self, eos_ids=()):
        self.eos_ids = list(eos_ids)

    def encode(self, text):
        return [ord(c) - ord("a") + 3 for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_weights(tiny_llama(tmp_path_factory.mktemp("tiny")))


def test_batch_gives_same_greedy_tokens_as_one_at_a_time(model):
    tok = CharTokenizer()
    prompts = [[5, 9, 11, 40, 2, 7, 7, 13, 50, 51, 52], [8], [60, 61, 62, 63, 1]]
    batched = generate(model, tok, prompts, max_new_tokens=12, temperature=0)
    for row, prompt in enumerate(prompts):
        alone = generate(model, tok, [prompt], max_new_tokens=12, temperature=0)
        assert alone.tokens[0] == batched.tokens[row]


def test_greedy_equals_argmax_of_full_forward(model):
    tok = CharTokenizer()
    prompt = [3, 14, 15, 92, 65]
    out = generate(model, tok, [prompt], max_new_tokens=6, temperature=0)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out.tokens[0] == seq[len(prompt):]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    tok = CharTokenizer()
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.95)
    first = generate(model, tok, [[4, 5, 6]], seed=7, **kwargs)
    assert generate(model, tok, [[4, 5, 6]], seed=7, **kwargs).tokens == first.tokens
    greedy = generate(model, tok, [[4, 5, 6]], max_new_tokens=10, temperature=0)
    assert generate(model, tok, [[4, 5, 6]], max_new_tokens=10, temperature=1.5, top_k=1, seed=3).tokens == greedy.tokens


def test_sample_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    # softmax of the first two is ~0.67 + 0.24 = 0.91 > 0.8: the nucleus is tokens {0, 1}
    assert set(sample(logits, 1.0, top_p=0.8, generator=gen).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, generator=gen).tolist()) == {0, 1, 2, 3, 4}


def test_stops_on_eos_and_stop_strings(model):
    greedy = generate(model, CharTokenizer(), [[4, 5, 6]], max_new_tokens=10, temperature=0).tokens[0]
    eos = greedy[3]
    out = generate(model, CharTokenizer(eos_ids=[eos]), [[4, 5, 6]], max_new_tokens=10, temperature=0)
    assert out.finish == ["eos"] and out.tokens[0] == greedy[:greedy.index(eos)]

    text = CharTokenizer().decode(greedy)
    stop = text[4:6]
    out = generate(model, CharTokenizer(), [[4, 5, 6]], max_new_tokens=10, temperature=0, stop=[stop])
    assert out.finish == ["stop"] and out.texts[0] == text[:text.index(stop)]


def test_streaming_callback_sees_every_step(model):
    seen = []
    out = generate(model, CharTokenizer(), [[4, 5, 6], [7]], max_new_tokens=5, temperature=0, on_step=seen.append)
    assert [step[0] for step in seen] == out.tokens[0]
    assert [step[1] for step in seen] == out.tokens[1]
    assert out.decode_steps == 4 and out.new_tokens == 10


def test_generation_reports_cache_bytes(model):
    out = generate(model, CharTokenizer(), [[4, 5, 6], [7]], max_new_tokens=5, temperature=0)
    # fp32 model: the fp16 strategy keeps K and V at 4 bytes per element over 2 rows x 7 slots
    cfg = model.cfg
    assert out.cache_nbytes == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * 2 * 7
    assert out.kv_ratio == pytest.approx(2.0)
