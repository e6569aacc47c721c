"""Chat with a model through a KV-cache strategy.

    python scripts/chat.py                                    # interactive, with history (cache fp16)
    python scripts/chat.py --cache innerq                     # the same through InnerQ's 2-bit cache
    python scripts/chat.py --prompt "Hello!"                  # one answer, then exit
    torchrun --nproc-per-node 2 scripts/chat.py --model DIR   # one model over 2 GPUs (tensor parallel)

Sampling follows the model's generation_config.json where it samples; otherwise (the embedded SmolLM2) answers
are greedy, with a repetition penalty of 1.1 on the answer's own tokens so that a small model does not loop.
--temperature / --top-p / --top-k / --repetition-penalty override them.

In the chat: /quit (or Ctrl-D) leaves, /reset clears the history, /cache <spec> switches strategy (the same
text as --cache), /stats repeats the last answer's numbers, /help lists these. Ctrl-C stops an answer.
After every answer one line gives decode tokens/s and the cache: how many of its tokens are quantized and how
many exact, its bytes, and their ratio to an fp16 cache of the same tokens (and to the model's own dtype).
"""

import argparse
import sys

from kvzoo.cache.base import CacheSpec
from kvzoo.cli import add_model_args, check_device, human_bytes, load_from_args, parse_cache_args, run
from kvzoo.generate import chat_sampling, check_sampling, generate
from kvzoo.models import tp

COMMANDS = {"/quit": "leave (also /exit, Ctrl-D)", "/reset": "forget the conversation",
            "/cache <spec>": "switch the KV-cache strategy, e.g. /cache innerq:bits=2 (--cache help lists them)",
            "/stats": "the last answer's speed and cache numbers", "/help": "this list"}


class Streamer:
    """Prints the first row's text as tokens arrive (holding back an incomplete UTF-8 character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown, self.ended = tokenizer, [], "", False

    def __call__(self, ids: list[int]) -> None:
        if self.ended or ids[0] in self.tokenizer.eos_ids:
            self.ended = True
            return
        self.ids.append(ids[0])
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation in the model's chat template (BOS only if the template writes it)."""
    if tokenizer.has_chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), bos=False)
    return tokenizer.encode("\n".join(m["content"] for m in messages))   # a base model: plain continuation


def summary(out, cache: CacheSpec, dtype_name: str) -> str:
    """One line: speed, then what the cache holds against an fp16 (and the model's dtype) cache of its tokens."""
    k_q, v_q = out.quantized_tokens
    held = (f"{out.stored_tokens} tokens, none quantized" if not (k_q or v_q) else
            f"{out.stored_tokens} tokens, {k_q} keys / {v_q} values quantized, the rest exact")
    ratios = f"{out.kv_ratio:.3f}x an fp16 cache of these tokens"
    if out.model_nbytes != out.fp16_nbytes:
        ratios += f", {out.cache_nbytes / out.model_nbytes:.3f}x this {dtype_name} model's own"
    return (f"[{out.new_tokens} tokens at {out.decode_tokens_per_s:.1f} tok/s; prompt {out.prompt_tokens} tokens in "
            f"{out.prefill_seconds:.2f} s | cache {cache.name}: {held}; {human_bytes(out.cache_nbytes)} = {ratios}]")


def answer(model, tokenizer, messages: list[dict], args, stream: bool):
    context = model.cfg.max_position_embeddings
    ids = render(tokenizer, messages)
    while len(ids) + 1 > context and len(messages) > 2:      # forget the oldest exchange, keep the system turn
        first = 1 if messages[0]["role"] == "system" else 0
        del messages[first:first + 2]
        ids = render(tokenizer, messages)
    streamer = Streamer(tokenizer) if stream else None
    out = generate(model, tokenizer, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                   cache=args.cache, on_step=streamer, prefill_chunk=args.prefill_chunk, compile=args.compile)
    print(out.texts[0][len(streamer.shown):] if stream else out.texts[0])
    if out.finish[0] == "length":
        print(f"[stopped at --max-new-tokens {args.max_new_tokens}]", file=sys.stderr)
    print(summary(out, args.cache, str(model.dtype).removeprefix("torch.")), file=sys.stderr)
    return out


def read_message() -> str | None:
    """The user's next line, None at the end of input; under tensor parallelism rank 0 reads it for every rank."""
    line = None
    if tp.rank() == 0:
        try:
            line = input("\nyou> ").strip()
        except (EOFError, KeyboardInterrupt):
            line = None
    return tp.broadcast(line)


def banner(model, args) -> str:
    seen, params = set(), 0
    world = model.shard.world if model.shard is not None else 1
    for key, p in model.named_parameters():    # tied embeddings counted once; a sharded matrix over every rank
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            params += p.numel() * (world if key.split(".")[-2] in tp.SPLIT_DIM else 1)
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    how = ("greedy" if args.temperature == 0 else
           f"sampled at temperature {args.temperature}" + (f", top-p {args.top_p}" if args.top_p else "")
           + (f", top-k {args.top_k}" if args.top_k else ""))
    if args.repetition_penalty != 1.0:
        how += f", repetition penalty {args.repetition_penalty}"
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    small = " A model this small answers short factual questions best." if params < 1e9 else ""
    where = f"{model.device}" if world == 1 else f"{world} ranks (tensor parallel)"
    return (f"kvzoo chat: {name}, {size} parameters, {str(model.dtype).removeprefix('torch.')} on {where}; "
            f"cache {args.cache}; {how}.{small}\n/help lists commands; /quit or Ctrl-D leaves.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompt", default=None, help="answer this one message and exit")
    parser.add_argument("--system", default=None, help="system message (default: the template's own)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: the model's generation_config; greedy if it does not sample)")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config")
    parser.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="on the answer's own tokens, 1 = none (default: the model's generation_config, else 1.1)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (no effect when greedy)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prefill the prompt this many tokens at a time (chunked prefill)")
    parser.add_argument("--compile", action="store_true",
                        help="on a CUDA GPU, replay decode steps from CUDA graphs (kvzoo/graphs.py): the whole step "
                             "for strategies with a static step, all but attention for the others")
    args = parser.parse_args()
    parse_cache_args(args)
    if args.compile and check_device(args.device).type != "cuda":
        raise ValueError("--compile replays CUDA graphs and needs --device cuda; on a CPU leave it out")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    check_sampling(args.max_new_tokens, temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p,
                   repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty)

    model, tokenizer = load_from_args(args)
    for key, value in chat_sampling(tokenizer.generation_config).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        answer(model, tokenizer, system + [{"role": "user", "content": args.prompt}], args, stream=False)
        return

    print(banner(model, args), file=sys.stderr)
    messages, last = list(system), None
    while True:
        user = read_message()
        if user is None:
            print(file=sys.stderr)
            return
        if not user:
            continue
        command, _, rest = user.partition(" ")
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            messages = list(system)
            print("[history cleared]", file=sys.stderr)
            continue
        if command == "/help":
            print("\n".join(f"  {c:<15} {what}" for c, what in COMMANDS.items()), file=sys.stderr)
            continue
        if command == "/stats":
            print(summary(last, args.cache, str(model.dtype).removeprefix("torch.")) if last else "[no answer yet]",
                  file=sys.stderr)
            continue
        if command == "/cache":
            try:
                args.cache = CacheSpec.parse(rest.strip())
                print(f"[cache {args.cache}; the next answer re-reads the conversation into it]", file=sys.stderr)
            except ValueError as err:
                print(f"error: {err}", file=sys.stderr)
            continue
        if command.startswith("/") and command[1:].isalpha():
            print(f"unknown command {command}; " + ", ".join(c.split()[0] for c in COMMANDS), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": user})
        print("bot> ", end="", flush=True)
        try:
            last = answer(model, tokenizer, messages, args, stream=True)
        except KeyboardInterrupt:            # stop this answer, keep the session
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        except ValueError as err:            # e.g. a message longer than the context
            print(f"\nerror: {err}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": last.texts[0]})


if __name__ == "__main__":
    run(main)
