"""Why XQuant's MHA path (X cached per token) loses where its GQA path (SVD latents) does not: the error of
the keys and values each path rematerializes, against KIVI* quantizing K and V directly, per layer.

    python -m repro.xquant.mha_error --windows 2 --seq-len 512 --json results/xquant/mha-error.json \
        --plot results/xquant/mha-error.png

For each layer's attention input X (after RMSNorm) on WikiText-2 windows, at 2, 3 and 4 bits, the relative
Frobenius error ||K̂ - K|| / ||K|| (and the same for V), K = X W_k before RoPE:
    mha     X quantized per token (groups of Gt = 96 of the hidden channels), K̂ = X̂ W_k     (XQuant, MHA)
    gqa     X U_k per channel (groups of 128 tokens), X U_v per token (Gt = 96), K̂ = (X U_k)^ Σ_k B_kᵀ
    kivi    K per channel (groups of 128 tokens), V per token (groups of head_dim)          (KIVI*)
and the outliers of X that the per-token groups must hold: the share of (token, group) pairs whose largest
|x| exceeds 20x the group's median |x|, and the largest channel's mean |x| over the median channel's.
"""

import argparse

import torch

from kvzoo.cache.kvquant import dequantize, quantize
from kvzoo.cache.store import token_group
from kvzoo.cache.xquant import svd_factors
from kvzoo.cli import PLOT_SUFFIXES, add_model_args, check_output, load_from_args, run, write_json
from kvzoo.eval.capture import per_layer_attention
from kvzoo.eval.datasets import load_text

BITS = (2, 3, 4)
GROUP = 128        # the paper's group size for every quantizer


def round_trip(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """x (T, c) quantized and dequantized, fp32 (groups along tokens: axis -2, within a token: axis -1)."""
    return dequantize(quantize(x, bits, group, axis=axis, scale_dtype=torch.float16))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def layer_errors(attn, x: torch.Tensor, pos=None) -> dict:
    """Relative K and V errors of the three paths at every bit width, and X's outlier statistics (pos unused:
    keys are compared before RoPE)."""
    x = x[0].float()                                                           # (T, hidden)
    T = x.shape[0] // GROUP * GROUP
    x = x[:T]
    w_k, w_v = attn.k_proj.weight.float(), attn.v_proj.weight.float()          # (n_kv*hd, hidden)
    k, v = x @ w_k.T, x @ w_v.T                                                # (T, n_kv*hd)
    (u_k, up_k), (u_v, up_v) = svd_factors(attn.k_proj.weight), svd_factors(attn.v_proj.weight)
    gt = token_group(x.shape[1], GROUP)
    out = {}
    for b in BITS:
        x_hat = round_trip(x, b, gt, -1)
        zk, zv = x @ u_k, x @ u_v                                              # (T, r) latents
        zk_hat = round_trip(zk, b, GROUP, -2)
        zv_hat = round_trip(zv, b, token_group(zv.shape[1], GROUP), -1)
        out[b] = {"mha": {"k": rel(x_hat @ w_k.T, k), "v": rel(x_hat @ w_v.T, v)},
                  "gqa": {"k": rel(zk_hat @ up_k, k), "v": rel(zv_hat @ up_v, v)},
                  "kivi": {"k": rel(round_trip(k, b, GROUP, -2), k),
                           "v": rel(round_trip(v, b, attn.head_dim, -1), v)}}
    groups = x.abs().view(T, -1, gt)                                           # (T, hidden / gt, gt)
    spiky = (groups.amax(-1) > 20 * groups.median(-1).values).float().mean().item()
    channel = x.abs().mean(0)                                                  # (hidden,)
    return {"errors": out, "spiky_groups": spiky, "top_channel_over_median": (channel.max() / channel.median()).item()}


def summarize(layers: list[dict]) -> dict:
    """Mean over layers and the worst layer of every (bits, path, K/V) error."""
    summary = {}
    for b in BITS:
        for path in ("mha", "gqa", "kivi"):
            for t in "kv":
                vals = [layer["errors"][b][path][t] for layer in layers]
                summary[f"{b}bit_{path}_{t}"] = {"mean": sum(vals) / len(vals), "worst": max(vals),
                                                  "worst_layer": vals.index(max(vals))}
    return summary


def plot(layers: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("mha", "X per token (XQuant, MHA)"), ("gqa", "SVD latents (XQuant, GQA)"),
                        ("kivi", "K per channel (KIVI*)")):
        ax.plot([layer["errors"][3][name]["k"] for layer in layers], marker="o", ms=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative K error at 3 bits")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.xquant.mha_error", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--windows", type=int, default=2, help="WikiText-2 windows")
    parser.add_argument("--data-path", default=None, help="override the WikiText-2 file (default: ../shared/data)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window (a multiple of 128 is used)")
    parser.add_argument("--json", default=None, help="write per-layer errors and the summary to this JSON file")
    parser.add_argument("--plot", default=None, help="relative K error per layer at 3 bits (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    if args.seq_len < GROUP or args.windows < 1:
        raise ValueError(f"--seq-len must be >= {GROUP} and --windows >= 1, got {args.seq_len} and {args.windows}")
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)
    model, tokenizer = load_from_args(args)
    ids = torch.tensor(tokenizer.encode(load_text("wikitext2", args.data_path)))
    runs = [per_layer_attention(model, ids[w * args.seq_len:(w + 1) * args.seq_len], layer_errors)
            for w in range(args.windows)]
    layers = []
    for i in range(len(runs[0])):                                               # average over windows
        per = [run_[i] for run_ in runs]
        layers.append({"errors": {b: {p: {t: sum(r["errors"][b][p][t] for r in per) / len(per) for t in "kv"}
                                      for p in ("mha", "gqa", "kivi")} for b in BITS},
                       "spiky_groups": sum(r["spiky_groups"] for r in per) / len(per),
                       "top_channel_over_median": sum(r["top_channel_over_median"] for r in per) / len(per)})
    summary = summarize(layers)
    print(f"{'bits':>4}  {'path':<5}  {'K mean':>8}  {'K worst (layer)':>16}  {'V mean':>8}  {'V worst (layer)':>16}")
    for b in BITS:
        for p in ("mha", "gqa", "kivi"):
            k, v = summary[f"{b}bit_{p}_k"], summary[f"{b}bit_{p}_v"]
            print(f"{b:>4}  {p:<5}  {k['mean']:>8.4f}  {k['worst']:>8.4f} ({k['worst_layer']:>2})     "
                  f"{v['mean']:>8.4f}  {v['worst']:>8.4f} ({v['worst_layer']:>2})")
    spiky = [layer["spiky_groups"] for layer in layers]
    top = [layer["top_channel_over_median"] for layer in layers]
    print(f"X outliers: groups with max > 20x median: mean {sum(spiky) / len(spiky):.3f}, worst {max(spiky):.3f}; "
          f"largest channel / median channel (mean |x|): mean {sum(top) / len(top):.1f}, worst {max(top):.1f}")
    name = args.model or "smollm2-135m-instruct"
    if args.json:
        write_json(args.json, {"model": name, "windows": args.windows, "seq_len": args.seq_len, "group": GROUP,
                               "summary": summary, "layers": layers}, overwrite=args.overwrite)
    if args.plot:
        plot(layers, args.plot, f"{name}, WikiText-2, {args.windows} x {args.seq_len} tokens")


if __name__ == "__main__":
    run(main)
