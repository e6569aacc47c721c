"""The embedded default model end to end: reference perplexity, batched generation, the chat script (one
command-line run; its refusals run in process).

Reference figures (../shared/data/README.md) were measured with Hugging Face transformers, fp32, on the
same dequantized weights: 19.134 over the first 8 WikiText-2 windows of 2048 tokens.
"""

import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from kvzoo.eval.perplexity import perplexity
from kvzoo.generate import generate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm(default_model):
    return default_model


def test_wikitext_perplexity_matches_reference(smollm, wikitext_text):
    model, tok = smollm
    ids = tok.encode(wikitext_text)
    # prompt=0: every token scored, as the reference figure (../shared/data/README.md) is
    result = perplexity(model, ids, seq_len=2048, max_windows=8, cache="fp16", prompt=0, progress=False)
    # 304,978: the model's own split (digits cut off first); transformers 5.23's GGUF tokenizer falls back to
    # the GPT-2 split and gets 304,986 (see tests/test_gguf_import.py)
    assert result.windows == 8 and result.tokens == 304_978
    assert result.perplexity == pytest.approx(19.134, rel=0.005)
    # fp32 run: the fp16 strategy keeps K/V at the model's precision, twice an fp16 cache's bytes
    assert result.fp16_kv_nbytes == 2 * 2 * 30 * 3 * 64 * 2048           # K and V, 2 bytes each
    assert result.kv_nbytes == 2 * result.fp16_kv_nbytes


def test_batch_of_prompts_matches_one_at_a_time(smollm):
    model, tok = smollm
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
               "def fibonacci(n):"]
    batched = generate(model, tok, prompts, max_new_tokens=12, temperature=0)
    for row, prompt in enumerate(prompts):
        assert generate(model, tok, prompt, max_new_tokens=12, temperature=0).tokens[0] == batched.tokens[row]


def test_chat_script_answers_paris():
    """The one command-line smoke test of scripts/chat.py, at its default settings (every strategy generates in
    process: tests/model/test_generate.py::test_generate_every_strategy)."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "chat.py"), "--prompt",
                          "What is the capital of France?", "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout
    # fp32 model: the fp16 strategy holds the model's dtype, twice an fp16 cache and once the model's own
    assert "tok/s" in out.stderr and "cache fp16:" in out.stderr and "none quantized" in out.stderr
    assert "2.000x an fp16 cache of these tokens, 1.000x this float32 model's own" in out.stderr


def test_chat_commands_in_a_session(monkeypatch, capsys):
    """/help, /cache (a bad spec refused in one line, a good one taken), an answer through it, /stats, /quit."""
    lines = ["/help", "/cache zip", "/cache kivi:residual=32", "What is the capital of France?", "/stats",
             "/nope", "/quit", "never read"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    code, err = chat_in_process(monkeypatch, capsys, "--max-new-tokens", "12")
    assert code == 0
    assert "SmolLM2-135M-Instruct (embedded), 135M parameters" in err and "greedy, repetition penalty 1.1" in err
    assert "/cache <spec>" in err and "error: unknown cache 'zip'" in err and "[cache kivi:" in err
    assert err.count("cache kivi:") >= 3                       # the switch, the answer's summary, /stats
    assert "unknown command /nope" in err


def test_chat_samples_with_top_p_and_top_k(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n/quit\n"))
    code, err = chat_in_process(monkeypatch, capsys, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40",
                                "--seed", "1", "--max-new-tokens", "8")
    assert code == 0 and "sampled at temperature 0.7, top-p 0.9, top-k 40" in err and "tok/s" in err


@pytest.mark.parametrize("flags, message", [(["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
                                            (["--top-k", "0"], "top_k must be >= 1, got 0"),
                                            (["--temperature", "-1"], "temperature must be >= 0"),
                                            (["--repetition-penalty", "0"], "repetition_penalty must be > 0")])
def test_chat_refuses_bad_sampling_settings(monkeypatch, capsys, flags, message):
    code, err = chat_in_process(monkeypatch, capsys, *flags, "--prompt", "hi")
    assert code == 2 and message in err


def test_chat_compile_needs_a_gpu(monkeypatch, capsys):
    code, err = chat_in_process(monkeypatch, capsys, "--device", "cpu", "--compile", "--prompt", "hi")
    assert code == 2 and "--compile replays CUDA graphs and needs --device cuda" in err


def chat_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of scripts/chat.py run in this process: no second interpreter to start."""
    monkeypatch.setattr(sys, "argv", ["chat.py", *args])
    try:
        runpy.run_path(str(REPO / "scripts" / "chat.py"), run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code
    return code, capsys.readouterr().err


def test_chat_script_refuses_unknown_cache(monkeypatch, capsys):
    code, err = chat_in_process(monkeypatch, capsys, "--cache", "zip", "--prompt", "hi")
    assert code == 2 and "unknown cache 'zip'; available caches: alignedkv, fp16" in err


def test_chat_script_refuses_a_bad_prefill_chunk(monkeypatch, capsys):
    """One line and exit 2 (kvzoo.cli.run), no traceback: an uncaught exception would fail this test."""
    code, err = chat_in_process(monkeypatch, capsys, "--device", "cpu", "--prefill-chunk", "0", "--prompt", "hi")
    assert code == 2 and "--prefill-chunk must be >= 1, got 0" in err


def test_perplexity_script_writes_json(tmp_path):
    target = tmp_path / "ppl.json"
    cmd = [sys.executable, str(REPO / "scripts" / "perplexity.py"), "--dataset", "c4", "--seq-len", "256",
           "--max-windows", "2", "--json", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "perplexity" in out.stdout and "KV bytes" in out.stdout
    result = json.loads(target.read_text())
    assert result["windows"] == 2 and result["dataset"] == "c4" and 1 < result["perplexity"] < 100
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 2 and "exists" in again.stderr
    assert json.loads(target.read_text()) == result


def test_chat_prompt_longer_than_context_is_refused(smollm):
    model, tok = smollm
    with pytest.raises(ValueError, match="does not fit the model's context of 8192"):
        generate(model, tok, [[1] * 9000])
