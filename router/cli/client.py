"""A small client for the router: ``RouterClient`` (async) and the ``kvroute generate`` /
``kvroute explain`` commands.

    async with RouterClient("127.0.0.1:50051") as client:
        result = await client.generate("Hello", max_new_tokens=16)
        print(result.text, result.worker_id, result.cached_prompt_tokens)

A prompt is either text (the worker tokenizes it; the router routes it approximately, see
``router.service.servicer``) or a sequence of token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from edge.cli_help import HelpFormatter
from edge.security_cli import add_client_tls_args, client_tls_from_args
from edge.tls import ClientTls
from edge.tls import channel as make_channel
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

Prompt = str | Sequence[int]

API_KEY_ENV = "KVROUTE_API_KEY"
_FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_MAX_CONTEXT: "max_context",
    pb.FINISH_REASON_ABORT: "abort",
}


UINT32_LIMIT = 1 << 32  # token ids and max_new_tokens are uint32 on the wire


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """Sampling and partition options of one request."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    extra_key: str = ""
    request_id: str = ""
    priority: int = 0
    model: str = ""  # the served model (its pool: decision 0036); "": the router's only one


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished request: the output and who served it."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    worker_id: str
    attempts: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerScoreView:
    """One worker's line of an Explain answer."""

    worker_id: str
    address: str
    healthy: bool
    matched_tokens: int
    inflight_prefill_tokens: int
    cost: float | None  # None: the policy has no cost, or the worker is no candidate
    num_running: int
    num_waiting: int
    recent_prefill_tokens: float = 0.0
    event_matched_tokens: int = 0  # confirmed by the worker's KV events
    predicted_matched_tokens: int = 0  # from the router's recent routing alone
    not_candidate_reason: str = ""  # empty for a candidate
    slot_queue: int = 0  # requests a new one would wait behind for a running slot
    model: str = ""  # the model pool the worker is in


@dataclass(frozen=True, slots=True)
class ExplainResult:
    policy: str
    prompt_tokens: int
    chosen_worker_id: str
    workers: tuple[WorkerScoreView, ...]
    miss_factor: float = 0.0  # a miss's weight in every cost now (0: the policy has none)
    model: str = ""  # the pool explained ("": every pool's, on a router serving several)


def build_request(prompt: Prompt, options: GenerateOptions) -> pb.GenerateRequest:
    """The GenerateRequest for ``prompt`` (text or token ids)."""
    req = pb.GenerateRequest(
        request_id=options.request_id,
        sampling=pb.SamplingParams(
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            ignore_eos=options.ignore_eos,
        ),
        partition=pb.Partition(extra_key=options.extra_key),
        priority=options.priority,
        model=options.model,
    )
    if options.seed is not None:
        req.sampling.seed = options.seed
    if isinstance(prompt, str):
        req.prompt_text = prompt
    else:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    return req


class RouterClient:
    """An async client of one router. ``tenant`` sets the tenant metadata header."""

    def __init__(
        self,
        address: str,
        *,
        tenant: str | None = None,
        tenant_header: str = "x-tenant-id",
        timeout_s: float | None = 60.0,
        tls: ClientTls | None = None,
        api_key: str | None = None,
    ) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._metadata: tuple[tuple[str, str], ...] = ((tenant_header, tenant),) if tenant else ()
        if api_key:  # the router's --api-keys: the key names the tenant
            self._metadata += (("authorization", f"Bearer {api_key}"),)
        self._channel = make_channel(address, tls)  # TLS when given (edge.tls)
        self._stub = pb_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(
        self, prompt: Prompt, options: GenerateOptions | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The raw response stream: TokenChunk messages, then one Finished.

        Leaving the iteration early cancels the request (the router cancels the worker's).
        """
        req = build_request(prompt, options or GenerateOptions())
        call = self._stub.Generate(req, timeout=self._timeout_s, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            if not call.done():
                call.cancel()

    async def generate(
        self, prompt: Prompt, options: GenerateOptions | None = None
    ) -> GenerateResult:
        """Run one request to completion (the stream is read to its end, never cancelled)."""
        texts: list[str] = []
        tokens: list[int] = []
        request_id = ""
        fin: pb.Finished | None = None
        async for msg in self.stream(prompt, options):
            request_id = msg.request_id or request_id
            if msg.HasField("chunk"):
                tokens.extend(msg.chunk.token_ids)
                texts.append(msg.chunk.text)
            elif msg.HasField("finished"):
                fin = msg.finished
        if fin is None:
            raise ConnectionError(
                f"router {self.address} ended the stream without a Finished message"
            )
        return GenerateResult(
            request_id=request_id,
            text="".join(texts),
            token_ids=tuple(tokens),
            finish_reason=_FINISH_NAMES.get(fin.reason, str(fin.reason)),
            worker_id=fin.worker_id,
            attempts=fin.attempts,
            prompt_tokens=fin.usage.prompt_tokens,
            cached_prompt_tokens=fin.usage.cached_prompt_tokens,
            completion_tokens=fin.usage.completion_tokens,
        )

    async def explain(
        self, prompt: Prompt, options: GenerateOptions | None = None
    ) -> ExplainResult:
        """Where the router would send ``prompt`` and why."""
        req = pb.ExplainRequest(request=build_request(prompt, options or GenerateOptions()))
        resp = await self._stub.Explain(req, timeout=self._timeout_s, metadata=self._metadata)
        return ExplainResult(
            policy=resp.policy,
            prompt_tokens=resp.prompt_tokens,
            chosen_worker_id=resp.chosen_worker_id,
            miss_factor=resp.miss_factor,
            model=resp.model,
            workers=tuple(
                WorkerScoreView(
                    worker_id=w.worker_id,
                    address=w.address,
                    healthy=w.healthy,
                    matched_tokens=w.matched_tokens,
                    inflight_prefill_tokens=w.inflight_prefill_tokens,
                    cost=w.cost if w.HasField("cost") else None,
                    num_running=w.load.num_running,
                    num_waiting=w.load.num_waiting,
                    recent_prefill_tokens=w.recent_prefill_tokens,
                    event_matched_tokens=w.event_matched_tokens,
                    predicted_matched_tokens=w.predicted_matched_tokens,
                    not_candidate_reason=w.not_candidate_reason,
                    slot_queue=w.slot_queue,
                    model=w.model,
                )
                for w in resp.workers
            ),
        )

    async def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; True when some worker was running it."""
        resp = await self._stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self._timeout_s, metadata=self._metadata
        )
        return resp.found


# ---- command line ----------------------------------------------------------------------


def _common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )
    parser.add_argument("--router", default="127.0.0.1:50051", help="router HOST:PORT")
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="PROMPT is a comma-separated list of token ids instead of text",
    )
    parser.add_argument("--tenant", default=None, help="tenant id sent as metadata")
    parser.add_argument(
        "--tenant-header", default="x-tenant-id", help="metadata key of the tenant id"
    )
    parser.add_argument("--extra-key", default="", help="partition extra_key (e.g. a LoRA name)")
    parser.add_argument(
        "--model",
        default="",
        help="the served model, whose pool of workers serves it (a router serving several "
        "needs it; default: the router's only one)",
    )
    parser.add_argument(
        "--timeout",
        type=_float_at_least("--timeout", 0.0, strict=True),
        default=60.0,
        help="deadline in seconds",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"API key sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    add_client_tls_args(parser, "tls", "the router")
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt")
    return parser


def _int_in(name: str, low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [low, high], else a one-line usage error naming it."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {value!r}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{name} must be in {low}..{high}, got {n}")
        return n

    return parse


def _float_at_least(name: str, low: float, *, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite float > low (strict) or >= low."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {value!r}") from None
        ok = math.isfinite(x) and (x > low if strict else x >= low)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value}"
            )
        return x

    return parse


def _parse_prompt(args: argparse.Namespace) -> Prompt:
    if not args.token_ids:
        return args.prompt
    try:
        ids = [int(t) for t in args.prompt.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(
            f"--token-ids: PROMPT must be comma-separated ints, got {args.prompt!r}"
        ) from None
    bad = [i for i in ids if not 0 <= i < UINT32_LIMIT]
    if bad or not ids:
        raise SystemExit(
            f"--token-ids: every id must be in 0..{UINT32_LIMIT - 1}"
            + (f", got {bad[0]}" if bad else ", got no ids")
        )
    return ids


def _client(args: argparse.Namespace) -> RouterClient:
    try:
        tls = client_tls_from_args(args, "tls")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return RouterClient(
        args.router,
        tenant=args.tenant,
        tenant_header=args.tenant_header,
        timeout_s=args.timeout,
        tls=tls,
        api_key=args.api_key,
    )


def _ids_text(token_ids: Sequence[int]) -> str:
    """What the CLI prints for an output without text: its token ids."""
    return " ".join(map(str, token_ids))


def _rpc_error(exc: grpc.aio.AioRpcError) -> int:
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


async def _generate(args: argparse.Namespace) -> int:
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        extra_key=args.extra_key,
        model=args.model,
    )
    prompt = _parse_prompt(args)
    async with _client(args) as client:
        if not args.stream:
            r = await client.generate(prompt, options)
            print(r.text if r.text else _ids_text(r.token_ids))
        else:
            # Text as it arrives. A chunk may carry ids and no text (the worker holds back an
            # incomplete character until later ids complete it): print nothing for it, so the
            # streamed output equals the non-streamed one. Only a stream with no text at all
            # prints its token ids, as the non-streamed path does.
            fin = None
            any_text = False
            token_ids: list[int] = []
            async for msg in client.stream(prompt, options):
                if msg.HasField("chunk"):
                    token_ids.extend(msg.chunk.token_ids)
                    if msg.chunk.text:
                        any_text = True
                        print(msg.chunk.text, end="", flush=True)
                else:
                    fin = msg.finished
            print("" if any_text else _ids_text(token_ids))
            if fin is None:
                print("error: the stream ended without a Finished message", file=sys.stderr)
                return 1
            r = GenerateResult(
                request_id="",
                text="",
                token_ids=(),
                finish_reason=_FINISH_NAMES.get(fin.reason, str(fin.reason)),
                worker_id=fin.worker_id,
                attempts=fin.attempts,
                prompt_tokens=fin.usage.prompt_tokens,
                cached_prompt_tokens=fin.usage.cached_prompt_tokens,
                completion_tokens=fin.usage.completion_tokens,
            )
        if args.verbose:
            print(
                f"worker={r.worker_id} cached_prompt_tokens={r.cached_prompt_tokens}"
                f"/{r.prompt_tokens} completion_tokens={r.completion_tokens}"
                f" finish={r.finish_reason} attempts={r.attempts}",
                file=sys.stderr,
            )
    return 0


def build_generate_parser() -> argparse.ArgumentParser:
    """The ``kvroute generate`` command line."""
    parser = _common_parser(
        "kvroute generate", "Send one prompt through a router and print the generated text."
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_int_in("--max-new-tokens", 1, UINT32_LIMIT - 1),
        default=32,
        help="tokens to generate at most",
    )
    parser.add_argument(
        "--temperature",
        type=_float_at_least("--temperature", 0.0, strict=False),
        default=0.0,
        help="0 = greedy",
    )
    parser.add_argument(
        "--seed", type=_int_in("--seed", 0, (1 << 64) - 1), default=None, help="sampling seed"
    )
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print (on stderr) which worker served it and how many tokens were cached",
    )
    return parser


def main(argv: list[str]) -> int:
    """``kvroute generate``: send one prompt through a router and print the output."""
    args = build_generate_parser().parse_args(argv)
    try:
        return asyncio.run(_generate(args))
    except grpc.aio.AioRpcError as exc:
        return _rpc_error(exc)


def format_explain(result: ExplainResult) -> str:
    """A human-readable table of an Explain answer. ``matched`` is what the policy used;
    ``events`` the part the worker's KV events confirm, ``predicted`` the part the router
    predicts from what it sent there lately (short-lived); ``slotq`` how many requests a new
    one would wait behind for a running slot (past the worker's cap). ``cost`` is ``-``
    under a policy without costs and for a worker that is no candidate; ``why-not`` says why
    it is not. ``miss_factor`` is what an uncached token counts in every cost now: 1 unless
    every candidate has prefill queued (the backlog factor; far above 1: a saturated fleet)."""
    factor = f" miss_factor={result.miss_factor:.3g}" if result.miss_factor else ""
    model = f"model={result.model} " if result.model else ""
    lines = [
        f"{model}policy={result.policy} prompt_tokens={result.prompt_tokens} "
        f"chosen={result.chosen_worker_id or '(none)'}{factor}",
        f"  {'worker':<16} {'address':<22} {'ok':<3} {'matched':>8} {'events':>7} "
        f"{'predicted':>9} {'inflight':>9} {'run':>4} {'wait':>5} {'slotq':>5} {'recent':>9} "
        f"{'cost':>12}"
        "  why-not",
    ]
    for w in result.workers:
        mark = "*" if w.worker_id == result.chosen_worker_id else " "
        cost = "-" if w.cost is None else f"{w.cost:.4g}"
        lines.append(
            f"{mark} {w.worker_id:<16} {w.address:<22} {'yes' if w.healthy else 'no':<3} "
            f"{w.matched_tokens:>8} {w.event_matched_tokens:>7} "
            f"{w.predicted_matched_tokens:>9} {w.inflight_prefill_tokens:>9} {w.num_running:>4} "
            f"{w.num_waiting:>5} {w.slot_queue:>5} {w.recent_prefill_tokens:>9.0f} {cost:>12}  "
            f"{w.not_candidate_reason}"
        )
    return "\n".join(lines)


async def _explain(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        result = await client.explain(
            _parse_prompt(args), GenerateOptions(extra_key=args.extra_key, model=args.model)
        )
    print(format_explain(result))
    return 0


def explain_main(argv: list[str]) -> int:
    """``kvroute explain``: each worker's cached match, load and cost, and the pick."""
    parser = _common_parser(
        "kvroute explain", "Show where the router would send PROMPT: per worker match, load, cost."
    )
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_explain(args))
    except grpc.aio.AioRpcError as exc:
        return _rpc_error(exc)
