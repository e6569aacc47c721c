"""Command-line pieces shared by scripts/ and repro/: model/cache/device arguments, checked before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import torch

from kvzoo.cache.base import CacheSpec, get_strategy, list_caches
from kvzoo.models.loader import DTYPES


def describe(name: str) -> str:
    """A strategy's description: the first paragraph of its module's docstring, or of its class's for a
    variant defined beside the strategy it extends (kivi-pre, squat-pre), less a leading "Name:" that repeats
    the strategy's name."""
    cls = get_strategy(name)
    variant = any(base.__module__ == cls.__module__ and getattr(base, "name", None) in list_caches()
                  for base in cls.__bases__)
    doc = (cls.__doc__ if variant else sys.modules[cls.__module__].__doc__) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split()).rstrip(".")
    head, colon, rest = first.partition(": ")
    return rest if colon and head.lower() == name else first


def option_notes(options: type) -> dict[str, str]:
    """Option name -> the comment beside its field in the Options dataclass source (or a parent's), if any."""
    notes: dict[str, str] = {}
    for klass in reversed([k for k in options.__mro__ if dataclasses.is_dataclass(k)]):
        for line in inspect.getsource(klass).splitlines():
            found = re.match(r"\s+(\w+)\s*:[^=#]+=[^#]+#\s*(.+)", line)
            if found:
                notes[found[1]] = found[2].strip()
    return notes


def cache_help() -> str:
    """Every registered strategy with its description and its options (default, type, the source's comment),
    for --cache help."""
    lines = ["KV-cache strategies: --cache name, or name:key=value,... (--cache-opts key=value,... adds options)."]
    for name in list_caches():
        options = get_strategy(name).Options
        notes = option_notes(options)
        lines += ["", textwrap.fill(f"{name}: {describe(name)}", width=110, subsequent_indent="    ")]
        for f in dataclasses.fields(options):
            value = getattr(options(), f.name)
            shown = str(value).lower() if isinstance(value, bool) else value
            line = f"    {f.name}={shown}".ljust(30) + f"{type(value).__name__:<6} {notes.get(f.name, '')}"
            lines.append(line.rstrip())
        if not dataclasses.fields(options):
            lines.append("    (no options)")
    return "\n".join(lines)


class CacheArg(argparse.Action):
    """--cache: `help` prints cache_help() and exits while the command line is read, before any model loads."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "help":
            print(cache_help())
            parser.exit()
        setattr(namespace, self.dest, values)


class ListCaches(argparse.Action):
    """--list-caches: cache_help() printed as soon as the flag is read, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(cache_help())
        parser.exit()


def add_model_args(parser: argparse.ArgumentParser, cache: bool = True) -> None:
    """--model, --device, --dtype, --mha and (cache=True) --cache, --cache-opts and --list-caches; scripts that
    take their caches another way (report.py's --caches) or none pass cache=False."""
    parser.add_argument("--model", default=None,
                        help="local HF folder or hub id (default: the embedded SmolLM2-135M-Instruct)")
    if cache:
        parser.add_argument("--cache", default="fp16", action=CacheArg,
                            help=f"KV-cache strategy (available: {', '.join(list_caches())}); options may follow "
                                 "as name:key=value,...; --cache help lists strategies, options and defaults")
        parser.add_argument("--cache-opts", default="", help="strategy options as key=value,key=value")
        parser.add_argument("--list-caches", action=ListCaches, help="the same as --cache help")
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


def parse_cache_args(args: argparse.Namespace) -> CacheSpec:
    """Merge --cache name[:opts] and --cache-opts into one checked CacheSpec (stored back into args.cache); a bad
    name, option or value raises ValueError, which run() prints as one line."""
    text = args.cache + ("," if ":" in args.cache else ":") + args.cache_opts if args.cache_opts else args.cache
    args.cache = CacheSpec.parse(text)
    return args.cache


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer) for parsed add_model_args arguments; with --mha the model is expanded from GQA to
    the equivalent multi-head attention (kvzoo/models/mha.py) right after loading. Launched by torchrun with
    several processes, each loads its tensor-parallel slices (kvzoo/models/tp.py) onto its own GPU, and only
    rank 0 prints."""
    from kvzoo import load_model
    from kvzoo.models import tp
    from kvzoo.models.mha import expand_to_mha

    device = check_device(args.device)
    shard = tp.init(device)
    if shard is not None:
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        if shard.rank:
            quiet()
    dtype = args.dtype if args.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    model, tokenizer = load_model(args.model, device=device, dtype=dtype, progress=True, shard=shard)
    if getattr(args, "mha", False):
        expand_to_mha(model)
    return model, tokenizer


def quiet() -> None:
    """Send this process's output nowhere: a tensor-parallel rank other than 0 computes what rank 0 prints."""
    devnull = open(os.devnull, "w")
    sys.stdout = sys.stderr = devnull


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
    """Write results, refusing to replace an existing file unless asked to; under tensor parallelism rank 0
    writes them."""
    from kvzoo.models import tp

    if tp.rank():
        return
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
    except BrokenPipeError:     # the reader of stdout went away (`--cache help | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush has somewhere to go
        sys.exit(1)


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
