"""Command-line pieces shared by scripts/ and repro/: model/cache/device arguments, checked before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from kvzoo.cache.base import CacheSpec, get_strategy, list_caches
from kvzoo.models.loader import DTYPES


def strategy_options() -> dict[str, type]:
    """Every option name any registered strategy declares -> its type (for --bits, --group-size ...)."""
    found: dict[str, type] = {}
    for name in list_caches():
        for f in dataclasses.fields(get_strategy(name).Options):
            found.setdefault(f.name, type(getattr(get_strategy(name).Options(), f.name)))
    return found


def add_model_args(parser: argparse.ArgumentParser, cache: bool = True) -> None:
    """--model, --device, --dtype, --mha and (cache=True) --cache, --cache-opts and a flag per strategy option;
    scripts that take their caches another way (report.py's --caches) or none pass cache=False."""
    parser.add_argument("--model", default=None,
                        help="local HF folder or hub id (default: the embedded SmolLM2-135M-Instruct)")
    if cache:
        parser.add_argument("--cache", default="fp16",
                            help=f"KV-cache strategy (available: {', '.join(list_caches())}); options may follow "
                                 "as name:key=value,...")
        parser.add_argument("--cache-opts", default="", help="strategy options as key=value,key=value")
        for name in strategy_options():
            parser.add_argument(f"--{name.replace('_', '-')}", dest=f"opt_{name}", default=None,
                                metavar=name.upper(), help="strategy option (only for strategies that declare it)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights and activations (auto: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--mha", action="store_true",
                        help="expand GQA to multi-head attention by repeating each KV head (the same function; "
                             "XQuant's MHA path)")


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; accepted: cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but this machine has no CUDA GPU; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; accepted: cpu, cuda, cuda:N")
    return dev


def parse_cache_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CacheSpec:
    """Merge --cache name[:opts], --cache-opts and --<option> flags into one checked CacheSpec
    (stored back into args.cache); bad names or values end the program through parser.error."""
    text = args.cache + ("," if ":" in args.cache else ":") + args.cache_opts if args.cache_opts else args.cache
    flags = {name: getattr(args, f"opt_{name}") for name in strategy_options()
             if getattr(args, f"opt_{name}") is not None}
    try:
        args.cache = CacheSpec.parse(text, **flags)
    except ValueError as err:
        parser.error(str(err))
    return args.cache


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer) for parsed add_model_args arguments; with --mha the model is expanded from GQA to
    the equivalent multi-head attention (kvzoo/models/mha.py) right after loading."""
    from kvzoo import load_model
    from kvzoo.models.mha import expand_to_mha

    device = check_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    model, tokenizer = load_model(args.model, device=device, dtype=dtype, progress=True)
    if getattr(args, "mha", False):
        expand_to_mha(model)
    return model, tokenizer


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_output(path: str | None, overwrite: bool, suffixes: tuple[str, ...] | None = None) -> None:
    """Before any work: refuse an output path that exists (unless overwrite) or has the wrong suffix."""
    if path is None:
        return
    if suffixes and Path(path).suffix.lower() not in suffixes:
        raise ValueError(f"--plot {path}: the file type is taken from its suffix; accepted: {', '.join(suffixes)}")
    if Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} exists; choose another path or pass --overwrite")


def write_json(path: str | Path, payload: dict, overwrite: bool = False) -> None:
    """Write results, refusing to replace an existing file unless asked to."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; choose another --json path or pass --overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def run(main) -> None:
    """Run a script's main(), turning user errors into one clear line and exit code 2."""
    try:
        main()
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)


def numbers(text: str, kind, name: str) -> list:
    """--name's comma-separated values as `kind` (int or float); a clear error naming the option otherwise."""
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated numbers, got {text!r}") from None


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
