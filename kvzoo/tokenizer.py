"""One small tokenizer interface over the two file formats checkpoints ship.

* ``tokenizer.json`` -- a complete Hugging Face ``tokenizers`` pipeline (normalizer,
  pre-tokenizer, BPE/Unigram model, decoder). SmolLM2, Llama 3, Qwen, ... use it.
* ``tokenizer.model`` -- a SentencePiece model. Llama 1/2 and Mistral use it.

Neither file says everything a language model needs: which token starts a text (BOS), which
ones end a reply (EOS / end-of-turn), whether BOS is prepended by default, and the chat
template. Hugging Face keeps those in ``tokenizer_config.json`` and ``generation_config.json``
next to the tokenizer file, and ``Tokenizer.from_pretrained`` reads them when given a folder::

    tok = Tokenizer.from_pretrained("weights/smollm2-135m-instruct")
    ids = tok.encode("Hello world")                      # BOS only if tok.add_bos
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    ...
    if next_id in tok.eos_ids: stop

BOS is always added by this class, never by the backend's post-processor, so ``encode``'s
``bos`` argument means the same thing for both formats. Evaluation code should remember that
this choice matters for reported numbers: WikiText-2 is 341,469 Llama-2 tokens *with* BOS.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

# Tokens that close a chat turn in common templates. A model stops at the end of its turn, so
# when one of these appears in the chat template it counts as a stop id besides the EOS token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """Text <-> token ids, special ids and chat formatting for one model.

    Attributes:
        bos_id: id of the beginning-of-sequence token, or None if the model has none.
        eos_ids: every id that ends generation (EOS first, then end-of-turn tokens).
        pad_id: id to pad batches with (the pad token if defined, else EOS, else 0).
        add_bos: whether ``encode`` prepends BOS by default.
        vocab_size: number of ids the tokenizer can produce, added tokens included.
        chat_template: the Jinja chat template, or None.
        generation_config: the model folder's generation_config.json ({} if none): its sampling settings
            (do_sample, temperature, top_p, top_k, repetition_penalty) are chat's defaults.
    """

    def __init__(self, backend, *, config: dict | None = None, generation_config: dict | None = None,
                 chat_template: str | None = None):
        config = config or {}
        generation_config = generation_config or {}
        self._backend = backend
        self.generation_config = generation_config

        self.special_tokens = {
            name: _token_content(config.get(f"{name}_token")) for name in ("bos", "eos", "pad", "unk")
        }
        self.bos_id = self._special_id("bos", generation_config, backend.default_bos_id)
        eos_id = self._special_id("eos", generation_config, backend.default_eos_id)
        self.chat_template = chat_template or _config_chat_template(config)

        eos_ids = [eos_id] + _as_list(generation_config.get("eos_token_id"))
        if self.chat_template:
            eos_ids += [self.token_to_id(t) for t in _END_OF_TURN_TOKENS if t in self.chat_template]
        self.eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))  # ordered, unique

        pad_id = self._special_id("pad", generation_config, None)
        self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = backend.default_add_bos(self.bos_id)
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.vocab_size = backend.vocab_size
        for name, token_id in (("bos", self.bos_id), ("eos", eos_id)):
            if self.special_tokens[name] is None and token_id is not None:
                self.special_tokens[name] = self.id_to_token(token_id)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load from a model folder or from a ``tokenizer.json`` / ``tokenizer.model`` file.

        A folder uses ``tokenizer.json`` if present, else ``tokenizer.model``, plus whichever of
        ``tokenizer_config.json``, ``generation_config.json`` and ``chat_template.jinja`` exist.
        A file path loads that file alone: a bare SentencePiece model then gets its own BOS/EOS
        ids and ``add_bos=True`` (what Llama does); a bare tokenizer.json adds BOS only if its
        post-processor did.
        """
        path = Path(path)
        if path.is_dir():
            folder = path
            candidates = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
            if not candidates:
                raise FileNotFoundError(
                    f"No tokenizer in {folder}: expected one of {', '.join(TOKENIZER_FILES)}"
                )
            tokenizer_file = candidates[0]
            config = _read_json(folder / "tokenizer_config.json")
            generation_config = _read_json(folder / "generation_config.json")
            template_file = folder / "chat_template.jinja"
            chat_template = template_file.read_text() if template_file.is_file() else None
        elif path.is_file() and path.suffix in (".json", ".model"):
            tokenizer_file, config, generation_config, chat_template = path, {}, {}, None
        else:
            raise FileNotFoundError(
                f"{path} is neither a folder holding {' or '.join(TOKENIZER_FILES)} "
                f"nor such a tokenizer file"
            )
        backend = _JsonBackend(tokenizer_file) if tokenizer_file.suffix == ".json" else _SentencePieceBackend(tokenizer_file)
        return cls(backend, config=config, generation_config=generation_config, chat_template=chat_template)

    def _special_id(self, name: str, generation_config: dict, default: int | None) -> int | None:
        """A special token's id: from tokenizer_config's string, else generation_config, else the backend."""
        token = self.special_tokens[name]
        if token is not None and self.token_to_id(token) is not None:
            return self.token_to_id(token)
        from_generation = _as_list(generation_config.get(f"{name}_token_id"))
        return from_generation[0] if from_generation else default

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, *, bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; BOS is prepended if ``bos`` (default: ``self.add_bos``).

        Special-token strings in the text (e.g. ``<|im_start|>`` in a rendered chat prompt)
        become their single special ids, as in Hugging Face.
        """
        ids = self._backend.encode(text)
        if self.add_bos if bos is None else bos:
            if self.bos_id is None:
                raise ValueError("This tokenizer has no BOS token to prepend")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (any iterable of ints, e.g. a 1-D tensor); special tokens dropped by default."""
        return self._backend.decode([int(i) for i in ids], skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._backend.id_to_token(token_id)

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_vars) -> str:
        """Render a conversation to the prompt string the model was fine-tuned on.

        ``messages`` is a list of ``{"role": ..., "content": ...}``. With
        ``add_generation_prompt`` the string ends with the opening of an assistant turn, so the
        model's continuation is its answer. Encode the result with ``bos=False`` when the
        template writes the BOS token itself. Extra keyword arguments become template variables.
        """
        if not self.chat_template:
            raise ValueError(
                "This tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); format the prompt yourself or use a chat model."
            )
        variables = {f"{name}_token": token or "" for name, token in self.special_tokens.items()}
        variables.update(template_vars)
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def __repr__(self) -> str:
        return (f"Tokenizer({self._backend.name}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, pad_id={self.pad_id}, add_bos={self.add_bos})")


# ---------------------------------------------------------------------- backends
# Each backend encodes without any special tokens; the Tokenizer adds BOS itself.


class _JsonBackend:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (Rust, fast)."""

    def __init__(self, file: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self.name = file.name
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as error:  # the Rust library raises a bare Exception
            raise ValueError(f"{file} is not a valid tokenizer.json: {error}") from error
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # A bare tokenizer.json names no BOS/EOS; a post-processor that prepends a token
        # (e.g. Llama 3's <|begin_of_text|>) reveals the BOS, and that it is added by default.
        with_specials = self._tok.encode("", add_special_tokens=True).ids
        self.default_bos_id = with_specials[0] if with_specials else None
        self.default_eos_id = None

    def default_add_bos(self, bos_id: int | None) -> bool:
        return bos_id is not None and self.default_bos_id == bos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)


class _SentencePieceBackend:
    """A SentencePiece ``tokenizer.model`` (Llama 1/2 style)."""

    def __init__(self, file: Path):
        import sentencepiece

        self.name = file.name
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        self.vocab_size = self._sp.get_piece_size()
        # SentencePiece reports -1 for a token the model does not define.
        self.default_bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.default_eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def default_add_bos(self, bos_id: int | None) -> bool:
        return True  # Llama-family SentencePiece models are trained with BOS at the start

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            return self._sp.decode(ids)  # SentencePiece drops control tokens (<s>, </s>) itself
        # Keep control tokens visible: decode the ordinary runs between them separately.
        parts, run = [], []
        for token_id in ids:
            if self._sp.is_control(token_id):
                parts += [self._sp.decode(run), self._sp.id_to_piece(token_id)]
                run = []
            else:
                run.append(token_id)
        return "".join(parts + [self._sp.decode(run)])

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)
        # piece_to_id answers unknown pieces with the <unk> id; only <unk> itself maps there.
        return token_id if token_id != self._sp.unk_id() or token == self._sp.id_to_piece(token_id) else None

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _token_content(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _config_chat_template(config: dict) -> str | None:
    """The chat template in tokenizer_config.json: one string, or a list of named ones."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """Compile a chat template the way transformers does, so both render the same string.

    The environment is sandboxed (templates come with downloaded checkpoints), trims block
    newlines/indentation, and offers the helpers HF templates call.
    """
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
