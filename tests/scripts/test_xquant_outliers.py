"""XQuant Appendix B statistics (repro/xquant/analysis.py) and `python -m repro.xquant.outliers`.

Constructed inputs with a known answer: a W_k with a planted dominant singular direction whose first
row of B_kᵀ peaks at a chosen key channel, and X concentrated along that direction, so the latent first
channel must dominate and the predicted outlier channel must be the measured one. Then the hooks on a
tiny random model, and the script end to end on that model with a character-level tokenizer.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzoo.models.loader import load_weights
from repro.xquant.analysis import (analyze, latent_stats, outlier_channel, predicted_outlier_channels, prediction_rank,
                                   rope_pair, svd_factors)
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[2]


def orthonormal(n: int, m: int, seed: int) -> torch.Tensor:
    """(n, m) with orthonormal columns."""
    q, _ = torch.linalg.qr(torch.randn(n, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def planted(d=48, r=12, sigmas=(10.0, 1.0), peaks=(5,), seed=0):
    """Paper-orientation W (d, r) = Σ_i σ_i u_i b_iᵀ + tiny noise, where b_i (unit) peaks at key channel
    peaks[i] (for i < len(peaks)); returns W, the u's (d, r) and the b's (r, r)."""
    u = orthonormal(d, r, seed)
    b = orthonormal(r, r, seed + 1)
    for i, c in enumerate(peaks):                     # make |b_i| largest at channel c, then re-orthonormalize
        b[:, i] = 0.2 * b[:, i]
        b[c, i] = 1.0
    b, _ = torch.linalg.qr(b)
    s = torch.tensor(list(sigmas) + [0.5] * (r - len(sigmas)), dtype=torch.float64)
    w = u @ torch.diag(s) @ b.T + 1e-4 * torch.randn(d, r, generator=torch.Generator().manual_seed(seed + 2),
                                                      dtype=torch.float64)
    return w, u, b


def tokens_along(u: torch.Tensor, scales, n=256, noise=0.05, seed=3):
    """n tokens x = Σ_i scales[i] * (1 + 0.2 ε) * u_i + noise, in float32."""
    g = torch.Generator().manual_seed(seed)
    x = noise * torch.randn(n, u.shape[0], generator=g, dtype=torch.float64)
    for i, a in enumerate(scales):
        x += a * (1 + 0.2 * torch.randn(n, 1, generator=g, dtype=torch.float64)) * u[:, i]
    return x.float()


def test_svd_factors_follow_the_paper_orientation():
    weight = torch.randn(8, 24)                       # nn.Linear: (out = r, in = d)
    u, s, bt = svd_factors(weight)
    assert u.shape == (24, 8) and s.shape == (8,) and bt.shape == (8, 8)
    torch.testing.assert_close(u.T @ u, torch.eye(8, dtype=torch.float64))
    assert bool((s[:-1] >= s[1:]).all())
    x = torch.randn(5, 24, dtype=torch.float64)
    torch.testing.assert_close(((x @ u) * s) @ bt, x @ weight.double().T)   # K = X U Σ Bᵀ = X weightᵀ


def test_planted_direction_gives_first_channel_outliers_and_the_outlier_key_channel():
    w, u_true, _ = planted(peaks=(5,))
    weight = w.T.float()                              # kvzoo orientation (r, d)
    u, s, bt = svd_factors(weight)
    x = tokens_along(u_true, scales=[20.0])           # every token close to ±u_0 up to scale
    stats = latent_stats(x, u.float())
    assert stats["top_channel"] == 0 and stats["led_by_first"] == 1.0
    assert stats["share"] > 0.5 and stats["energy_share"] > 0.95 and stats["dominance"] > 10
    assert stats["cos_first"] > 0.95
    keys = x @ weight.T                               # (L, r) pre-RoPE keys
    assert int(outlier_channel(keys)) == 5
    assert predicted_outlier_channels(bt, 1).tolist() == [5]
    assert int(prediction_rank(bt, 5)) == 1
    # the control: an unrelated projection spreads X over its latent channels
    u_v, _, _ = svd_factors(torch.randn(12, 48))
    control = latent_stats(x, u_v.float())
    assert control["share"] < 0.5 and control["cos_first"] < 0.9


def test_a_stronger_second_latent_channel_defeats_the_weights_only_prediction():
    """The paper's failure case 1: X leans on u_1, whose row of Bᵀ peaks elsewhere."""
    w, u_true, _ = planted(sigmas=(10.0, 8.0), peaks=(2, 9))
    weight = w.T.float()
    u, s, bt = svd_factors(weight)
    x = tokens_along(u_true, scales=[0.5, 20.0])
    assert latent_stats(x, u.float())["top_channel"] == 1
    truth = int(outlier_channel(x @ weight.T))
    assert truth == 9 and predicted_outlier_channels(bt, 1).tolist() == [2]
    assert int(prediction_rank(bt, truth)) > 1
    assert int(prediction_rank(bt, truth, row=1)) == 1


def test_ranks_ties_and_batched_ground_truth():
    bt = torch.tensor([[0.1, -0.9, 0.5, 0.3], [1.0, 0.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4])
    assert prediction_rank(bt, torch.tensor([1, 2, 3, 0])).tolist() == [1, 2, 3, 4]
    assert predicted_outlier_channels(bt, 2).tolist() == [1, 2]
    keys = torch.zeros(2, 7, 4)                       # (sequences, T, r)
    keys[0, :, 3] = -5.0
    keys[1, :, 1] = 2.0
    assert outlier_channel(keys).tolist() == [3, 1]
    # rotate-half RoPE pairs dims i and i + hd/2 of one head
    assert rope_pair(torch.tensor([0, 4, 3, 7, 8, 12]), head_dim=8).tolist() == [0, 0, 3, 3, 4, 4]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (vocab 97) with a character-level tokenizer.json, as a model folder."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    path = tiny_llama(tmp_path_factory.mktemp("tiny"))
    chars = ["\n"] + [chr(c) for c in range(32, 127)]                    # 96 characters + <unk> = 97 ids
    tok = RustTokenizer(models.WordLevel({"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.save(str(path / "tokenizer.json"))
    return path


@torch.no_grad()
def test_analyze_hooks_see_the_normalized_attention_input(tiny_dir):
    model = load_weights(tiny_dir)
    ids = torch.randint(0, 97, (3 * 24 + 5,), generator=torch.Generator().manual_seed(0))
    result = analyze(model, ids, seq_len=24, max_windows=None, ks=(1, 2), progress=False)
    assert result["windows"] == 3 and result["rank"] == 32 and len(result["layers"]) == 2

    # layer 0's input is RMSNorm(embedding): recompute every statistic by hand
    tokens = ids[:72].view(3, 24)
    x = model.layers[0].attn_norm(model.embed(tokens))                   # (3, 24, 64)
    attn = model.layers[0].attn
    u_k, _, bt_k = svd_factors(attn.k_proj.weight)
    layer0 = result["layers"][0]
    expected = latent_stats(x, u_k.float())
    for key, value in expected.items():
        assert layer0["xu_k"][key] == pytest.approx(value, rel=1e-4)
    k_pre = attn.k_proj(x)                                               # (3, 24, 32)
    assert layer0["pre_rope"]["outlier_per_sequence"] == outlier_channel(k_pre).tolist()
    assert layer0["pre_rope"]["rank_per_sequence"] == prediction_rank(bt_k, outlier_channel(k_pre)).tolist()
    pos = torch.arange(24).expand(3, 24)
    k_post = attn.rope.apply(k_pre.view(3, 24, 2, 16).transpose(1, 2), pos).transpose(1, 2).reshape(3, 24, 32)
    assert layer0["post_rope"]["outlier_per_sequence"] == outlier_channel(k_post).tolist()
    summary = result["summary"]
    assert summary["chance"] == {1: 1 / 32, 2: 2 / 32}
    assert 0 <= summary["hit_pre_rope_bk"][1] <= summary["hit_pre_rope_bk"][2] <= 1

    # an fp16 cache (simulated mode) is lossless: the same statistics
    again = analyze(model, ids, seq_len=24, max_windows=None, ks=(1, 2), cache="fp16", progress=False)
    assert again["layers"][1]["pre_rope"] == result["layers"][1]["pre_rope"]
    assert again["layers"][1]["xu_k"]["share"] == pytest.approx(result["layers"][1]["xu_k"]["share"], rel=1e-4)

    with pytest.raises(ValueError, match=r"top-k values must lie in \[1, 32\]"):
        analyze(model, ids, seq_len=24, ks=(1, 64), progress=False)
    with pytest.raises(ValueError, match="fewer than one window of 100"):
        analyze(model, ids, seq_len=100, progress=False)


def test_script_end_to_end_writes_json_and_plot(tiny_dir, tmp_path):
    pytest.importorskip("matplotlib")   # --plot (the `eval` extra)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 20)
    target, figure = tmp_path / "out" / "outliers.json", tmp_path / "out" / "outliers.png"
    cmd = [sys.executable, "-m", "repro.xquant.outliers", "--model", str(tiny_dir), "--device", "cpu",
           "--data-path", str(text), "--seq-len", "64", "--max-windows", "3", "--top-k", "1,2,4",
           "--json", str(target), "--plot", str(figure)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "pre-RoPE keys (the paper's)" in out.stdout and "hit@4" in out.stdout
    result = json.loads(target.read_text())
    assert result["windows"] == 3 and result["seq_len"] == 64 and result["ks"] == [1, 2, 4]
    assert [layer["layer"] for layer in result["layers"]] == [0, 1]
    assert len(result["layers"][1]["pre_rope"]["rank_per_sequence"]) == 3
    assert set(result["summary"]["hit_pre_rope_bk"]) == {"1", "2", "4"}
    assert figure.stat().st_size > 0

    status, err = run_script(cmd[3:])                 # again: refused before any work, file untouched
    assert status == 2 and "exists; choose another path or pass --overwrite" in err
    assert json.loads(target.read_text()) == result


def run_script(argv: list[str]) -> tuple[int, str]:
    """Run the script's main() in this process (no interpreter start-up): (exit status, stderr)."""
    import contextlib
    import io

    from repro.xquant import outliers as script

    err = io.StringIO()
    old, sys.argv = sys.argv, ["repro.xquant.outliers", *argv]
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
            script.run(script.main)
    finally:
        sys.argv = old
    return stop.value.code, err.getvalue()


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "0,2"], "--top-k takes comma-separated positive integers like 1,2,4,8, got '0,2'"),
    (["--top-k", "one"], "--top-k takes comma-separated positive integers"),
    (["--plot", "figure.jpg"], "the file type is taken from its suffix; accepted: .png, .pdf, .svg"),
    (["--seq-len", "1"], "seq_len must be at least 2"),
])
def test_script_refuses_bad_arguments(extra, message, tiny_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("abc " * 100)
    status, err = run_script(["--model", str(tiny_dir), "--device", "cpu", "--data-path", str(text), *extra])
    assert status == 2 and message in err and "Traceback" not in err
