"""XQuant Appendix B on any kvzoo model: the first-channel outliers of X U_k, and how well the first row
of B_kᵀ (from the SVD W_k = U_k Σ_k B_kᵀ, weights only) predicts the keys' outlier channel (Table B.2).

    python -m repro.xquant.outliers --seq-len 2048 --max-windows 4 --json results/xquant-outliers.json

Per layer: σ0/σ1 of W_k; for Z = X U_k (X = attention input after RMSNorm) the share of Σ|Z| in
channel 0 (uniform would be 1/r), channel 0's mean |Z| over the next-largest channel's, and the fraction
of tokens whose largest |Z| entry is channel 0; the same share for X U_v (the paper's control); the
measured outlier channel of the pre-RoPE keys (largest mean |K|, written head:dim), its rank among
|B_kᵀ[0, :]| (1 = predicted top-1), and the fraction of windows where the top-1 / top-K prediction hits.
The statistics are defined in repro/xquant/analysis.py. --cache fp16 (the default) runs plain attention;
another strategy runs the windows through it in simulated mode, so later layers see its quantized attention.
"""

import argparse
from pathlib import Path

from kvzoo.cli import (PLOT_SUFFIXES, add_model_args, check_output, load_from_args, parse_cache_args, run,
                       write_json)
from kvzoo.eval.datasets import DATASETS, load_text

from repro.xquant.analysis import analyze


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--top-k takes comma-separated positive integers like 1,2,4,8, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise ValueError(f"--top-k takes comma-separated positive integers like 1,2,4,8, got {text!r}")
    return ks


def channel_name(c: int, head_dim: int) -> str:
    return f"{c // head_dim}:{c % head_dim}"


def print_table(result: dict) -> None:
    ks, hd, kmax = result["ks"], result["head_dim"], max(result["ks"])
    head = (f"{'layer':>5}  {'σ0/σ1':>6}  {'XUk ch0':>7}  {'ch0/nxt':>7}  {'led':>5}  {'XUv ch0':>7}  "
            f"{'K outlier':>9}  {'rank':>4}  {'hit@1':>5}  {f'hit@{kmax}':>6}  {'post-RoPE':>9}")
    print(head)
    print("-" * len(head))
    for res in result["layers"]:
        xk, xv, pre = res["xu_k"], res["xu_v"], res["pre_rope"]
        post = res.get("post_rope", {}).get("outlier_pooled")
        print(f"{res['layer']:>5}  {res['sigma0_over_sigma1_k']:>6.2f}  {xk['share']:>7.3f}  {xk['dominance']:>7.2f}  "
              f"{xk['led_by_first']:>5.2f}  {xv['share']:>7.3f}  {channel_name(pre['outlier_pooled'], hd):>9}  "
              f"{pre['rank_pooled']:>4}  {pre['hit'][1] if 1 in ks else float('nan'):>5.2f}  "
              f"{pre['hit'][kmax]:>6.2f}  {channel_name(post, hd) if post is not None else '-':>9}")


def print_summary(result: dict) -> None:
    s, ks, r = result["summary"], result["ks"], result["rank"]
    n = s["layers"]
    pairs = n * result["windows"]

    def row(name: str, rates: dict) -> None:
        print(f"  {name:<42}" + "  ".join(f"k={k}: {100 * rates[k]:6.2f}%" for k in ks))

    print()
    print(f"X U_k first channel: share of Σ|X U_k| {s['mean_share_k']:.3f} (uniform 1/r = {1 / r:.4f}; "
          f"X U_v {s['mean_share_v']:.3f}), energy share {s['mean_energy_share_k']:.3f}, "
          f"{s['mean_dominance_k']:.1f}x the next channel, largest for {100 * s['mean_led_by_first_k']:.1f}% of "
          f"tokens, mean |cos(x, u0)| {s['mean_cos_first_k']:.3f} (layer means)")
    print(f"  channel 0 is the largest latent channel in {s['layers_with_first_latent_channel_largest_k']}/{n} "
          f"layers for X U_k, {s['layers_with_first_latent_channel_largest_v']}/{n} for X U_v")
    print(f"Key outlier channel predicted by top-k |B_kᵀ[0, :]| ({pairs} = {n} layers x {result['windows']} "
          f"windows, r = {r} key channels):")
    row("pre-RoPE keys (the paper's)", s["hit_pre_rope_bk"])
    row("post-RoPE keys", s["hit_post_rope_bk"])
    if "pair_hit_post_rope_bk" in s:
        row("post-RoPE, either of the RoPE pair", s["pair_hit_post_rope_bk"])
    row("pre-RoPE, top-k of |B_vᵀ[0, :]| (literal)", s["hit_pre_rope_bv"])
    row("pre-RoPE, B_kᵀ row of largest measured Z", s["hit_pre_rope_bk_top_row"])
    row("chance (k / r)", s["chance"])


def plot(result: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [res["layer"] for res in result["layers"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(layers, [res["xu_k"]["share"] for res in result["layers"]], "o-", label="X U_k")
    ax1.plot(layers, [res["xu_v"]["share"] for res in result["layers"]], "s-", label="X U_v")
    ax1.axhline(1 / result["rank"], color="gray", ls=":", label=f"uniform 1/r = 1/{result['rank']}")
    ax1.set(xlabel="layer", ylabel="share of Σ|Z| in latent channel 0", ylim=(0, None),
            title="first-channel share of the latent X U")
    ax1.legend()
    ranks = [res["pre_rope"]["rank_per_sequence"] for res in result["layers"]]
    for w in range(result["windows"]):
        ax2.scatter(layers, [rk[w] for rk in ranks], s=14, alpha=0.6, color="C0", label="window" if w == 0 else None)
    for k in result["ks"]:
        ax2.axhline(k + 0.5, color="gray", ls=":", lw=0.8)
    ax2.set_yscale("log")
    ax2.set(xlabel="layer", ylabel="rank of true outlier in |B_kᵀ[0, :]|",
            title="pre-RoPE key outlier channel (dotted: top-k cuts)")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.xquant.outliers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2")
    parser.add_argument("--data-path", default=None, help="override the dataset file (default: ../shared/data)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
    parser.add_argument("--max-windows", type=int, default=4, help="windows of text to run (default 4)")
    parser.add_argument("--top-k", default="1,2,4,8", help="prediction sizes, comma-separated (Table B.2: 1,2,4,8)")
    parser.add_argument("--json", default=None, help="also write the per-layer results to this JSON file")
    parser.add_argument("--plot", default=None,
                        help="also plot per-layer first-channel share and ranks (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    spec = parse_cache_args(args)
    ks = parse_ks(args.top_k)
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)

    text = load_text(args.dataset, args.data_path)
    model, tokenizer = load_from_args(args)
    ids = tokenizer.encode(text)
    # fp16 is lossless: run plain attention; any other strategy runs in simulated mode
    result = analyze(model, ids, seq_len=args.seq_len, max_windows=args.max_windows, ks=ks,
                     cache=None if spec.name == "fp16" else spec)
    name = args.model or "smollm2-135m-instruct"
    print(f"model {name}  dataset {args.dataset}  {result['windows']} windows x {result['seq_len']} tokens  "
          f"cache {spec}  r = {result['rank']} key channels (head:dim)")
    print_table(result)
    print_summary(result)
    if args.json:
        write_json(args.json, {"model": name, "dataset": args.dataset, "cache": str(spec),
                               "dtype": str(model.dtype).removeprefix("torch."), **result},
                   overwrite=args.overwrite)
    if args.plot:
        plot(result, args.plot, f"{name}, {args.dataset}, {result['windows']}x{result['seq_len']} tokens")


if __name__ == "__main__":
    run(main)
