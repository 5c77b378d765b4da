"""``kvroute status``: a live terminal view of a router's fleet.

    kvroute status --router 127.0.0.1:50051 --metrics 127.0.0.1:9100 [--once]

One row per worker: health, running / waiting requests and KV use (from the worker's load
reports, through the router's Explain), the slot wait (requests a new one would queue behind
for a running slot, past the worker's cap), requests in flight from this router, and -- with
``--metrics``, the router's ``/metrics`` endpoint (``--metrics-port``) -- the realised
prefix-cache hit rate of what this router sent there, the blocks the index holds for it and
its event lag. Below the table: the fleet's realised vs predicted hit rate and the cache the
router left on the table for load reasons (docs/METRICS.md). Counters are cumulative since
the router started.

Reads only: Explain routes nothing, a scrape changes nothing. ``--once`` prints one table
and exits; otherwise it redraws every ``--interval-s`` until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from edge.cli_help import HelpFormatter
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

__all__ = ["FleetStatus", "WorkerRow", "build_parser", "main", "render", "scrape_metrics"]

# Explain needs a prompt; one token matches nothing anywhere and routes nothing
_PROBE = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[0]))


@dataclass(slots=True)
class WorkerRow:
    """One worker's line."""

    worker_id: str
    address: str
    healthy: bool
    running: int | None = None
    waiting: int | None = None
    slot_queue: int | None = None  # requests a new one would wait behind for a running slot
    kv_usage: float | None = None  # busy / total KV tokens, from the last load report
    inflight: float | None = None  # this router's requests in flight there
    hit_rate: float | None = None  # realised cached / prompt tokens of finished requests
    index_blocks: float | None = None
    event_lag_s: float | None = None
    model: str = ""  # the model pool it is in (router.core.pools)


@dataclass(slots=True)
class FleetStatus:
    """Everything one screen shows."""

    router: str
    policy: str = ""
    workers: list[WorkerRow] = field(default_factory=list)
    metrics_error: str = ""  # why the metrics columns are empty ("" when they are not)
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    predicted_tokens: float | None = None
    best_tokens: float | None = None
    forgone_tokens: float | None = None
    requests_ok: float | None = None
    requests_failed: float | None = None
    unreachable: float | None = None  # worker addresses that never answered (metrics)
    refused: float | None = None  # answered, refused by a check: model, hash key, id (metrics)
    models: list[str] = field(default_factory=list)  # the served models (a pool each)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape_metrics(url: str, timeout_s: float = 5.0) -> Samples:
    """GET a /metrics endpoint; sample name -> [(labels, value)]. Raises OSError."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def _per_worker(samples: Samples, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, ()):
        if "worker" in labels:
            out[labels["worker"]] += value
    return out


def _total(samples: Samples, name: str) -> float | None:
    values = samples.get(name)
    return None if values is None else sum(v for _, v in values)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


async def explain_fleet(address: str, timeout_s: float) -> pb.ExplainResponse:
    """The router's per-worker view (health, load, in-flight) via Explain."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        return await stub.Explain(pb.ExplainRequest(request=_PROBE), timeout=timeout_s)


def collect(explain: pb.ExplainResponse, samples: Samples | None, router: str) -> FleetStatus:
    """Join the Explain answer with the router's metrics (None: no metrics columns)."""
    status = FleetStatus(router, explain.policy, models=list(explain.models))
    for w in explain.workers:
        row = WorkerRow(w.worker_id, w.address, w.healthy, model=w.model)
        if w.HasField("load"):
            load = w.load
            row.running, row.waiting = load.num_running, load.num_waiting
            row.slot_queue = w.slot_queue
            total = load.num_total_kv_tokens
            if total > 0:
                busy = total - load.num_free_kv_tokens - load.num_evictable_kv_tokens
                row.kv_usage = max(busy, 0) / total
        status.workers.append(row)
    if samples is None:
        return status
    inflight = _per_worker(samples, "kvroute_router_worker_inflight_requests")
    prompt = _per_worker(samples, "kvroute_router_prompt_tokens_total")
    cached = _per_worker(samples, "kvroute_router_cached_prompt_tokens_total")
    blocks = _per_worker(samples, "kvroute_router_worker_index_blocks")
    lag = _per_worker(samples, "kvroute_router_event_lag_seconds")
    for row in status.workers:
        wid = row.worker_id
        row.inflight = inflight.get(wid)
        row.hit_rate = _ratio(cached.get(wid), prompt.get(wid))
        row.index_blocks = blocks.get(wid)
        row.event_lag_s = lag.get(wid)
    status.prompt_tokens = _total(samples, "kvroute_router_prompt_tokens_total")
    status.cached_tokens = _total(samples, "kvroute_router_cached_prompt_tokens_total")
    status.predicted_tokens = _total(samples, "kvroute_router_predicted_cached_tokens_total")
    status.best_tokens = _total(samples, "kvroute_router_decision_best_matched_tokens_total")
    status.forgone_tokens = _total(samples, "kvroute_router_forgone_cached_tokens_total")
    states = {labels.get("state"): v for labels, v in samples.get("kvroute_router_workers", [])}
    status.unreachable, status.refused = states.get("unreachable"), states.get("refused")
    requests = samples.get("kvroute_router_requests_total", [])
    status.requests_ok = sum(v for labels, v in requests if labels.get("outcome") == "OK")
    status.requests_failed = sum(v for labels, v in requests if labels.get("outcome") != "OK")
    return status


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def render(status: FleetStatus) -> Group:
    """The table and the fleet summary as rich renderables."""
    pools = len(status.models) > 1  # a model column, for a router serving several
    models = f", models {', '.join(status.models)}" if pools else ""
    title = f"kvroute fleet behind {status.router} (policy {status.policy or '?'}{models})"
    table = Table(title=title)
    for name, justify in (
        *((("model", "left"),) if pools else ()),
        ("worker", "left"),
        ("address", "left"),
        ("health", "left"),
        ("running", "right"),
        ("waiting", "right"),
        ("slot wait", "right"),
        ("KV use", "right"),
        ("in flight", "right"),
        ("hit rate", "right"),
        ("index blocks", "right"),
        ("event lag", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for w in status.workers:
        health = Text("healthy", "green") if w.healthy else Text("UNHEALTHY", "bold red")
        lag = "-" if w.event_lag_s is None else f"{w.event_lag_s:.1f}s"
        table.add_row(
            *((w.model,) if pools else ()),
            w.worker_id,
            w.address,
            health,
            _num(w.running),
            _num(w.waiting),
            _num(w.slot_queue),
            _pct(w.kv_usage),
            _num(w.inflight),
            _pct(w.hit_rate),
            _num(w.index_blocks),
            lag,
        )
    lines = []
    if status.unreachable or status.refused:
        lines.append(
            Text(
                f"not in the table: {_num(status.unreachable)} worker address(es) unreachable, "
                f"{_num(status.refused)} refused (the router's log says why)",
                "bold red",
            )
        )
    elif not status.workers:
        lines.append(Text("no worker has connected yet (the router's log says why)", "yellow"))
    if status.metrics_error:
        lines.append(Text(f"metrics: {status.metrics_error}", "yellow"))
    elif status.prompt_tokens is not None:
        realised = _ratio(status.cached_tokens, status.prompt_tokens)
        predicted = _ratio(status.predicted_tokens, status.prompt_tokens)
        forgone_share = _ratio(status.forgone_tokens, status.best_tokens)
        lines.append(
            Text(
                f"fleet hit rate: realised {_pct(realised)}, predicted {_pct(predicted)} "
                f"of {_num(status.prompt_tokens)} prompt tokens; "
                f"requests ok {_num(status.requests_ok)}, failed {_num(status.requests_failed)}"
            )
        )
        lines.append(
            Text(
                f"cache left on the table (forgone for load): {_num(status.forgone_tokens)} "
                f"tokens, {_pct(forgone_share)} of the best matches"
            )
        )
    return Group(table, *lines)


async def snapshot(args: argparse.Namespace) -> FleetStatus:
    """One look at the fleet (Explain, and the metrics when asked)."""
    explain = await explain_fleet(args.router, args.timeout_s)
    samples = None
    error = ""
    if args.metrics:
        try:
            samples = await asyncio.to_thread(scrape_metrics, _metrics_url(args.metrics))
        except (OSError, ValueError) as exc:
            error = f"could not scrape {args.metrics}: {exc}"
    status = collect(explain, samples, args.router)
    status.metrics_error = error
    return status


def _metrics_url(value: str) -> str:
    if value.startswith(("http://", "https://")):
        return value
    return f"http://{value}/metrics"


async def _run(args: argparse.Namespace, console: Console) -> int:
    try:
        if args.once:
            console.print(render(await snapshot(args)))
            return 0
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(render(await snapshot(args)), refresh=True)
                await asyncio.sleep(args.interval_s)
    except grpc.aio.AioRpcError as exc:
        print(
            f"kvroute status: router {args.router}: {exc.code().name}: {exc.details()}",
            file=sys.stderr,
        )
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute status",
        description="A live view of a router's workers: health, load, KV use, hit rate, index "
        "blocks, event lag, and the cache the router left on the table.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--router", default="127.0.0.1:50051", help="router gRPC HOST:PORT")
    p.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT|URL",
        help="the router's /metrics (its --metrics-port) for the hit-rate, index, event-lag "
        "and forgone-cache figures (default: none, those columns show '-')",
    )
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between redraws")
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each Explain call")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.interval_s > 0 or not args.timeout_s > 0:
        print("kvroute status: --interval-s and --timeout-s must be > 0", file=sys.stderr)
        return 2
    try:
        console = Console()
        if not console.is_terminal:  # piped (or --once into a file): don't wrap at 80 columns
            console = Console(width=160)
        return asyncio.run(_run(args, console))
    except KeyboardInterrupt:
        return 0
