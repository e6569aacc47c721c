"""Chat with a model through a KV-cache strategy.

    python scripts/chat.py --cache fp16                       # interactive, with history
    python scripts/chat.py --prompt "Hello!" --temperature 0  # one answer, then exit

After every answer it prints decode tokens/s and the bytes the cache strategy holds (and their ratio to
an fp16 cache). Ctrl-C or Ctrl-D leave cleanly; "/reset" clears the history.
"""

import argparse
import sys

from kvzoo.cli import add_model_args, parse_cache_args, human_bytes, load_from_args, run
from kvzoo.generate import check_sampling, generate


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


def answer(model, tokenizer, messages: list[dict], args, stream: bool) -> str:
    context = model.cfg.max_position_embeddings
    ids = render(tokenizer, messages)
    while len(ids) + 1 > context and len(messages) > 2:      # forget the oldest exchange, keep the system turn
        first = 1 if messages[0]["role"] == "system" else 0
        del messages[first:first + 2]
        ids = render(tokenizer, messages)
    streamer = Streamer(tokenizer) if stream else None
    out = generate(model, tokenizer, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, cache=args.cache, on_step=streamer,
                   prefill_chunk=args.prefill_chunk, compile=args.compile)
    if stream:
        print(out.texts[0][len(streamer.shown):])
    else:
        print(out.texts[0])
    print(f"[{out.new_tokens} tokens, {out.decode_tokens_per_s:.1f} tok/s decode, prompt {out.prompt_tokens} "
          f"tokens in {out.prefill_seconds:.2f} s | cache {args.cache}: {human_bytes(out.cache_nbytes)}, "
          f"{out.kv_ratio:.3f}x fp16]", file=sys.stderr)
    return out.texts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompt", default=None, help="answer this one message and exit")
    parser.add_argument("--system", default=None, help="system message (default: the template's own)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.2, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prefill the prompt this many tokens at a time (chunked prefill)")
    parser.add_argument("--compile", action="store_true",
                        help="replay decode steps from CUDA graphs (kvzoo/graphs.py): the whole step for fp16 and "
                             "innerq (its kernel, unpadded rows), all but attention for the other strategies")
    args = parser.parse_args()
    parse_cache_args(parser, args)
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)

    model, tokenizer = load_from_args(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        answer(model, tokenizer, system + [{"role": "user", "content": args.prompt}], args, stream=False)
        return

    print(f"kvzoo chat: {model.cfg.architecture}, cache {args.cache}. Ctrl-D or Ctrl-C to leave, /reset to "
          "clear the history.", file=sys.stderr)
    messages = list(system)
    while True:
        try:
            user = input("\nyou> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not user:
            continue
        if user == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": user})
        print("bot> ", end="", flush=True)
        try:
            reply = answer(model, tokenizer, messages, args, stream=True)
        except KeyboardInterrupt:            # stop this answer, keep the session
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        except ValueError as err:            # e.g. a message longer than the context
            print(f"\nerror: {err}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    run(main)
