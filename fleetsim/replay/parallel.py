"""``kvroute replay --jobs N``: the sim replays of one report, run in parallel processes.

Every sim replay -- one per policy, and the pooled reference and infinite ceiling -- is a
self-contained, seeded simulation of the same trace: it reads nothing another one writes, and
its token expansion is a pure function of (seed, hash id). So the replays can run in separate
processes and the report is the same, field for field, as the one a single process builds
one replay after another (a test holds the two against each other); only the per-replay wall
time, which the JSON leaves out, differs.

The workers are started with ``spawn`` (a fresh interpreter each: no state forked from the
parent, no fork-after-threads hazards) and receive the trace and the configuration once,
when they start, not once per replay. On Linux each asks the kernel to stop it when the
replay process dies, so a killed replay leaves no worker running on.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from fleetsim.replay.report import PolicyReport
from fleetsim.replay.trace import TokenExpander, TraceRecord

if TYPE_CHECKING:
    from fleetsim.replay.sim_config import SimConfig

__all__ = ["REFERENCE_KINDS", "reference_config", "replay_one", "resolve_jobs", "run_replays"]

REFERENCE_KINDS = ("pooled", "infinite")


def reference_config(config: SimConfig) -> SimConfig:
    """The configuration the references replay under: one engine as big as the fleet, and no
    router to charge -- no decision time, network delay or event loss there."""
    return replace(
        config,
        event_delay_s=0.0,
        num_routers=1,
        route_decision_s=0.0,
        measure_route_time=False,
        network_delay_s=0.0,
        event_loss=0.0,
    )


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_jobs(jobs: int, tasks: int) -> int:
    """How many processes ``--jobs`` asks for (0: one per available CPU), never more than
    there are replays to run, at least 1."""
    if jobs < 0:
        raise ValueError(f"--jobs must be >= 0 (0: one per CPU), got {jobs}")
    wanted = available_cpus() if jobs == 0 else jobs
    return max(1, min(wanted, tasks))


# one worker process's share of the job, set once by _start (run_replays with jobs > 1)
_records: Sequence[TraceRecord] = ()
_config: SimConfig | None = None
_trace_block_size = 0
_expander: TokenExpander | None = None


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel stop this worker process when the replay that started it
    dies (killed, or ended by a signal it does not catch): a worker must not go on
    replaying for nobody. Elsewhere the pool's own shutdown is all there is."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not allowed here: the pool's shutdown still ends it on a normal exit
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _start(
    records: Sequence[TraceRecord], config: SimConfig, trace_block_size: int, parent: int
) -> None:
    global _records, _config, _trace_block_size, _expander
    _die_with_parent(parent)
    _records, _config, _trace_block_size = records, config, trace_block_size
    _expander = TokenExpander(trace_block_size, config.vocab_size, config.seed)


def replay_one(
    kind: str,
    name: str,
    records: Sequence[TraceRecord],
    config: SimConfig,
    trace_block_size: int,
    expander: TokenExpander,
    progress: TextIO | None = None,
) -> PolicyReport:
    """One sim replay: ``kind`` "policy" (``name`` a policy) or "reference" (``name`` one of
    REFERENCE_KINDS, under :func:`reference_config`)."""
    from fleetsim.replay.references import simulate_reference
    from fleetsim.replay.sim import simulate

    if kind == "policy":
        return simulate(records, name, config, expander, progress_stream=progress)
    return simulate_reference(
        records,
        name,
        reference_config(config),
        expander,
        trace_block_size=trace_block_size,
        progress_stream=progress,
    )


def _replay(kind: str, name: str) -> PolicyReport:
    """:func:`replay_one` in a worker process, over what :func:`_start` was given."""
    assert _config is not None and _expander is not None, "not started by run_replays"
    return replay_one(kind, name, _records, _config, _trace_block_size, _expander)


def run_replays(
    records: Sequence[TraceRecord],
    config: SimConfig,
    trace_block_size: int,
    policies: Sequence[str],
    references: Sequence[str],
    jobs: int = 1,
    progress: TextIO | None = None,
) -> list[PolicyReport]:
    """Replay every policy and then every reference kind; the reports come back in that
    order. ``jobs`` 1: one after another in this process, each with its progress bar on
    ``progress``; more: in up to ``jobs`` processes, a line on ``progress`` as each replay
    finishes, and the first replay that raises stops the rest (those not started are
    cancelled, the running ones finish) and its exception is raised here."""
    for kind in references:
        if kind not in REFERENCE_KINDS:
            raise ValueError(f"reference kind must be one of {REFERENCE_KINDS}, got {kind!r}")
    tasks = [("policy", p) for p in policies] + [("reference", k) for k in references]
    if not tasks:
        return []
    if jobs <= 1:
        expander = TokenExpander(trace_block_size, config.vocab_size, config.seed)
        return [
            replay_one(kind, name, records, config, trace_block_size, expander, progress)
            for kind, name in tasks
        ]
    start = time.monotonic()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=max(1, min(jobs, len(tasks))),
        mp_context=context,
        initializer=_start,
        initargs=(list(records), config, trace_block_size, os.getpid()),
    ) as pool:
        futures: dict[Future[PolicyReport], int] = {
            pool.submit(_replay, kind, name): i for i, (kind, name) in enumerate(tasks)
        }
        results: list[PolicyReport | None] = [None] * len(tasks)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is not None:
                    for other in pending:
                        other.cancel()
                    raise error
                i = futures[future]
                result = results[i] = future.result()
                if progress is not None:
                    finished = sum(r is not None for r in results)
                    print(
                        f"kvroute replay: {tasks[i][1]} done in {result.wall_s:.1f} s "
                        f"({finished}/{len(tasks)}, {time.monotonic() - start:.1f} s so far)",
                        file=progress,
                        flush=True,
                    )
    return [r for r in results if r is not None]
