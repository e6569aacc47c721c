"""Tensor parallelism (kvzoo/models/tp.py) on the CPU: two gloo ranks under torchrun against one process.

Every strategy's sharded run (each rank holding its KV heads) gives the single process's logits within fp32
rounding and its greedy tokens, eagerly and through kvzoo.graphs.decoder, streaming and simulated, with the KV
bytes summed over ranks. The strategies whose state spans heads shard it their own way (tp.py's docstring):
their lossless settings still equal one process, and their lossy ones stay within 3x one process's distance from fp16.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzoo.models import tp
from kvzoo.models.loader import load_weights
from kvzoo.models.mha import expand_to_mha
from kvzoo.weightquant.awq import quantize_weights
from tests.cache.test_cache_contract import CAUSAL, LOSSLESS, LOSSY
from tests.tiny import tiny_llama
from tests.tp_worker import run_all

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
# lossy settings whose quantized state is taken per rank, not per head: XQuant's GQA latents (an SVD of the
# rank's W_k, W_v rows), XQuant-CL's GQA deltas and first plain layer, KV Pareto's per-tensor range
SHARD_LOCAL = {"xquant", "xquant-outlier", "xquant-cl", "xquant-cl-plain-first", "kvpareto-tensor", "kvpareto-k16"}
# caches of the layer input X, which every rank holds whole: the bytes summed over ranks are WORLD times one
# process's (xquant-cl's base layer, and XQuant itself on an MHA model)
REPLICATED_X = {"xquant-cl", "xquant-cl-plain-first"}
SPECS = sorted(set(LOSSY.values()) | set(LOSSLESS.values()))
MHA_SPECS = [LOSSY["xquant"], LOSSY["xquant-cl"], "fp16"]


def sharded(checkpoint: Path, out: Path, specs: list[str], device: str = "cpu") -> dict:
    """run_all in WORLD processes launched by torchrun (gloo on cpu, NCCL on cuda), as a user launches chat."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(REPO / "tests" / "tp_worker.py"), device, str(checkpoint), str(out), *specs]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def one_and_sharded(folder: Path, specs: list[str], **config) -> tuple[dict, dict]:
    checkpoint = tiny_llama(folder, head_dim=32, hidden_size=64, **config)
    return run_all(load_weights(checkpoint), specs), sharded(checkpoint, checkpoint / "out.pt", specs)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory, run_once):
    """(single-process results, sharded results) for every spec of the contract tests, GQA 4/2 heads."""
    return run_once("tp-gqa", lambda: one_and_sharded(tmp_path_factory.mktemp("tp-gqa"), SPECS))


@pytest.fixture(scope="module")
def mha(tmp_path_factory, run_once):
    """The same on an MHA model (4/4 heads), where XQuant caches X itself."""
    return run_once("tp-mha", lambda: one_and_sharded(tmp_path_factory.mktemp("tp-mha"), MHA_SPECS,
                                                       num_key_value_heads=4))


def assert_same(one: dict, many: dict, nbytes_factor: int = 1, tol: float = 1e-5) -> None:
    for how in ("eager", "decoder"):
        assert (one[how][0] - many[how][0]).abs().max() < tol, how
        assert torch.equal(one[how][1], many[how][1]), how
        assert many[f"{how}_nbytes"] == nbytes_factor * one[f"{how}_nbytes"], how
    assert (one["simulated"] - many["simulated"]).abs().max() < tol


@pytest.mark.parametrize("name", sorted(set(LOSSY) - SHARD_LOCAL))
def test_sharded_lossy_equals_one_process(gqa, name):
    """A rank holds half the KV heads, so a fused kernel can plan other splits and sum in another order; a lossy
    quantizer can carry that fp32 rounding into later tokens' codes (KV Pareto's 4/2-bit whole-step decoder differs
    by 1.9e-5 with numpy 2.4.6 and triton 3.9.0 under the interpreter; its eager decode within 1e-5)."""
    one, many = gqa
    assert_same(one[LOSSY[name]], many[LOSSY[name]], tol=1e-4)


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_sharded_lossless_equals_one_process(gqa, name):
    one, many = gqa
    assert_same(one[LOSSLESS[name]], many[LOSSLESS[name]], WORLD if name == "xquant-cl" else 1)


@pytest.mark.parametrize("name", sorted(SHARD_LOCAL))
def test_shard_local_state_stays_near_fp16_as_one_process_does(gqa, name):
    one, many = gqa
    spec = LOSSY[name]
    # teacher-forced (simulated) logits: greedy decodes that part ways would compare different texts
    def error(results):
        return (results[spec]["simulated"] - results["fp16"]["simulated"]).abs().mean().item()
    assert error(many) < 3 * error(one) + 1e-3
    factor = WORLD if name in REPLICATED_X else 1
    # every rank keeps its own outlier channel exact (xquant-outlier): a little more than one process
    assert many[spec]["eager_nbytes"] <= factor * one[spec]["eager_nbytes"] * 1.1


@pytest.mark.parametrize("spec", MHA_SPECS)
def test_sharded_mha_xquant_replicates_x_and_equals_one_process(mha, spec):
    one, many = mha
    assert_same(one[spec], many[spec], 1 if spec == "fp16" else WORLD)


def test_kv_heads_must_divide_among_ranks(tmp_path):
    checkpoint = tiny_llama(tmp_path, head_dim=32, hidden_size=64)      # 2 KV heads
    with pytest.raises(ValueError, match="2 KV heads .* divides 2"):
        load_weights(checkpoint, shard=tp.Shard(0, 3))


def test_a_rank_reads_only_its_slices(tmp_path):
    checkpoint = tiny_llama(tmp_path, head_dim=32, hidden_size=64)
    whole = load_weights(checkpoint)
    for rank in range(WORLD):
        part = load_weights(checkpoint, shard=tp.Shard(rank, WORLD))
        attn, full = part.layers[1].attn, whole.layers[1].attn
        assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
        rows = slice(rank * 32, (rank + 1) * 32)                           # one KV head of 32 channels
        assert torch.equal(attn.k_proj.weight, full.k_proj.weight[rows])
        assert torch.equal(attn.o_proj.weight, full.o_proj.weight[:, rank * 64:(rank + 1) * 64])
        assert torch.equal(part.layers[0].mlp.down_proj.weight, whole.layers[0].mlp.down_proj.weight[:, rank * 48:(rank + 1) * 48])
        assert torch.equal(part.lm_head.weight, whole.lm_head.weight)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_sharded_on_gpus_with_cuda_graphs_equals_one_gpu(tmp_path):
    """NCCL ranks, compiled kernels, the decoder's CUDA graphs (all-reduce inside; InnerQ's windows record a graph
    per phase): one GPU's logits and tokens."""
    checkpoint = tiny_llama(tmp_path, head_dim=32, hidden_size=64)
    specs = [LOSSY[name] for name in ("fp16", "innerq", "kivi", "kivi+sink", "squat", "int8", "alignedkv", "kvpareto",
                                      "kivi-pre")] + [CAUSAL["innerq-default"], LOSSLESS["xquant-cl"]]
    one = run_all(load_weights(checkpoint, device="cuda"), specs)
    many = sharded(checkpoint, tmp_path / "out.pt", specs, "cuda")
    for spec in specs:
        for how in ("eager", "decoder"):
            assert (one[spec][how][0] - many[spec][how][0]).abs().max() < 1e-3, (spec, how)
            assert torch.equal(one[spec][how][1], many[spec][how][1]), (spec, how)
            factor = WORLD if spec == LOSSLESS["xquant-cl"] else 1
            assert many[spec][f"{how}_nbytes"] == factor * one[spec][f"{how}_nbytes"]


def test_mha_expansion_of_a_shard_is_the_shard_of_the_expansion(tmp_path):
    checkpoint = tiny_llama(tmp_path, head_dim=32, hidden_size=64)
    whole = expand_to_mha(load_weights(checkpoint))
    for rank in range(WORLD):
        part = expand_to_mha(load_weights(checkpoint, shard=tp.Shard(rank, WORLD)))
        attn = part.layers[0].attn
        assert (attn.n_heads, attn.n_kv_heads, part.cfg.n_kv_heads) == (2, 2, 4)
        rows = slice(rank * 64, (rank + 1) * 64)                           # two expanded KV heads of 32
        assert torch.equal(attn.v_proj.weight, whole.layers[0].attn.v_proj.weight[rows])


def test_weight_quantization_refuses_a_sharded_model(tmp_path):
    part = load_weights(tiny_llama(tmp_path, head_dim=32, hidden_size=64), shard=tp.Shard(0, WORLD))
    with pytest.raises(ValueError, match="tensor-parallel"):
        quantize_weights(part, None, "w4-rtn")


def torchrun(world: int, script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(REPO / "scripts" / script), *args], input=stdin,
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def test_chat_under_torchrun_answers_as_one_process():
    """The embedded SmolLM2 (3 KV heads) over 3 ranks: rank 0 reads the conversation and prints; the answer and the
    cache's bytes are one process's."""
    session = torchrun(3, "chat.py", "--cache", "innerq", "--max-new-tokens", "16",
                       stdin="What is the capital of France?\n/quit\n")
    assert session.returncode == 0, session.stderr[-3000:]
    assert "135M parameters, float32 on 3 ranks (tensor parallel)" in session.stderr
    assert session.stdout.count("The capital of France is Paris.") == 1
    assert "cache innerq:" in session.stderr and "2.0 MiB = 2.023x an fp16 cache" in session.stderr


def test_torchrun_with_ranks_that_do_not_divide_the_kv_heads_is_refused():
    out = torchrun(2, "perplexity.py", "--max-windows", "1", "--seq-len", "64")
    assert out.returncode != 0
    assert "error: tensor parallelism over 2 ranks needs the KV heads to divide evenly: this model has 3 KV " \
           "heads" in out.stderr


def test_perplexity_under_torchrun_is_one_process_and_rank_0_writes_the_json(tmp_path):
    """Ranks sum the attention and MLP outputs in another order than one process does; a 2-bit quantizer can carry
    that fp32 rounding into a few codes (on some CPUs), so the perplexities agree within 0.5% and the bytes exactly."""
    args = ["--max-windows", "1", "--seq-len", "128", "--cache", "kivi:bits=2,residual=32"]
    sharded_run = torchrun(3, "perplexity.py", *args, "--json", str(tmp_path / "sharded.json"))
    assert sharded_run.returncode == 0, sharded_run.stderr[-3000:]
    one_run = subprocess.run([sys.executable, str(REPO / "scripts" / "perplexity.py"), *args, "--json",
                              str(tmp_path / "one.json")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert one_run.returncode == 0, one_run.stderr[-3000:]
    sharded, one = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("sharded", "one"))
    assert sharded["perplexity"] == pytest.approx(one["perplexity"], rel=5e-3)
    assert sharded["kv_nbytes"] == one["kv_nbytes"] > 0
    assert sharded_run.stdout.count("perplexity   ") == 1                  # rank 0 alone prints


def test_bench_decode_under_torchrun_refuses_what_runs_in_one_process():
    out = torchrun(3, "bench_decode.py", "--device", "cpu", "--models", "smollm2", "--weights", "w4-rtn",
                   "--out", "/nonexistent/never-written")
    assert out.returncode != 0
    assert "--hf and --weights w4-rtn run in one process; leave them out under torchrun" in out.stderr
