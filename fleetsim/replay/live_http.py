"""Live replay through an OpenAI-compatible HTTP front end (ours or a peer router).

For each front a fresh fleet is started (unless the front is a URL, which already fronts
its own workers)::

    python -m kvroute_cli worker --executor sim --port 0 --http-port 0 ...     (N of them)
    python -m kvroute_cli router --port 0 --http-port 0 --worker GRPC_i ...    (--front kvroute)
    .peers/sglang/bin/python -m sglang_router.launch_router --worker-urls HTTP_i ...
    .peers/vllm/bin/python -m vllm_router.launch_router --worker-urls HTTP_i ...

For ``vllm-router:kv_aware`` each worker also publishes its KV events in vLLM's ZMQ wire
(``--kv-events-zmq``, ``--kv-events-zmq-replay``), vllm-router reads them
(``--kv-event-source``) and tokenizes the text prompts with the workers' byte ids
(:mod:`fleetsim.replay.byte_tokenizer`, ``VLLM_ROUTER_TOKENIZER``).

Every process binds 127.0.0.1. Once the workers answer ``GET /health`` and the front is
ready (our router: every worker healthy in Explain; a peer: ``GET /health`` and a probe
completion), request i is sent as ``POST /v1/completions`` with ``stream: true`` and
``stream_options.include_usage`` at wall time t0 + arrival_i / speedup, from one aiohttp
session. Per request the replay records:

- TTFT: the first SSE chunk that carries a choice (its text may be empty: the sim's byte
  tokens are random and the worker holds back a partial UTF-8 character);
- e2e: the ``[DONE]`` line (or the end of the stream);
- cached tokens: ``usage.prompt_tokens_details.cached_tokens`` of the final usage chunk;
- the serving worker: the ``X-Kvroute-Worker-Id`` response header, else the last chunk's
  ``kvroute.worker_id`` (kvroute's HTTP fronts, worker and router, add it; a peer router
  passes the stream through unchanged).

Prompts are text (:mod:`fleetsim.replay.text_prompt`): one ASCII character per byte-tokenizer
token, so every front routes exactly the tokens the trace means; the replay checks each
request's ``usage.prompt_tokens`` against the trace and counts mismatches. The report is
:func:`fleetsim.replay.report.summarize`'s, as for the gRPC live mode.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import grpc

from fleetsim.replay.byte_tokenizer import write_byte_tokenizer
from fleetsim.replay.front import (
    DEFAULT_PEERS_DIR,
    KVROUTE,
    URL,
    FrontSpec,
    FrontSpecError,
    KvEventSource,
    peer_command,
)
from fleetsim.replay.live import (
    LiveConfig,
    LiveFleet,
    LiveReplayError,
    _Proc,
    _wait_ready,
    play_trace,
)
from fleetsim.replay.report import PolicyReport, RequestResult, summarize
from fleetsim.replay.text_prompt import TextExpander
from fleetsim.replay.trace import TraceRecord
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

WORKER_ID_HEADER = "X-Kvroute-Worker-Id"
_PROBE_PROMPT = "!"  # one token, no full block: it leaves nothing in any cache or tree


def free_port() -> int:
    """A port free on 127.0.0.1 right now (for options that need a number up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """What an HTTP live replay needs besides :class:`LiveConfig`."""

    peers_dir: Path = DEFAULT_PEERS_DIR
    model: str | None = None  # the requests' "model"; None: the front's first /v1/models id
    requests_dir: Path | None = None  # one JSONL of per-request results per front, or none


class HttpFleet(LiveFleet):
    """N sim workers with their HTTP API and one front end (an async context manager)."""

    def __init__(self, config: LiveConfig, spec: FrontSpec, options: HttpOptions) -> None:
        super().__init__(config, spec.policy or "")
        self.spec = spec
        self.options = options
        self.worker_urls: list[str] = []
        self.front_url = spec.url or ""
        self.front: _Proc | None = None
        self.model = options.model  # the requests' "model" (None: not known yet)

    async def _start(self) -> None:
        c = self.config
        if self.spec.kind == URL:
            await wait_http_ok(self.front_url + "/health", c.startup_timeout_s, None)
            await self._probe()
            return
        sources = await self._start_http_workers()
        if self.spec.kind == KVROUTE:
            await self._start_kvroute_front()
        else:
            await self._start_peer_front(sources)
        await self._probe()

    async def _start_http_workers(self) -> list[KvEventSource]:
        """The sim workers with their HTTP API; for a front that reads vLLM's ZMQ events,
        each also publishes them (the sources returned, else none)."""
        c = self.config
        zmq = self.spec.reads_zmq_events
        pubs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(c.num_workers)] if zmq else []
        replays = [f"tcp://127.0.0.1:{free_port()}" for _ in range(c.num_workers)] if zmq else []

        def per_worker(i: int) -> list[str]:
            if not zmq:
                return ["--http-port", "0"]
            zmq_args = ["--kv-events-zmq", pubs[i], "--kv-events-zmq-replay", replays[i]]
            return ["--http-port", "0", *zmq_args]

        await self._start_workers(self.worker_args(), per_worker)
        self.worker_urls = [await self._http_address(w) for w in self.workers]
        for url, proc in zip(self.worker_urls, self.workers, strict=True):
            await wait_http_ok(url + "/health", c.startup_timeout_s, proc)
        if not zmq:
            return []
        return [
            KvEventSource(url, pub, replay)
            for url, pub, replay in zip(self.worker_urls, pubs, replays, strict=True)
        ]

    async def _start_kvroute_front(self) -> None:
        c = self.config
        assert self.spec.policy is not None
        args = ["router", "--port", "0", "--http-port", "0"]
        args += self.router_args(self.spec.policy)
        for w in self.workers:
            args += ["--worker", w.address]
        self.router = self.front = await self._spawn("router", args)
        self.front_url = await self._http_address(self.router)
        async with grpc.aio.insecure_channel(self.router.address) as channel:
            await _wait_ready(pb_grpc.RouterStub(channel), c.num_workers, c.startup_timeout_s)
        await wait_http_ok(self.front_url + "/health", c.startup_timeout_s, self.front)

    async def _start_peer_front(self, sources: list[KvEventSource]) -> None:
        c = self.config
        port = free_port()  # the peers take no port 0
        self.front_url = f"http://127.0.0.1:{port}"
        env: dict[str, str] = {}
        if sources:  # kv_aware tokenizes the text prompts itself: the workers' byte ids
            tokenizer_dir = Path(self._tmp.name) / "byte-tokenizer"
            write_byte_tokenizer(tokenizer_dir)
            env["VLLM_ROUTER_TOKENIZER"] = str(tokenizer_dir)
        argv = peer_command(
            self.spec,
            port=port,
            metrics_port=free_port(),
            worker_urls=self.worker_urls,
            peers_dir=self.options.peers_dir,
            kv_events=sources,
            block_size=c.block_size,
            model=await self._worker_model() if sources else "",
        )
        self.front = await self._start_process(self.spec.kind, argv, pipe_stdout=False, env=env)
        await wait_http_ok(self.front_url + "/health", c.startup_timeout_s, self.front)

    async def _worker_model(self) -> str:
        """The model the first worker serves (vllm-router's --kv-event-model)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as s:
            return await front_model(s, self.worker_urls[0]) or "kvroute-tiny"

    async def _probe(self) -> None:
        """Pick the model name (peers refuse a request without one), then wait until a
        one-token completion goes through the front."""
        c = self.config
        if self.model is None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as s:
                self.model = await front_model(s, self.front_url)
        await wait_probe(self.front_url, self.model, c.startup_timeout_s, self.front)

    async def _http_address(self, proc: _Proc) -> str:
        """The URL of a worker's or router's ``http listening on HOST:PORT`` line (printed
        after the gRPC one)."""
        text = await proc.stdout_line("http listening on", self.config.startup_timeout_s)
        if not text.startswith("http listening on "):
            raise LiveReplayError(
                f"{proc.name}: expected 'http listening on HOST:PORT', got {text!r} "
                f"(does this worker have --http-port?); log tail:\n{proc.log_tail()}"
            )
        return "http://" + text.removeprefix("http listening on ").strip()


async def _poll_until_200(
    send: Callable[[aiohttp.ClientSession], Any],
    timeout_s: float,
    proc: _Proc | None,
    *,
    session_timeout_s: float,
    interval_s: float,
    text_chars: int,
    waiting_for: str,
) -> str | None:
    """Send ``send(session)`` (an aiohttp request) every ``interval_s`` until it answers 200
    (None) or ``timeout_s`` passes (the last failure, for the caller's error); when ``proc``
    exits meanwhile, LiveReplayError with its log tail (``waiting_for`` goes after its rc)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    timeout = aiohttp.ClientTimeout(total=session_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.process.returncode is not None:
                raise LiveReplayError(
                    f"{proc.name} exited (rc={proc.process.returncode}){waiting_for}; "
                    f"log tail:\n{proc.log_tail()}"
                )
            try:
                async with send(session) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return None
                    last = f"HTTP {resp.status}: {(await resp.text())[:text_chars]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(interval_s)
    return last


def _log_tail(proc: _Proc | None) -> str:
    return f"; log tail:\n{proc.log_tail()}" if proc is not None else ""


async def wait_http_ok(url: str, timeout_s: float, proc: _Proc | None) -> None:
    """Poll ``GET url`` (bounded) until it answers 200; fail early when ``proc`` exits."""
    last = await _poll_until_200(
        lambda session: session.get(url),
        timeout_s,
        proc,
        session_timeout_s=5.0,
        interval_s=0.1,
        text_chars=200,
        waiting_for=f" while waiting for {url}",
    )
    if last is not None:
        raise LiveReplayError(f"{url} not ready after {timeout_s}s: {last}{_log_tail(proc)}")


async def wait_probe(
    front_url: str, model: str | None, timeout_s: float, proc: _Proc | None
) -> None:
    """Until a one-token completion goes through (a peer registers its workers lazily)."""
    body: dict[str, Any] = {"prompt": _PROBE_PROMPT, "max_tokens": 1, "ignore_eos": True}
    if model:
        body["model"] = model
    last = await _poll_until_200(
        lambda session: session.post(front_url + "/v1/completions", json=body),
        timeout_s,
        proc,
        session_timeout_s=10.0,
        interval_s=0.2,
        text_chars=300,
        waiting_for="",
    )
    if last is not None:
        raise LiveReplayError(
            f"{front_url} served no probe completion in {timeout_s}s: {last}{_log_tail(proc)}"
        )


async def front_model(session: aiohttp.ClientSession, front_url: str) -> str | None:
    """The first model id the front lists (None when it lists none)."""
    try:
        async with session.get(front_url + "/v1/models") as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if models and isinstance(models[0], dict) and models[0].get("id"):
        return str(models[0]["id"])
    return None


@dataclass(slots=True)
class _StreamOutcome:
    prompt_tokens: int | None = None
    saw_worker_id: bool = False


def _chunk_worker_id(chunk: dict[str, Any]) -> str | None:
    """The serving worker a chunk names: ``kvroute.worker_id`` (our fronts' extension on
    the last chunk) or a top-level ``worker_id``; None when it names none."""
    ext = chunk.get("kvroute")
    value = ext.get("worker_id") if isinstance(ext, dict) else None
    value = value or chunk.get("worker_id")
    return str(value) if value else None


async def _play_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    trace_now: Any,
) -> _StreamOutcome:
    """POST one streamed completion and fill ``result`` from its SSE stream."""
    outcome = _StreamOutcome()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            text = (await resp.text())[:200].replace("\n", " ")
            result.error = f"HTTP {resp.status}: {text}"
            return outcome
        worker_id = resp.headers.get(WORKER_ID_HEADER)
        usage: dict[str, Any] | None = None
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk and not chunk.get("choices"):
                err = chunk["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                result.error = f"stream error: {msg}"
                return outcome
            if chunk.get("choices") and result.first_token_s is None:
                result.first_token_s = trace_now()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if worker_id is None:
                worker_id = _chunk_worker_id(chunk)
        result.finish_s = trace_now()
        if not done:
            result.error = "stream ended without [DONE]"
            return outcome
    if usage is None:
        result.error = "no usage in the stream"
        return outcome
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    outcome.prompt_tokens = usage.get("prompt_tokens")
    if worker_id is not None:
        result.worker_id = worker_id
        outcome.saw_worker_id = True
    return outcome


async def replay_http_async(
    records: Sequence[TraceRecord],
    spec: FrontSpec,
    config: LiveConfig,
    options: HttpOptions | None = None,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """Start a fleet behind ``spec``'s front, play ``records`` through it, stop it."""
    options = options or HttpOptions()
    if spec.kind == KVROUTE and spec.policy is None:
        raise FrontSpecError("a kvroute front needs a policy here (expand_fronts gives one)")
    wall_start = time.monotonic()
    results = [
        RequestResult(index=i, arrival_s=r.arrival_s, prompt_tokens=r.input_length)
        for i, r in enumerate(records)
    ]
    expander = TextExpander(config.trace_block_size, config.seed)
    prompts = [expander.expand_record(r) for r in records]
    num_mismatch = num_without_worker = 0
    async with HttpFleet(config, spec, options) as fleet:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            model = fleet.model
            url = fleet.front_url + "/v1/completions"
            label = spec.label

            async def play(i: int, trace_now: Callable[[], float]) -> None:
                nonlocal num_mismatch, num_without_worker
                record, result = records[i], results[i]
                body: dict[str, Any] = {
                    "prompt": prompts[i],
                    "max_tokens": record.output_length,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                    "temperature": 0.0,
                }
                if model:
                    body["model"] = model
                try:
                    outcome = await _play_one(session, url, body, result, trace_now)
                    if result.error is None:
                        if outcome.prompt_tokens != record.input_length:
                            num_mismatch += 1
                        if not outcome.saw_worker_id:
                            num_without_worker += 1
                except (aiohttp.ClientError, ValueError) as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                except TimeoutError:
                    result.error = f"timeout after {config.timeout_s}s"

            await play_trace(records, results, play, label, config, progress_stream)
    if options.requests_dir is not None:
        write_requests(Path(options.requests_dir) / f"{_file_name(label)}.jsonl", results)
    if spec.starts_fleet:
        worker_ids = [f"worker-{i}" for i in range(config.num_workers)]
    else:
        worker_ids = sorted({r.worker_id for r in results if r.worker_id is not None})
    extra: dict[str, float | int] = {
        "speedup": config.speedup,
        "prompt_token_mismatches": num_mismatch,
        "requests_without_worker_id": num_without_worker,
    }
    return summarize(label, results, worker_ids, extra=extra, wall_s=time.monotonic() - wall_start)


def _file_name(label: str) -> str:
    """A front's label as a file name: ``sglang-router:cache_aware`` ->
    ``sglang-router_cache_aware``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def write_requests(path: Path, results: Sequence[RequestResult]) -> None:
    """Per-request results as JSONL (trace seconds), for looking into why a front won."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            row = {
                "index": r.index,
                "arrival_s": r.arrival_s,
                "worker_id": r.worker_id,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "ttft_s": None if r.first_token_s is None else r.first_token_s - r.arrival_s,
                "e2e_s": None if r.finish_s is None else r.finish_s - r.arrival_s,
                "error": r.error,
            }
            f.write(json.dumps(row) + "\n")


def run_http(
    records: Sequence[TraceRecord],
    spec: FrontSpec,
    config: LiveConfig,
    options: HttpOptions | None = None,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """Synchronous wrapper of :func:`replay_http_async` (one event loop per call)."""
    return asyncio.run(replay_http_async(records, spec, config, options, progress_stream))
