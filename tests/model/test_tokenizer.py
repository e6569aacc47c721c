"""kvzoo.tokenizer over both formats: SentencePiece (Llama 2) and tokenizer.json (SmolLM2)."""

import json

import pytest
from jinja2.exceptions import TemplateError

from kvzoo.tokenizer import Tokenizer

SAMPLE = "Héllo wörld — 日本語, ½ cup & 12,345.67\n\n\ttabs  and   spaces 🙂 <|im_start|>"


@pytest.fixture(scope="module")
def llama2(llama2_tokenizer_file):
    return Tokenizer.from_pretrained(llama2_tokenizer_file)


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    return Tokenizer.from_pretrained(default_model_dir)


def test_llama2_wikitext_count_matches_the_literature(llama2, wikitext_text):
    """341,469 tokens with BOS: the figure behind "166 windows of 2048" in KV-quantization papers."""
    ids = llama2.encode(wikitext_text)
    assert len(ids) == 341_469 and ids[0] == llama2.bos_id == 1
    assert len(llama2.encode(wikitext_text, bos=False)) == 341_468
    assert llama2.decode(ids) == wikitext_text


def test_bare_sentencepiece_model_defaults(llama2):
    assert (llama2.add_bos, llama2.bos_id, llama2.eos_ids, llama2.pad_id, llama2.vocab_size) == (True, 1, [2], 2, 32000)
    assert llama2.special_tokens["bos"] == "<s>" and llama2.special_tokens["eos"] == "</s>"
    assert not llama2.has_chat_template


def test_smollm2_special_tokens(smollm2):
    assert (smollm2.add_bos, smollm2.bos_id, smollm2.eos_ids, smollm2.pad_id, smollm2.vocab_size) == (False, 1, [2], 2, 49152)
    assert smollm2.id_to_token(2) == "<|im_end|>"   # the end of a chat turn is the EOS token
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2             # special strings in text become single ids
    assert smollm2.decode(ids) == "user\nHi"
    assert smollm2.decode(ids, skip_special=False) == "<|im_start|>user\nHi<|im_end|>"


@pytest.mark.parametrize("name", ["llama2", "smollm2"])
def test_round_trip(name, request):
    tok = request.getfixturevalue(name)
    # "<|im_start|>" is a special token for SmolLM2 only; for Llama 2 it is ordinary text.
    visible = SAMPLE.replace("<|im_start|>", "") if name == "smollm2" else SAMPLE
    assert tok.decode(tok.encode(SAMPLE)) == visible
    assert tok.decode(tok.encode(SAMPLE, bos=False), skip_special=False) == SAMPLE
    assert tok.decode(tok.encode(SAMPLE, bos=True), skip_special=False) == tok.special_tokens["bos"] + SAMPLE


CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], True),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 👋"}], False),
]


@pytest.mark.parametrize("messages, add_generation_prompt", CONVERSATIONS)
def test_chat_template_matches_transformers(smollm2, default_model_dir, messages, add_generation_prompt):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(default_model_dir)
    expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    prompt = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    assert smollm2.encode(prompt, bos=False) == reference(expected, add_special_tokens=False).input_ids
    if len(messages) == 1:
        assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_no_chat_template_is_a_clear_error(llama2):
    with pytest.raises(ValueError, match="no chat template"):
        llama2.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"No tokenizer in {tmp_path}: expected one of tokenizer.json, tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nor such a tokenizer file"):
        Tokenizer.from_pretrained(tmp_path / "absent")
    (tmp_path / "vocab.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match="tokenizer.json or tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path / "vocab.txt")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json is not a valid tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "config.json")


def _tiny_tokenizer_json(path, *, bos_in_post_processor: bool):
    """A word-level tokenizer.json: ids 0-3 are <unk> <s> </s> <|eot_id|>, then a few words."""
    from tokenizers import AddedToken, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer

    specials = ["<unk>", "<s>", "</s>", "<|eot_id|>"]
    vocab = {token: i for i, token in enumerate(specials + ["hello", "world", "!"])}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))


def test_bare_tokenizer_json_learns_bos_from_its_post_processor(tmp_path):
    _tiny_tokenizer_json(tmp_path / "tokenizer.json", bos_in_post_processor=True)
    tok = Tokenizer.from_pretrained(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.add_bos, tok.eos_ids, tok.pad_id) == (1, True, [], 0)
    assert tok.encode("hello world") == [1, 4, 5]
    assert tok.encode("hello world", bos=False) == [4, 5]


def test_folder_configs(tmp_path):
    """tokenizer_config.json (tokens written as dicts), generation_config.json and chat_template.jinja."""
    _tiny_tokenizer_json(tmp_path / "tokenizer.json", bos_in_post_processor=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": True,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.bos_id, tok.add_bos, tok.eos_ids, tok.pad_id) == (1, True, [2, 3], 2)
    assert tok.encode("hello !") == [1, 4, 6]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<s>hello<|eot_id|>"
    assert tok.encode(prompt, bos=False) == [1, 4, 3]
    with pytest.raises(TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
