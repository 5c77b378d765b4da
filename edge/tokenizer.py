"""Tokenizers shared by the router and the worker: one way to turn text into token ids.

The router owns tokenization: it encodes text prompts (and renders chat messages) with the
same tokenizer files the workers load, so the block hashes of a text prompt match the KV
events the workers report. Two tokenizers are the same when their :attr:`fingerprint` is;
workers report theirs in GetLoad and the router refuses a worker whose fingerprint differs.

- :class:`ByteTokenizer`: UTF-8 bytes are ids 0..255, four specials follow. Always works
  (the tiny default model, the simulated executor); its fingerprint is fixed.
- :class:`HFTokenizer`: a Hugging Face ``tokenizers.Tokenizer`` (tokenizer.json) plus what
  tokenizer_config.json adds (bos/eos tokens, ``add_bos_token``, the chat template).
  :func:`load_tokenizer` reads both from a model directory, and the eos ids from
  config.json / generation_config.json. Nothing is fetched from the network.
- :class:`IncrementalDetokenizer`: a growing id list to text deltas, for streaming.

Chat templates are rendered as transformers does (a sandboxed Jinja2 environment with
``raise_exception``, ``bos_token``/``eos_token`` variables, ``trim_blocks``/``lstrip_blocks``);
a model without one gets :data:`DEFAULT_CHAT_TEMPLATE`. A template that refuses the
conversation raises :class:`ChatTemplateError`, a ``BadRequest`` (INVALID_ARGUMENT / 400).

This module imports neither torch nor transformers; ``tokenizers`` and ``jinja2`` are
imported when first needed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn, Protocol

from edge.frontdoor import BadRequest

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ByteTokenizer",
    "ChatTemplateError",
    "ChatTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerLoadError",
    "TokenizerSettings",
    "eos_ids_from_value",
    "load_tokenizer",
    "load_tokenizer_or_bytes",
    "model_eos_token_ids",
]

FINGERPRINT_HEX_DIGITS = 16  # 64 bits: a mismatch check, not a security boundary

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The chat template of a model that ships none (the tiny model, the byte tokenizer)::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

One ``<|role|>`` line, then the content and a newline, per message; with
``add_generation_prompt`` an open ``<|assistant|>`` turn ends the prompt. The markers are
plain text (no special tokens), so any tokenizer encodes them."""


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file (and key)."""


class ChatTemplateError(BadRequest):
    """The chat template refused the messages (its ``raise_exception``) or could not render
    them; or the messages are not a list of {"role": str, "content": str}."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


class Tokenizer(Protocol):
    """What the worker needs of a tokenizer (encode prompts, decode output)."""

    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of ``text``; specials as the model adds them unless ``add_special_tokens``
        is False (None: the tokenizer's default)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ChatTokenizer(Tokenizer, Protocol):
    """What the router's front end needs: the worker's interface, the eos ids, chat
    rendering and the fingerprint that identifies the tokenizer across processes."""

    eos_token_ids: tuple[int, ...]

    @property
    def fingerprint(self) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no ambiguous joins
        h.update(part)
    return h.hexdigest()[:FINGERPRINT_HEX_DIGITS]


# ---- chat templates ----------------------------------------------------------------------


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    # transformers' override: no HTML escaping (Jinja's tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str, where: str) -> Any:
    """A Jinja2 template from ``source`` in transformers' sandboxed environment
    (TokenizerLoadError naming ``where`` on a syntax error)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(
            f"{where}: chat template is not valid Jinja (line {exc.lineno}): {exc.message}"
        ) from exc


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}"
        )
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ChatTemplateError(f"messages[{i}].{key} must be a string")
        out.append(dict(m))
    return out


class _ChatRenderer:
    """Renders one chat template (compiled once) for a tokenizer's bos/eos strings."""

    def __init__(self, source: str, where: str, bos: str | None, eos: str | None) -> None:
        self.source = source
        self._template = compile_chat_template(source, where)
        self._bos = bos or ""
        self._eos = eos or ""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        import jinja2

        checked = _check_messages(messages)
        try:
            return str(
                self._template.render(
                    messages=checked,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self._bos,
                    eos_token=self._eos,
                )
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"the chat template failed on the messages: {exc}") from exc


# ---- the byte tokenizer ------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; a few specials follow. Ids it does not know (specials,
    or ids a larger model vocab produces) decode to nothing."""

    PAD = 256
    BOS = 257
    EOS = 258
    UNK = 259
    NUM_SPECIALS = 4
    max_token_chars = 1  # one token per UTF-8 byte: at least one per character

    def __init__(self, *, add_bos: bool = False) -> None:
        self.add_bos = add_bos
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)
        self.pad_token_id = self.PAD
        self.vocab_size = 256 + self.NUM_SPECIALS
        self._chat = _ChatRenderer(DEFAULT_CHAT_TEMPLATE, "default chat template", None, None)

    @property
    def fingerprint(self) -> str:
        """Fixed: the byte mapping never changes (``add_bos`` changes what encode returns)."""
        return _digest(b"kvroute.ByteTokenizer/1", b"bos" if self.add_bos else b"")

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        specials = self.add_bos if add_special_tokens is None else add_special_tokens
        return [self.BOS, *ids] if specials and self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The messages as one prompt, in :data:`DEFAULT_CHAT_TEMPLATE`."""
        return self._chat.render(messages, add_generation_prompt)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered messages (a bos first when ``add_bos``)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


# ---- the HF tokenizer --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """What tokenizer_config.json (and the model's configs) add to tokenizer.json.

    ``add_bos_token``: None leaves special tokens to tokenizer.json's post-processor (most
    checkpoints); True/False overrides it (encode without the post-processor's specials,
    then prepend ``bos_token`` or not), as transformers' Llama tokenizers do.
    ``eos_token_ids``: the ids generation stops on (config.json and generation_config.json);
    when empty, ``eos_token``'s id.
    """

    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool | None = None
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (tokenizer.json) behind the shared interface.

    ``source_json``: the tokenizer.json text it was loaded from; the fingerprint hashes it
    (canonicalised) so that the same files give the same fingerprint in every process, even
    under another ``tokenizers`` version. Without it, the tokenizer's own serialisation is
    hashed.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_id: int | None = None,
        add_special_tokens: bool = True,
        settings: TokenizerSettings | None = None,
        source_json: str | None = None,
        where: str = "tokenizer",
    ) -> None:
        s = settings or TokenizerSettings()
        self._tok = tokenizer
        self.settings = s
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.add_special_tokens = add_special_tokens
        self.bos_token_id = tokenizer.token_to_id(s.bos_token) if s.bos_token else None
        if s.add_bos_token and self.bos_token_id is None:
            raise TokenizerLoadError(
                f"{where}: add_bos_token is true but bos_token {s.bos_token!r} is not in the "
                "vocabulary"
            )
        eos_ids = s.eos_token_ids
        if eos_token_id is not None:
            eos_ids = tuple(dict.fromkeys((eos_token_id, *eos_ids)))
        if not eos_ids and s.eos_token and tokenizer.token_to_id(s.eos_token) is not None:
            eos_ids = (tokenizer.token_to_id(s.eos_token),)
        self.eos_token_ids: tuple[int, ...] = eos_ids
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self._source_json = source_json
        self._chat = _ChatRenderer(
            s.chat_template or DEFAULT_CHAT_TEMPLATE, where, s.bos_token, s.eos_token
        )

    @classmethod
    def from_file(cls, path: str | Path, *, eos_token_id: int | None = None) -> HFTokenizer:
        """Load a bare tokenizer.json (no tokenizer_config.json; see :func:`load_tokenizer`)."""
        path = Path(path)
        text = _read_text(path)
        return cls(_parse_tokenizer(text, path), eos_token_id=eos_token_id, source_json=text)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 (first 16 hex digits) over the canonical tokenizer.json -- vocabulary,
        merges, added and special tokens, normaliser, pre-tokeniser, post-processor,
        decoder -- and the settings that change what ``encode`` returns (bos/eos tokens,
        ``add_bos_token``). The chat template and the eos ids are left out: they change
        neither what an id means nor how text maps to ids."""
        source = self._source_json if self._source_json is not None else self._tok.to_str()
        canonical = json.dumps(
            json.loads(source), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        s = self.settings
        extra = json.dumps([s.bos_token, s.eos_token, s.add_bos_token, self.add_special_tokens])
        return _digest(b"kvroute.HFTokenizer/1", canonical.encode(), extra.encode())

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (the vocabulary's longest token,
        special ones included): a text holds at least ``len(text) / max_token_chars`` tokens
        -- known before tokenizing it."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max(1, *(len(token) for token in vocab))

    @property
    def chat_template(self) -> str:
        """The template :meth:`apply_chat_template` renders (the model's, or the default)."""
        return self._chat.source

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens (a bos) as the model adds them, unless
        ``add_special_tokens`` is False (text that already holds them, like a rendered chat
        template)."""
        specials = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        add_bos = self.settings.add_bos_token
        if add_bos is None:
            return list(self._tok.encode(text, add_special_tokens=specials).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if specials and add_bos:
            assert self.bos_token_id is not None  # checked in __init__
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The messages rendered with the model's chat template (or the default one)."""
        return self._chat.render(messages, add_generation_prompt)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered messages. As transformers does, the rendered text is
        encoded without added special tokens (the template writes its own bos), except that
        the default template -- which writes none -- gets them as plain ``encode`` would."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=self.chat_adds_special_tokens)

    @property
    def chat_adds_special_tokens(self) -> bool:
        """Whether :meth:`encode_chat` adds special tokens to the rendered text: only under
        the default template, which writes none itself (a model's template writes its bos)."""
        return self.settings.chat_template is None


def chat_specials(tokenizer: object) -> bool | None:
    """The ``add_special_tokens`` with which ``tokenizer`` encodes a rendered chat template
    (what its ``encode_chat`` does): its ``chat_adds_special_tokens``, or None (its
    default) for a tokenizer without that rule (the byte tokenizer)."""
    value = getattr(tokenizer, "chat_adds_special_tokens", None)
    return value if isinstance(value, bool) else None


# ---- loading -----------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise TokenizerLoadError(f"{path}: missing {path.name}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: cannot read: {exc}") from exc


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise TokenizerLoadError(f"{path}: top level must be a JSON object")
    return raw


def _parse_tokenizer(text: str, path: Path) -> Any:
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError as exc:  # a base dependency; only a broken install lacks it
        raise TokenizerLoadError(f"{path}: the 'tokenizers' package is not installed") from exc
    try:
        return _HF.from_str(text)
    except Exception as exc:  # the tokenizers package raises its own types
        raise TokenizerLoadError(f"{path}: cannot load tokenizer: {exc}") from exc


def eos_ids_from_value(value: Any, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` value (None, an id or a list of ids) as unique ids, in order
    (TokenizerLoadError naming ``where`` otherwise)."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise TokenizerLoadError(
            f"{where}: key 'eos_token_id' must be an id >= 0 or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(ids))


def model_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The ids generation stops on: config.json's ``eos_token_id`` first (its first stays
    the model's eos), then generation_config.json's -- an instruct checkpoint may list its
    end-of-turn id (Llama 3's ``<|eot_id|>``) only there. Missing files give no ids."""
    model_dir = Path(model_dir)
    ids: tuple[int, ...] = ()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            ids += eos_ids_from_value(_read_json_object(path).get("eos_token_id"), str(path))
    return tuple(dict.fromkeys(ids))


def _token_string(raw: dict[str, Any], key: str, path: Path) -> str | None:
    value = raw.get(key)
    if isinstance(value, dict):  # an AddedToken: {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerLoadError(f"{path}: key {key!r} must be a string or an AddedToken")
    return value


def _chat_template(model_dir: Path, raw: dict[str, Any], path: Path) -> str | None:
    """tokenizer_config.json's ``chat_template`` (a string, or a list of named templates of
    which "default" is used), else a ``chat_template.jinja`` file beside it."""
    value = raw.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise TokenizerLoadError(
                f"{path}: key 'chat_template' lists no template named 'default' "
                f"(names: {sorted(str(n) for n in named)})"
            )
    if value is not None:
        if not isinstance(value, str):
            raise TokenizerLoadError(f"{path}: key 'chat_template' must be a string")
        return value
    jinja_path = model_dir / "chat_template.jinja"
    return _read_text(jinja_path) if jinja_path.is_file() else None


def load_tokenizer(model_dir: str | Path) -> HFTokenizer:
    """The tokenizer of a local HF model directory.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (optional: ``bos_token``,
    ``eos_token``, ``add_bos_token``, ``chat_template``; or ``chat_template.jinja``) and the
    eos ids of config.json / generation_config.json. Every failure is a
    :class:`TokenizerLoadError` naming the file (and key).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerLoadError(f"{model_dir}: model directory does not exist")
    tok_path = model_dir / "tokenizer.json"
    text = _read_text(tok_path)
    tok = _parse_tokenizer(text, tok_path)
    cfg_path = model_dir / "tokenizer_config.json"
    raw = _read_json_object(cfg_path) if cfg_path.is_file() else {}
    add_bos = raw.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerLoadError(f"{cfg_path}: key 'add_bos_token' must be true or false")
    settings = TokenizerSettings(
        bos_token=_token_string(raw, "bos_token", cfg_path),
        eos_token=_token_string(raw, "eos_token", cfg_path),
        add_bos_token=add_bos,
        chat_template=_chat_template(model_dir, raw, cfg_path),
        eos_token_ids=model_eos_token_ids(model_dir),
    )
    return HFTokenizer(tok, settings=settings, source_json=text, where=str(cfg_path))


def load_tokenizer_or_bytes(model_dir: str | Path | None) -> HFTokenizer | ByteTokenizer:
    """:func:`load_tokenizer` when ``model_dir`` has a tokenizer.json, else the byte
    tokenizer (no model dir: the tiny default model; a checkpoint without tokenizer.json).
    Router and worker both decide this way, so their fingerprints agree."""
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
        if model_dir is not None and not Path(model_dir).is_dir():
            raise TokenizerLoadError(f"{model_dir}: model directory does not exist")
        return ByteTokenizer()
    return load_tokenizer(model_dir)


# ---- streaming ---------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streams text for a growing list of generated ids.

    Decoding token by token breaks multi-byte characters and, for BPE/SentencePiece
    tokenizers, spacing that depends on neighbours. So it decodes a small window: the ids
    since ``prefix`` (already emitted) and compares with the emitted part of the window.
    Trailing ids whose text ends in U+FFFD (an incomplete UTF-8 sequence) are held back
    until later ids complete them, at most ``max_pending`` ids (so invalid bytes cannot
    stall the stream); ``flush`` emits whatever is left.

        ids:   [ ... emitted ... | prefix .. read) | read .. end ]
                                  emitted context     pending
    """

    def __init__(self, tokenizer: Tokenizer, *, max_pending: int = 8) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.max_pending = max_pending

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Add ids; return the newly complete text (possibly empty)."""
        self._ids.extend(int(i) for i in new_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit the held-back tail (at end of stream), replacement characters included."""
        return self._emit(force=True)

    def _emit(self, *, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        # Try the whole window, then back off over a trailing incomplete character
        # (a few ids at most) so a large push still emits its complete part at once.
        lowest = max(self._read + 1, len(self._ids) - self.max_pending + 1)
        for end in range(len(self._ids), lowest - 1, -1):
            window = self._tok.decode(self._ids[self._prefix : end])
            if (
                not window.endswith("\ufffd")
                and len(window) > len(done)
                and window.startswith(done)
            ):
                self._prefix, self._read = self._read, end
                return window[len(done) :]
        if not force and len(self._ids) - self._read < self.max_pending:
            return ""  # incomplete, or nothing visible yet (e.g. a special token)
        window = self._tok.decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(done) :]
