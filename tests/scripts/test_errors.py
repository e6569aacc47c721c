"""Bad input gets a clear error naming the problem and what is accepted, and nothing is overwritten."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvzoo.cache.base import CacheSpec, list_caches
from kvzoo.cli import check_device, write_json
from kvzoo.config import ModelConfig
from kvzoo.eval.datasets import load_text
from kvzoo.generate import check_sampling
from kvzoo.models.loader import load_weights, parse_dtype, resolve_model_dir
from tests.scripts.scripts_module import run_in_process
from tests.tiny import tiny_llama


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM, MistralForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_type():
    cfg = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_type 'yarn'; supported: default, linear, llama3"):
        ModelConfig.from_hf(cfg)


def test_unknown_cache_lists_available():
    with pytest.raises(ValueError, match=r"unknown cache 'nope'; available caches: .*fp16"):
        CacheSpec.parse("nope")
    assert "fp16" in list_caches()


def test_bad_cache_option():
    with pytest.raises(ValueError, match="cache 'fp16' has no option bits; accepted options: none"):
        CacheSpec.parse("fp16:bits=2")
    with pytest.raises(ValueError, match="not key=value"):
        CacheSpec.parse("fp16:bits")


def test_missing_model_folder():
    with pytest.raises(FileNotFoundError, match="not a local folder, nor a Hugging Face hub id"):
        resolve_model_dir("/no/such/model/dir")


def test_missing_weights(tmp_path):
    path = tiny_llama(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_weights(path)


def test_pickles_are_refused(tmp_path):
    path = tiny_llama(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="only pickled weights; kvzoo loads safetensors only"):
        load_weights(path)


def test_wrong_shape_names_tensor_and_file(tmp_path):
    path = tiny_llama(tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight in model.safetensors has shape \(3, 64\)"):
        load_weights(path)


def test_missing_and_unknown_tensors(tmp_path):
    path = tiny_llama(tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="does not know.*q_proj.bias.*model.safetensors"):
        load_weights(path)
    del state["model.layers.0.self_attn.q_proj.bias"], state["model.norm.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.norm.weight"):
        load_weights(path)


def shard(path: Path) -> dict[str, list[str]]:
    """Split the checkpoint in `path` into two shards and an index, as sharded Hub checkpoints are saved."""
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, path / name)
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return shards


def test_sharded_checkpoint_loads(tmp_path):
    path = tiny_llama(tmp_path)
    reference = load_weights(path)
    shard(path)
    sharded = load_weights(path)
    tokens = torch.arange(10)[None]
    assert torch.equal(sharded(tokens), reference(tokens))


def test_corrupted_or_truncated_safetensors(tmp_path):
    """Random bytes and a file cut in half, single-file and sharded: one line naming the file and what to do."""
    path = tiny_llama(tmp_path / "single")
    weights = path / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ValueError, match=re.escape(str(weights)) + " is corrupted or truncated .*header.*; download or "
                                         "convert the checkpoint again"):
        load_weights(path)
    weights.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} is corrupted or truncated .*incomplete metadata"):
        load_weights(path)
    sharded = tiny_llama(tmp_path / "sharded")
    second = sharded / list(shard(sharded))[1]
    second.write_bytes(second.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{re.escape(str(second))} is corrupted or truncated"):
        load_weights(sharded)


def test_damaged_default_model_says_delete_the_folder(tmp_path, monkeypatch):
    """The embedded model's folder is converted again once deleted: the message says so (kvzoo deletes nothing)."""
    monkeypatch.setenv("KVZOO_WEIGHTS", str(tmp_path))
    path = tiny_llama(tmp_path / "smollm2-135m-instruct")
    (path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=f"delete the folder {re.escape(str(path))} and run again: the embedded "
                                         "model is converted again from its GGUF"):
        load_weights(path)
    assert (path / "model.safetensors").exists()


def test_bad_shard_index(tmp_path):
    path = tiny_llama(tmp_path)
    first, second = shard(path)
    index = path / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text(json.dumps({"weight_map": dict.fromkeys(good["weight_map"], first)}))
    with pytest.raises(ValueError, match=f"index.json puts .* in {first}, which does not hold it"):
        load_weights(path)
    index.write_text(json.dumps(good))
    (path / second).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"shard {second} named in {index} is not in {path}")):
        load_weights(path)
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=re.escape(str(index)) + " is not a safetensors index .*JSONDecodeError"):
        load_weights(path)
    index.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="is not a safetensors index \\(KeyError: 'weight_map'\\)"):
        load_weights(path)


def test_integer_tensor_is_refused(tmp_path):
    path = tiny_llama(tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.up_proj.weight in model.safetensors holds I8 "
                                         r"values; kvzoo loads float weights: F32 \(float32\), F16 \(float16\), "
                                         r"BF16 \(bfloat16\)"):
        load_weights(path)


def test_bad_config_json(tmp_path):
    path = tiny_llama(tmp_path)
    config = path / "config.json"
    good = json.loads(config.read_text())
    config.write_text(json.dumps(good)[:-10])
    with pytest.raises(ValueError, match=f"{re.escape(str(config))} is not valid JSON \\(.*\\); a model folder needs"):
        load_weights(path)
    del good["hidden_size"]
    config.write_text(json.dumps(good))
    with pytest.raises(ValueError, match=re.escape(str(config)) + " lacks hidden_size; a LlamaForCausalLM config "
                                         "needs vocab_size"):
        load_weights(path)


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="unknown dtype 'float8'; accepted: float32"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="unknown device 'gpu7'"):
        check_device("gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU; use --device cpu"):
            check_device("cuda")


def test_bad_sampling_settings():
    for kwargs, msg in [(dict(temperature=-1.0), "temperature must be >= 0"), (dict(top_p=1.5), "top_p must be in"),
                        (dict(top_k=0), "top_k must be >= 1"), (dict(max_new_tokens=0), "max_new_tokens must be >= 1")]:
        settings = dict(max_new_tokens=4, temperature=0.0, top_k=None, top_p=None) | kwargs
        with pytest.raises(ValueError, match=msg):
            check_sampling(**settings)


def test_prompt_longer_than_context(tmp_path):
    from kvzoo.generate import generate

    model = load_weights(tiny_llama(tmp_path, max_position_embeddings=16))

    class Tok:
        pad_id, eos_ids = 0, [2]

    with pytest.raises(ValueError, match="prompt of 20 tokens does not fit the model's context of 16"):
        generate(model, Tok(), [list(range(3, 23))])
    with pytest.raises(ValueError, match="exceed the model's context of 16"):
        model.new_cache("fp16", batch_size=1, max_len=17)


def test_missing_dataset_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="wikitext2 data not found at .*KVZOO_DATA"):
        load_text("wikitext2", tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="unknown dataset 'ptb'; accepted: wikitext2, c4"):
        load_text("ptb")


def test_json_output_never_overwrites(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("precious")
    with pytest.raises(FileExistsError, match="exists; choose another --json path or pass --overwrite"):
        write_json(target, {"a": 1})
    assert target.read_text() == "precious"
    write_json(target, {"a": 1}, overwrite=True)
    assert json.loads(target.read_text()) == {"a": 1}


REPO = Path(__file__).resolve().parents[2]
# repro modules that build their own caches (or none): the SQuat / AlignedKV analyses and the KV Pareto sweeps
OWN_QUANTIZERS = {"repro.squat.figure2", "repro.alignedkv.figure9", "repro.kvpareto.memory", "repro.kvpareto.frontier",
                  "repro.kvpareto.weights_ppl", "repro.xquant.mha_error"}


def runnable(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def command(name: str) -> list[str]:
    """An entry point of scripts/ ("chat.py") is run by path, a reproduction ("repro.squat.bench") as a module
    from the repository root: as the README runs them."""
    return [sys.executable, str(REPO / "scripts" / name)] if name.endswith(".py") else [sys.executable, "-m", name]


def entry_points() -> list[str]:
    return [p.name for p in sorted((REPO / "scripts").glob("*.py")) if runnable(p)]


def reproductions() -> list[str]:
    return [".".join(p.relative_to(REPO).with_suffix("").parts) for p in sorted((REPO / "repro").rglob("*.py"))
            if runnable(p)]


def test_the_layout():
    """Entry points in scripts/, every paper's reproduction in repro/<paper>/; no script edits the module search
    path (they import the installed kvzoo, repro modules their siblings as repro.<paper>....)."""
    assert set(entry_points()) == {"chat.py", "perplexity.py", "report.py", "needle.py", "bench_decode.py",
                                   "bench_kernels.py", "harness.py", "harness_split.py", "compile_sm90.py"}
    papers = {name.split(".")[1] for name in reproductions()}
    assert papers == {"alignedkv", "squat", "xquant", "kvpareto"}
    for paper in papers:
        assert (REPO / "repro" / paper / "__init__.py").exists() and (REPO / "repro" / paper / "analysis.py").exists()
    for path in [*(REPO / "scripts").glob("*.py"), *(REPO / "repro").rglob("*.py"), *(REPO / "kvzoo").rglob("*.py")]:
        assert "sys.path" not in path.read_text(), path


def test_every_script_builds_its_command_line(monkeypatch, capsys):
    """Every entry point's and reproduction's --help builds (no option clashes with the shared ones of
    kvzoo.cli.add_model_args); those that take one cache take it as --cache. In this process: argparse prints the
    help and exits before any work."""
    for name in entry_points() + reproductions():
        code, out, err = run_in_process(monkeypatch, capsys, name, "--help")
        assert code == 0, f"{name}: {err}"
        if not name.endswith(".py"):
            assert f"usage: python -m {name}" in out, name
        # benchmarks and OWN_QUANTIZERS build their own caches (or none); harness.py is lm-eval's command line,
        # the cache one of its --model_args
        if name == "harness.py":
            assert "usage: lm-eval" in out
        elif name == "harness_split.py":                 # subcommands; `generate` takes the one cache
            code, out, err = run_in_process(monkeypatch, capsys, name, "generate", "--help")
            assert code == 0 and "--cache" in out, err
        elif not (name.startswith("bench_") or name.endswith(".bench") or name in OWN_QUANTIZERS
                  or name == "compile_sm90.py"):                 # compiles kernels, runs no model
            assert "--cache" in out, name


@pytest.mark.parametrize("script, args, message", [
    ("repro.alignedkv.greedy", ["--batch", "0"], "--prompts, --new-tokens and --batch must be >= 1"),
    ("repro.kvpareto.frontier", ["--chunks", "a"], "--chunks and --group-sizes take comma-separated integers"),
    ("repro.kvpareto.frontier", ["--kv", "8/4"], "--kv takes pairs like k8v4"),
    ("repro.kvpareto.frontier", ["--weights", "w16,w3"],
     "--weights takes a comma-separated list of w16, w4-rtn, w4-awq"),
    ("repro.kvpareto.frontier", ["--weights", "w4-awq"], "that includes w16"),
    ("repro.kvpareto.frontier", ["--depths", "mid"], "--depths takes comma-separated numbers"),
    ("repro.kvpareto.frontier", ["--depths", "0,1.5"], "--depths must lie in [0, 1]"),
    ("repro.kvpareto.frontier", ["--calib-windows", "0"], "--calib-windows must be >= 1, got 0"),
    ("needle.py", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("repro.kvpareto.memory", ["--chunks", "-1"], "--tokens must be >= 1 and --chunks >= 0"),
    ("needle.py", ["--depths", "x"], "--depths takes comma-separated numbers"),
    ("report.py", ["--caches", "kivi:policy=grouped", "--policy", "reference"],
     "every row of a table uses one window policy"),
    ("report.py", ["--caches", "kivi:policy=paper"], "unknown window policy 'paper'; accepted: reference, grouped, none"),
    ("report.py", ["--prompt", "2048"], "--prompt must be in [0, --seq-len=2048), got 2048"),
    ("repro.xquant.mha_error", ["--windows", "0"], "--seq-len must be >= 2 and --windows >= 1, got 512 and 0"),
])
def test_new_script_options_refuse_bad_values(monkeypatch, capsys, script, args, message):
    """Refused with one line naming the problem (exit 2), before or instead of any long work."""
    code, _, err = run_in_process(monkeypatch, capsys, script, "--device", "cpu", *args)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("script, args, message", [
    ("bench_decode.py", ["--models", "gpt2"],
     "unknown model 'gpt2'; accepted: llama-3.1-8b, llama-3.1-70b, llama-2-7b, smollm2"),
    ("bench_decode.py", ["--steps", "0"],
     "--contexts, --batches, --steps, --warmup, --prefill-chunk and --repeats must be >= 1"),
    ("bench_decode.py", ["--caches", "nope"], "--caches: unknown cache 'nope'; available caches: alignedkv"),
    ("bench_decode.py", ["--warmup", "0"],
     "--contexts, --batches, --steps, --warmup, --prefill-chunk and --repeats must be >= 1"),
    ("bench_decode.py", ["--hf", "quanto:3"], "--hf: unknown Hugging Face cache 'quanto:3'; accepted: fp16, quanto:2"),
    ("bench_decode.py", ["--caches"], "nothing to run: give --caches and/or --hf"),
    ("bench_decode.py", ["--graph-only"], "--graph-only needs --compile"),
    ("bench_decode.py", ["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    ("bench_decode.py", ["--max-context", "100"], "--max-context must be >= 1024"),
    ("bench_decode.py", ["--weights", "w3"], "argument --weights: invalid choice: 'w3'"),
    ("bench_decode.py", ["--fill", "all"], "argument --fill: invalid choice: 'all'"),
    ("bench_decode.py", ["--trace"], "--trace writes the timelines of --profile's steps: add --profile N"),
    ("repro.kvpareto.bench", ["--rows", "0"], "--rows and --runs must be >= 1"),
    ("repro.kvpareto.bench", ["--step", "--runs", "0"], "--rows and --runs must be >= 1"),
    ("bench_kernels.py", ["--floors", "--stages"], "argument --stages: not allowed with argument --floors"),
])
def test_gpu_benchmarks_refuse_bad_values_before_looking_for_a_gpu(monkeypatch, capsys, script, args, message):
    """The GPU benchmarks check their options first, so a bad value is named on any machine."""
    code, _, err = run_in_process(monkeypatch, capsys, script, *args)
    assert code != 0 and message in err and "Traceback" not in err, err


def test_cache_help_lists_every_strategy_without_loading_the_model():
    out = subprocess.run(command("perplexity.py") + ["--cache", "help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and "loading weights" not in out.stderr, out.stderr
    sections = {block.split(":")[0]: block for block in out.stdout.split("\n\n")[1:]}
    assert list(sections) == list_caches()
    assert sections["innerq"].startswith("innerq: KV-cache quantization grouped over the *inner* dimension")
    assert "    bits=2 " in sections["innerq"] and "quant_mode=hybrid" in sections["innerq"]
    assert "policy=reference" in sections["kivi"] and "window policy" in sections["kivi"]
    assert sections["kivi-pre"].startswith("kivi-pre: KIVI*: keys quantized before RoPE")
    assert "(no options)" in sections["fp16"]


def test_list_caches_flag(monkeypatch, capsys):
    for script in ("perplexity.py", "report.py"):
        code, out, _ = run_in_process(monkeypatch, capsys, script, "--list-caches")
        assert code == 0 and "xquant-cl: XQuant over cross-layer deltas" in out and "lam=0.001" in out


@pytest.mark.parametrize("script, args, message", [
    ("perplexity.py", ["--cache", "innerq:bitz=2"], "cache 'innerq' has no option bitz; accepted options: bits, "),
    ("perplexity.py", ["--cache", "kivi", "--cache-opts", "bits=two"], "option bits='two' is not a valid int"),
    ("needle.py", ["--cache", "zip"], "unknown cache 'zip'; available caches: alignedkv, fp16"),
    ("perplexity.py", ["--seq-len", "0"], "--seq-len must be at least 2, got 0"),
    ("perplexity.py", ["--max-windows", "0"], "--max-windows must be >= 1, got 0"),
    ("perplexity.py", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("perplexity.py", ["--prompt", "-1"], "--prompt must be in [0, --seq-len=2048), got -1"),
    ("perplexity.py", ["--seq-len", "64", "--prompt", "64"], "--prompt must be in [0, --seq-len=64), got 64"),
    ("perplexity.py", ["--prefill-chunk", "8"],
     "--prefill-chunk applies to streaming and graph modes only; --mode is simulated"),
    ("perplexity.py", ["--mode", "streaming", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    ("needle.py", ["--lengths", "0,1024"], "--lengths must be token counts >= 1, got [0, 1024]"),
    ("needle.py", ["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    ("report.py", ["--windows", "0"], "--windows must be >= 1, got 0"),
    ("report.py", ["--seq-len", "1"], "--seq-len must be at least 2, got 1"),
])
def test_bad_values_are_refused_before_loading(monkeypatch, capsys, script, args, message):
    """One line, exit 2, no usage block, and neither the model nor the text is touched."""
    code, _, err = run_in_process(monkeypatch, capsys, script, "--device", "cpu", *args)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
