"""The generation loop on a tiny random model (batching, sampling, stopping, streaming), and every registered
cache strategy generating with the embedded default model."""

import pytest
import torch

import kvzoo
from kvzoo.generate import chat_sampling, check_sampling, generate, penalize, sample
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


def test_repetition_penalty_lowers_tokens_already_generated():
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert torch.equal(penalize(logits, seen, 2.0), torch.tensor([[1.0, -4.0, 1.0, 3.0]]))
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        check_sampling(8, 0.0, None, None, 0.0)


def test_repetition_penalty_breaks_a_greedy_loop(model):
    """A tiny random model's greedy answer repeats tokens; with a penalty every token is rarer, and 1.0 is plain
    greedy."""
    plain = generate(model, CharTokenizer(), [[4, 5, 6]], max_new_tokens=24, temperature=0)
    same = generate(model, CharTokenizer(), [[4, 5, 6]], max_new_tokens=24, temperature=0, repetition_penalty=1.0)
    guarded = generate(model, CharTokenizer(), [[4, 5, 6]], max_new_tokens=24, temperature=0, repetition_penalty=5.0)
    assert same.tokens == plain.tokens
    most = lambda ids: max(ids.count(t) for t in set(ids))      # noqa: E731
    assert most(guarded.tokens[0]) < most(plain.tokens[0])


def test_chat_sampling_follows_generation_config():
    """transformers' reading: sampling settings apply only with do_sample; else greedy. The repetition guard is
    1.1 unless the config names one."""
    assert chat_sampling({}) == {"temperature": 0.0, "top_p": None, "top_k": None, "repetition_penalty": 1.1}
    assert chat_sampling({"temperature": 0.6, "top_p": 0.9}) ["temperature"] == 0.0
    sampled = chat_sampling({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                             "repetition_penalty": 1.05})
    assert sampled == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


def test_generation_reports_cache_bytes(model):
    out = generate(model, CharTokenizer(), [[4, 5, 6], [7]], max_new_tokens=5, temperature=0)
    # fp32 model: the fp16 strategy keeps K and V at 4 bytes per element over 2 rows x 7 slots
    cfg = model.cfg
    assert out.cache_nbytes == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * 2 * 7
    assert out.kv_ratio == pytest.approx(2.0)


# ---- every registered strategy on the embedded model -----------------------------------------------------
STRATEGIES = kvzoo.list_caches()     # read at collection time, so a newly registered strategy is covered at once
# strategies that keep every bit of K and V: fp16 (at the model's precision) and AlignedKV (fp16 split into the
# bit planes it reads as few of as it can); every other strategy must hold less than an fp16 cache
FULL_STORAGE = {"fp16", "alignedkv"}
PROMPT_TOKENS, NEW_TOKENS = 400, 16


@pytest.fixture(scope="module")
def prompt(default_model, wikitext_text):
    """400 tokens of WikiText-2: past every built-in strategy's exact windows at its default options (KIVI's
    residual of 128 plus a group of 32, InnerQ's sink of 32 plus 96 recent tokens, XQuant's groups of 128,
    AlignedKV's blocks of 64), so each quantizes most of the prompt and decodes the answer from what it stored."""
    _, tok = default_model
    ids = tok.encode(wikitext_text[:20_000])[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


@pytest.mark.parametrize("name", STRATEGIES)
def test_generate_every_strategy(default_model, prompt, name):
    """Greedy generation in process (one model for every strategy) through each registered strategy at its
    default options; bytes against an fp16 cache of the same slots."""
    model, tok = default_model
    out = kvzoo.generate(model, tok, [prompt], max_new_tokens=NEW_TOKENS, temperature=0, cache=name)
    assert out.texts[0].strip() and out.new_tokens > 0
    cfg = model.cfg
    slots = PROMPT_TOKENS + out.decode_steps           # the last token is sampled, never stored
    assert out.fp16_nbytes == 2 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * slots   # K and V, 2 bytes
    model_bytes = next(model.parameters()).element_size()     # 4: fp32 on CPU
    assert out.stored_tokens == slots and out.model_nbytes == out.fp16_nbytes * model_bytes // 2
    quantized = out.quantized_tokens                   # (keys, values) held quantized per row
    assert quantized == (0, 0) if name in FULL_STORAGE else 0 < max(quantized) <= slots
    if name == "fp16":
        # K/V held at the model's precision: an fp32 run holds twice an fp16 cache (an fp16 run: exactly 1x)
        assert out.kv_ratio == model_bytes / 2
    elif name in FULL_STORAGE:
        assert 1 <= out.kv_ratio < 1.1, out.kv_ratio
    else:
        # its exact windows at fp32 (twice an fp16 cache's bytes) included, a quantizing strategy holds less
        assert 0 < out.kv_ratio < 1, f"{name}: {out.kv_ratio:.3f}x fp16 (exact windows longer than the prompt?)"
