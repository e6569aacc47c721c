"""Why XQuant's MHA path (X cached per token) loses where its GQA path (SVD latents) does not: the error of
the keys and values each path rematerializes, against KIVI* quantizing K and V directly, per layer.

    python -m repro.xquant.mha_error --windows 2 --seq-len 512 --json results/xquant/mha-error.json \
        --plot results/xquant/mha-error.png

For each layer's attention input X (after RMSNorm, captured by a forward pre-hook on block.attn) on the first
--windows windows of WikiText-2, at 2, 3 and 4 bits (asymmetric, fp16 scales and zeros, every token quantized),
the relative Frobenius error ||K̂ - K|| / ||K|| (and the same for V), K = X W_k before RoPE:
    mha     X per token (groups of Gt = 96 of the hidden channels), K̂ = X̂ W_k        (XQuant, MHA path)
    gqa     X U_k per channel (groups of 128 tokens), X U_v per token (Gt = 96), K̂ = (X U_k)^ Σ_k B_kᵀ
                                                                                      (XQuant, GQA path)
    kivi    K per channel (groups of 128 tokens), V per token (groups of head_dim)   (KIVI*)
(128 tokens, or the whole window when it is shorter; a window is cut to a whole number of token groups).
The MHA path's K of the GQA model equals expand_to_mha's with its heads repeated, so the ratios are the same.
Also the relative error of X̂ itself, and X's outliers that the per-token groups must absorb: the share of
(token, group) pairs whose largest |x| exceeds 20x the group's median |x|, the share of tokens with at least
one such group, and the largest channel's mean |x| over the median channel's (and which channel it is).
"""

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from kvzoo.cache.kvquant import dequantize, quantize
from kvzoo.cache.store import token_group
from kvzoo.cache.xquant import svd_factors
from kvzoo.cli import PLOT_SUFFIXES, add_model_args, check_output, load_from_args, run, write_json
from kvzoo.eval.capture import per_layer_attention
from kvzoo.eval.datasets import load_text

BITS = (2, 3, 4)
PATHS = ("mha", "gqa", "kivi")
GROUP = 128        # the paper's group size for every quantizer
SPIKE = 20.0       # a per-token group is "spiky" when its max |x| exceeds SPIKE x its median |x|


def round_trip(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """x (T, c) quantized and dequantized, fp32 (groups along tokens: axis -2, within a token: axis -1)."""
    return dequantize(quantize(x, bits, group, axis=axis, scale_dtype=torch.float16))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def layer_errors(attn, x: torch.Tensor, pos=None) -> dict:
    """Relative K and V errors of the three paths at every bit width, and X's outlier statistics, for one
    layer's attention input x (1, T, hidden). pos is unused: keys are compared before RoPE."""
    x = x[0].float()                                                           # (T, hidden)
    g_tok = min(GROUP, x.shape[0])                                             # tokens per per-channel group
    T = x.shape[0] // g_tok * g_tok
    x = x[:T]
    w_k, w_v = attn.k_proj.weight.float(), attn.v_proj.weight.float()          # (n_kv*hd, hidden)
    k, v = x @ w_k.T, x @ w_v.T                                                # (T, n_kv*hd)
    (u_k, up_k), (u_v, up_v) = svd_factors(attn.k_proj.weight), svd_factors(attn.v_proj.weight)
    zk, zv = x @ u_k, x @ u_v                                                  # (T, r) latents
    gt = token_group(x.shape[1], GROUP)                                        # 96 for hidden 576
    gt_v = token_group(zv.shape[1], GROUP)                                     # 96 for r = 192
    out = {}
    for b in BITS:
        x_hat = round_trip(x, b, gt, -1)
        out[b] = {"mha": {"k": rel(x_hat @ w_k.T, k), "v": rel(x_hat @ w_v.T, v), "x": rel(x_hat, x)},
                  "gqa": {"k": rel(round_trip(zk, b, g_tok, -2) @ up_k, k),
                          "v": rel(round_trip(zv, b, gt_v, -1) @ up_v, v)},
                  "kivi": {"k": rel(round_trip(k, b, g_tok, -2), k),
                           "v": rel(round_trip(v, b, attn.head_dim, -1), v)}}
    groups = x.abs().view(T, -1, gt)                                           # (T, hidden / gt, gt)
    spiky = groups.amax(-1) > SPIKE * groups.median(-1).values                 # (T, hidden / gt)
    channel = x.abs().mean(0)                                                  # (hidden,)
    return {"errors": out, "spiky_groups": spiky.float().mean().item(),
            "spiky_tokens": spiky.any(-1).float().mean().item(),
            "top_channel_over_median": (channel.max() / channel.median()).item(),
            "top_channel": int(channel.argmax()), "tokens": T, "token_group": g_tok, "channel_group": gt}


def average(runs: list[dict]) -> dict:
    """One layer's results averaged over windows (the top channel: the most frequent one)."""
    n = len(runs)
    tops = [r["top_channel"] for r in runs]
    return {"errors": {b: {p: {t: sum(r["errors"][b][p][t] for r in runs) / n for t in runs[0]["errors"][b][p]}
                           for p in PATHS} for b in BITS},
            **{key: sum(r[key] for r in runs) / n for key in ("spiky_groups", "spiky_tokens", "top_channel_over_median")},
            "top_channel": max(set(tops), key=tops.count), "top_channel_per_window": tops}


def stat(vals: list[float]) -> dict:
    worst = max(vals)
    return {"mean": sum(vals) / len(vals), "worst": worst, "worst_layer": vals.index(worst)}


def summarize(layers: list[dict]) -> dict:
    """Mean over layers and the worst layer of every (bits, path, K/V) error and of the outlier statistics."""
    summary = {}
    for b in BITS:
        for p in PATHS:
            for t in layers[0]["errors"][b][p]:
                summary[f"{b}bit_{p}_{t}"] = stat([layer["errors"][b][p][t] for layer in layers])
    for key in ("spiky_groups", "spiky_tokens", "top_channel_over_median"):
        summary[key] = stat([layer[key] for layer in layers])
    return summary


def print_table(summary: dict, layers: list[dict], channel_group: int) -> None:
    head = f"{'bits':>4}  {'path':<5}  {'K mean':>7}  {'K worst (layer)':>15}  {'V mean':>7}  {'V worst (layer)':>15}"
    print(head)
    print("-" * len(head))
    for b in BITS:
        for p in PATHS:
            k, v = summary[f"{b}bit_{p}_k"], summary[f"{b}bit_{p}_v"]
            print(f"{b:>4}  {p:<5}  {k['mean']:>7.4f}  {k['worst']:>9.4f} ({k['worst_layer']:>2})  "
                  f"{v['mean']:>7.4f}  {v['worst']:>9.4f} ({v['worst_layer']:>2})")
    print("X̂ itself (mha): " + ", ".join(f"{b}-bit mean {summary[f'{b}bit_mha_x']['mean']:.4f}" for b in BITS))
    sg, st, tc = summary["spiky_groups"], summary["spiky_tokens"], summary["top_channel_over_median"]
    tops = [layer["top_channel"] for layer in layers]
    common = max(set(tops), key=tops.count)
    print(f"X outliers (per-token groups of {channel_group} channels, max |x| > {SPIKE:g}x median):")
    print(f"  share of groups: mean {sg['mean']:.3f}, worst {sg['worst']:.3f} (layer {sg['worst_layer']}); "
          f"share of tokens with one: mean {st['mean']:.3f}, worst {st['worst']:.3f} (layer {st['worst_layer']})")
    print(f"  largest channel / median channel (mean |x|): mean {tc['mean']:.1f}, worst {tc['worst']:.1f} "
          f"(layer {tc['worst_layer']}); largest channel {common} in {tops.count(common)}/{len(tops)} layers")


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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.xquant.mha_error", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--windows", type=int, default=2, help="WikiText-2 windows (default 2)")
    parser.add_argument("--data-path", default=None, help="override the WikiText-2 file (default: ../shared/data)")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="tokens per window (default 512; cut to a multiple of 128 when longer)")
    parser.add_argument("--json", default=None, help="write per-layer errors and the summary to this JSON file")
    parser.add_argument("--plot", default=None, help="relative K error per layer at 3 bits (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    if args.seq_len < 2 or args.windows < 1:
        raise ValueError(f"--seq-len must be >= 2 and --windows >= 1, got {args.seq_len} and {args.windows}")
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)
    model, tokenizer = load_from_args(args)
    ids = torch.tensor(tokenizer.encode(load_text("wikitext2", args.data_path)))
    if len(ids) < args.windows * args.seq_len:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {args.windows} windows of {args.seq_len}")
    runs = [per_layer_attention(model, ids[w * args.seq_len:(w + 1) * args.seq_len], layer_errors)
            for w in tqdm(range(args.windows), desc="windows")]
    layers = [{"layer": i, **average([r[i] for r in runs])} for i in range(len(runs[0]))]
    summary = summarize(layers)
    name = args.model or "smollm2-135m-instruct"
    first = runs[0][0]
    print(f"model {name}  WikiText-2  {args.windows} windows x {args.seq_len} tokens ({first['tokens']} used)  "
          f"groups: {first['token_group']} tokens per channel, {first['channel_group']} channels per token")
    print_table(summary, layers, first["channel_group"])
    if args.json:
        write_json(args.json, {"model": name, "dtype": str(model.dtype).removeprefix("torch."), "dataset": "wikitext2",
                               "windows": args.windows, "seq_len": args.seq_len, "tokens_used": first["tokens"],
                               "token_group": first["token_group"], "channel_group": first["channel_group"],
                               "bits": list(BITS), "spike_ratio": SPIKE, "summary": summary, "layers": layers},
                   overwrite=args.overwrite)
    if args.plot:
        plot(layers, args.plot, f"{name}, WikiText-2, {args.windows} x {args.seq_len} tokens")


if __name__ == "__main__":
    run(main)
