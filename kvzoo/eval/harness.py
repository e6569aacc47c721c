"""kvzoo as a model of EleutherAI's lm-evaluation-harness, so every cache strategy is scored by the harness
the papers use (InnerQ and SQuat report GSM8K, KV Pareto LongBench, all through lm-eval or its conventions).

    pip install "lm_eval>=0.4.5"        # optional: kvzoo imports without it (scripts/install.sh installs it)
    python scripts/harness.py --model kvzoo --model_args cache=innerq:bits=2,sink=32 --tasks kvzoo_gsm8k_cot

scripts/harness.py is lm-eval's own command line with the model `kvzoo` registered and kvzoo's offline tasks
(kvzoo/eval/tasks) on its task path (the stock `lm_eval` command does not import kvzoo). In Python, `KvzooLM(...)`
goes to `lm_eval.simple_evaluate(model=..., task_manager=TaskManager(include_path=str(task_dir())))`.

model_args (comma-separated, as lm-eval parses them):
    pretrained     a Hugging Face folder or hub id; none: the embedded SmolLM2-135M-Instruct; from Python also a
                   (model, tokenizer) pair kvzoo.load_model returned
    cache          a cache spec, `name` or `name:key=value`; the spec's further options follow as their own
                   model_args (`cache=innerq:bits=2,sink=32,recent=96`): every key that is not one of these
                   arguments is an option of the cache strategy
    dtype          float32 (the default), bfloat16 or float16
    max_length     tokens per window of loglikelihood_rolling and the most a context keeps (its end); default
                   the model's context
    prompt         the first tokens of each rolling window read exact, the cache's statistics taken from them
                   (key norms, smoothing means, subspaces), as a streaming run takes them from its prompt; their
                   predictions are scored too; default min(256, max_length // 8), scripts/perplexity.py's
    prefill_chunk  store contexts that many tokens at a time (chunked prefill)
and lm-eval's own flags: --device (lm-eval's default cuda:0 runs on the CPU where there is no GPU, as its own
models do) and --batch_size N (requests scored side by side,
left-padded; batched results equal unbatched ones).

How each request reads the cache (the strategy's own storage, `mode="streaming"`, or its simulated mode):
    loglikelihood(context, continuation)  the context is prefilled into the cache, stored as the strategy
        stores it; the continuation is then read in one chunk that attends the stored context and itself
        exactly: the log-probability of its tokens, and whether each is the greedy choice.
    loglikelihood_rolling(text)  lm-eval's rolling windows (max_length predictions each, the first predicted
        from the BOS/EOS prefix, a later one from the token before it), each scored in one teacher-forced
        forward in simulated mode: every token predicted as decoding it through the cache would after the
        window's first `prompt` tokens, its exact prompt.
    generate_until(context, gen_kwargs)  kvzoo.generate: greedy unless do_sample (temperature, top_p, top_k as
        given), stopped by `until` or max_gen_toks.
Each call logs the KV bytes the cache held against an fp16 cache of the same tokens (`kv_report`). Each result
goes to lm-eval's response cache as soon as its batch is done, so a run given `--use_cache PATH` and stopped part
way picks up where it stopped when run again (one PATH per model and cache spec: lm-eval keys the responses by
request alone; the KV line then covers the requests run this time).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes
from kvzoo.eval.perplexity import default_prompt
from kvzoo.eval.requests import KVReport, generate_requests
from kvzoo.generate import prefill

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:
    raise ImportError("kvzoo.eval.harness needs EleutherAI's lm-evaluation-harness: "
                      "pip install \"lm_eval>=0.4.5\" (or bash scripts/install.sh)") from err

log = logging.getLogger("lm_eval.models.kvzoo")     # under lm-eval's logger: shown where its own lines are


@register_model("kvzoo")
class KvzooLM(LM):
    """A kvzoo model and cache strategy behind lm-eval's three request types (module docstring)."""

    def __init__(self, pretrained: str | tuple | None = None, cache: str = "fp16", device: str | None = None,
                 dtype: str = "float32", batch_size: int | str | None = 1, max_length: int | None = None,
                 prefill_chunk: int | None = None, prompt: int | None = None, max_batch_size: int | None = None,
                 **cache_options):
        super().__init__()
        from kvzoo import load_model
        from kvzoo.cli import check_device

        if max_batch_size is not None:
            raise ValueError("max_batch_size (lm-eval's automatic batch search) is not supported by the kvzoo "
                             "model; give --batch_size N")
        self.spec = CacheSpec.parse(str(cache), **{k: str(v).lower() if isinstance(v, bool) else str(v)
                                                   for k, v in cache_options.items()})
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by the kvzoo model; give a number of rows")
        self.batch_size = int(batch_size or 1)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefill_chunk is not None and int(prefill_chunk) < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk) if prefill_chunk is not None else None
        device = str(device or "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():   # lm-eval's default is cuda:0
            log.warning("kvzoo: no CUDA GPU here, running on cpu (device %s was asked for)", device)
            device = "cpu"
        if isinstance(pretrained, tuple):                    # (model, tokenizer) already loaded, from Python
            (self.model, self.tokenizer), self.name = pretrained, "kvzoo-model"
        else:
            self.model, self.tokenizer = load_model(pretrained, device=check_device(device), dtype=str(dtype))
            self.name = str(pretrained) if pretrained is not None else "SmolLM2-135M-Instruct"
        context = self.model.cfg.max_position_embeddings
        if max_length is not None and int(max_length) < 2:
            raise ValueError(f"max_length must be >= 2 (a token of context and one to score), got {max_length}")
        self.max_length = min(int(max_length), context) if max_length is not None else context
        if prompt is not None and int(prompt) < 1:
            raise ValueError(f"prompt must be >= 1 (tokens of each rolling window read exact), got {prompt}")
        self.prompt = int(prompt) if prompt is not None else max(1, default_prompt(self.max_length))
        self.prefix = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_ids[0]
        self.kv_report: dict[str, KVReport] = {}

    # ---- what lm-eval asks of a model ----------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template is not False else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ---- loglikelihood ----------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context (BOS by the tokenizer's rule, at least the prefix token) and of the
        continuation as the two tokenize together (trailing spaces of the context move to the continuation, as
        lm-eval's own models do)."""
        spaces = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        head = self.tokenizer.encode(context)
        if not head:
            return [self.prefix], self.tokenizer.encode(continuation, bos=False)
        return whole[:len(head)], whole[len(head):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*r.args) for r in requests]
        out = self._score_pairs(pairs, [r.args for r in requests], disable_tqdm)
        self._log("loglikelihood")
        return out

    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]], args: list[tuple], disable_tqdm: bool = False
                     ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context, batch_size pairs at a time,
        longest first (the batch's padding then stays small); each result is cached under its request's args."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for a in tqdm(range(0, len(order), self.batch_size), desc=f"loglikelihood ({self.spec})",
                      disable=disable_tqdm):
            rows = order[a:a + self.batch_size]
            for i, result in zip(rows, self._score_batch([pairs[i] for i in rows])):
                out[i] = result
                self.cache_hook.add_partial("loglikelihood", args[i], result)
        return out

    @torch.inference_mode()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Prefill each context but its last token (left-padded to one width), then one chunk per row: the
        context's last token and the continuation but its last (right-padded), whose logits predict the
        continuation."""
        keep = self.max_length - 1
        pairs = [(ctx[-max(1, keep - len(cont)):], cont) for ctx, cont in pairs]   # the context's end fits
        device, pad_id = self.model.device, self.tokenizer.pad_id
        W = max(len(ctx) for ctx, _ in pairs) - 1                        # prefilled slots
        C = max(len(cont) for _, cont in pairs)                          # the chunk
        left = [W - (len(ctx) - 1) for ctx, _ in pairs]
        head = torch.tensor([[pad_id] * p + ctx[:-1] for p, (ctx, _) in zip(left, pairs)], device=device)
        chunk = torch.tensor([[ctx[-1]] + cont[:-1] + [pad_id] * (C - len(cont)) for ctx, cont in pairs],
                             device=device)
        pad = torch.tensor(left, device=device) if any(left) else None
        kv = self.model.new_cache(self.spec, batch_size=len(pairs), max_len=W + C)
        if W:
            prefill(self.model, head, kv, pad, self.prefill_chunk)
        logprobs = F.log_softmax(self.model(chunk, kv, pad=pad).float(), dim=-1)   # (B, C, vocab)
        self._report("loglikelihood", kv, len(pairs))
        results = []
        for b, (_, cont) in enumerate(pairs):
            target = torch.tensor(cont, device=device)
            lp = logprobs[b, :len(cont)]
            results.append((lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
        return results

    # ---- loglikelihood_rolling ------------------------------------------------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for r in tqdm(requests, desc=f"loglikelihood_rolling ({self.spec})", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tokenizer.encode(r.args[0], bos=False), self.prefix, self.max_length, 1)]
            results.append(sum(self._score_window(ctx, cont) for ctx, cont in windows))
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, results[-1])
        self._log("loglikelihood_rolling")
        return results

    @torch.inference_mode()
    def _score_window(self, context: list[int], continuation: list[int]) -> float:
        """Log-probability of a rolling window's continuation, teacher-forced in simulated mode (every token
        predicted as decoding it through the cache would), its first `prompt` tokens (the context at least) its
        exact prompt."""
        tokens = torch.tensor([context + continuation[:-1]], device=self.model.device)
        prompt = min(max(self.prompt, len(context)), tokens.shape[1])
        kv = self.model.new_cache(self.spec, batch_size=1, max_len=tokens.shape[1], mode="simulated", prompt=prompt)
        logits = self.model(tokens, kv)[0, len(context) - 1:].float()                   # (len(cont), vocab)
        target = torch.tensor(continuation, device=self.model.device)
        self._report("loglikelihood_rolling", kv, 1)
        return F.log_softmax(logits, dim=-1).gather(-1, target[:, None]).sum().item()

    # ---- generate_until ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        report = self.kv_report.setdefault("generate_until", KVReport())
        out = generate_requests(self.model, self.tokenizer, self.spec, [r.args for r in requests], self.batch_size,
                                self.max_length, report, self.prefill_chunk,
                                lambda i, text: self.cache_hook.add_partial("generate_until", requests[i].args, text),
                                disable_tqdm)
        self._log("generate_until")
        return out

    # ---- KV bytes ---------------------------------------------------------------------------------
    def _report(self, kind: str, kv, rows: int) -> None:
        """The bytes a cache holds against an fp16 cache of the same slots (padding included in both)."""
        cfg = self.model.cfg
        fp16 = fp16_kv_nbytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, rows * kv.length)
        self.kv_report.setdefault(kind, KVReport()).add(kv.nbytes(), fp16, rows)

    def _log(self, kind: str) -> None:
        r = self.kv_report.get(kind, KVReport())
        log.info("kvzoo %s (%s): KV %d bytes held over %d rows, %.3f x an fp16 cache of the same tokens",
                 kind, self.spec, r.nbytes, r.rows, r.ratio)


def main(argv: list[str]) -> None:
    """lm-eval's command line (`run` when no command is named, as `lm_eval` itself does) with the `kvzoo` model
    registered and kvzoo's offline tasks on the task path (scripts/harness.py)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    from kvzoo.eval.tasks import task_dir

    if not argv or argv[0] not in ("run", "ls", "validate", "-h", "--help"):
        argv = ["run", *argv]
    if argv[0] in ("run", "ls") and "--include_path" not in argv:
        argv = [*argv, "--include_path", str(task_dir())]
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
