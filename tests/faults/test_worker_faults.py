"""Worker faults under load: SIGKILL mid-stream, a restart (new epoch), a stall."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import pytest
from e2e_procs import procs
from faults_harness import (
    PURGE_AFTER_S,
    Row,
    assert_no_leak,
    codes_text,
    converge,
    drive,
    kill,
    no_stray_tasks,
    record,
    router_config,
    start_router,
    start_worker,
    wait_synced,
    wait_until,
)

from router.service.frontend import FrontendConfig
from router.service.worker_conn import ConnectionConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_worker_sigkill_mid_stream_under_load() -> None:
    # Roomy enough that a starved box (other jobs on the cores) does not turn the router's
    # deadline-aware admission into refusals: the test is about the kill, not the load.
    deadline_s = 20.0
    with procs() as p:
        workers = [start_worker(p, f"w{i}", speedup=1.0) for i in range(3)]
        async with no_stray_tasks():
            router = await start_router(router_config([w.address for w in workers]))
            try:
                await wait_synced(router, 3)
                victim = workers[1]
                load_task = asyncio.create_task(
                    drive(
                        router.address,
                        num_requests=90,
                        concurrency=30,
                        deadline_s=deadline_s,
                        max_new_tokens=120,
                    )
                )
                await wait_until(
                    lambda: router.core.worker_view(victim.worker_id).num_active >= 3,
                    "requests in flight on the victim",
                )
                kill(p, victim)
                gone_s = await wait_until(
                    lambda: (
                        not router.core.has_worker(victim.worker_id)
                        or not router.core.worker_blocks(victim.worker_id)
                    ),
                    "the killed worker's index entries dropped",
                    PURGE_AFTER_S + 10,
                )
                load = await load_task
                survivors = [w for w in workers if w is not victim]
                await assert_no_leak(survivors, router)
                converge_s = await converge(router, survivors)
            finally:
                await router.stop(0)
    codes = load.codes()
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    failed = [o for o in load.outcomes if o.code != "OK"]
    # a request without a first token was retried on another worker: only the ones that
    # had streamed tokens from the dead worker fail, with a clear UNAVAILABLE
    assert all(o.first_token for o in failed), failed
    assert all("w1" in o.message or "worker" in o.message for o in failed), failed[:3]
    assert codes["OK"] >= 60 and load.max_overrun_s() < 0.5, (codes, load.max_overrun_s())
    record(
        Row(
            test="worker_sigkill",
            fault="worker SIGKILL mid-stream (1 of 3 paced sim workers, 30 concurrent streams)",
            client_sees=f"{codes_text(load)}; every UNAVAILABLE had streamed tokens from the "
            f"dead worker; calls without a first token were retried elsewhere; worst overrun "
            f"of a deadline {max(load.max_overrun_s(), 0):.2f} s",
            index_after=f"dead worker's entries dropped {gone_s:.2f} s after the kill "
            f"(purge_after_s={PURGE_AFTER_S}); survivors' index == their snapshots",
            recovery="kill -> dead worker gone from the index",
            recover_s=round(gone_s, 2),
            details={"codes": dict(codes), "converge_s": round(converge_s, 2)},
        )
    )


async def test_worker_restart_new_epoch_converges() -> None:
    with procs() as p:
        w0 = start_worker(p, "w0")
        port = w0.port
        async with no_stray_tasks():
            router = await start_router(router_config([w0.address]))
            try:
                await wait_synced(router, 1)
                first = await drive(router.address, num_requests=40, concurrency=8)
                epoch_before = router.core.stream_position("w0")[0]
                kill(p, w0)
                await wait_until(lambda: router.pool.num_healthy == 0, "w0 seen down")
                restarted = time.perf_counter()
                w0 = start_worker(p, "w0", port=port)
                await wait_until(lambda: router.pool.num_healthy == 1, "w0 back")
                back_s = time.perf_counter() - restarted
                second = await drive(router.address, num_requests=40, concurrency=8, first_id=100)
                converge_s = await converge(router, [w0])
                epoch_after = router.core.stream_position("w0")[0]
                await assert_no_leak([w0], router)
            finally:
                await router.stop(0)
    assert epoch_after != epoch_before
    assert first.codes() == {"OK": 40} and second.codes() == {"OK": 40}
    total_s = back_s + converge_s
    record(
        Row(
            test="worker_restart",
            fault="worker SIGKILL then restart on the same port (new epoch, empty cache)",
            client_sees=f"before: {codes_text(first)}; after restart: {codes_text(second)}",
            index_after="old epoch purged; index == the new process's snapshot",
            recovery="restart -> routable again + index equal to its snapshot after quiet",
            recover_s=round(total_s, 2),
            details={"routable_s": round(back_s, 2), "converge_after_load_s": round(converge_s, 2)},
        )
    )


async def test_stalled_worker_is_left_out_then_readmitted() -> None:
    with procs() as p:
        workers = [start_worker(p, f"w{i}") for i in range(2)]
        slow = workers[0]
        async with no_stray_tasks():
            router = await start_router(router_config([w.address for w in workers]))
            try:
                await wait_synced(router, 2)
                slow.proc.popen.send_signal(signal.SIGSTOP)  # stalls: answers nothing
                try:
                    out_s = await wait_until(
                        lambda: router.pool.num_healthy == 1, "stalled worker left out", 15
                    )
                    during = await drive(router.address, num_requests=30, concurrency=6)
                finally:
                    slow.proc.popen.send_signal(signal.SIGCONT)
                back_s = await wait_until(
                    lambda: router.pool.num_healthy == 2, "worker readmitted", 15
                )
                after = await drive(router.address, num_requests=30, concurrency=6, first_id=50)
                await assert_no_leak(workers, router)
                converge_s = await converge(router, workers)
            finally:
                await router.stop(0)
    assert during.codes() == {"OK": 30}, during.codes()
    assert after.codes() == {"OK": 30}
    # keepalive 1 s + ping timeout 1 s (FAST_CONN), with a margin for a loaded machine
    assert out_s < 6.0, out_s
    record(
        Row(
            test="worker_stall",
            fault="slow (stalled) worker: SIGSTOP, so it answers nothing; SIGCONT later",
            client_sees=f"while stalled: {codes_text(during)} (sent to the other worker); "
            f"after: {codes_text(after)}",
            index_after="kept its entries while out; index == snapshots after",
            recovery=f"left out {out_s:.2f} s after the stall (keepalive 1 s + ping timeout "
            "1 s); readmitted after SIGCONT in",
            recover_s=round(back_s, 2),
            details={"left_out_s": round(out_s, 2), "converge_s": round(converge_s, 2)},
        )
    )


async def test_stalled_worker_under_load_costs_seconds_on_default_settings() -> None:
    """The router's default keepalive, not the harness's fast one: a worker SIGSTOPped with
    requests in flight holds no request more than 5 s."""
    with procs() as p:
        workers = [start_worker(p, f"w{i}", speedup=1.0) for i in range(2)]
        slow = workers[0]
        config = dataclasses.replace(
            router_config([w.address for w in workers]),
            connection=ConnectionConfig(),
            service=FrontendConfig(),
        )
        async with no_stray_tasks():
            router = await start_router(config)
            try:
                await wait_synced(router, 2)
                load_task = asyncio.create_task(
                    drive(
                        router.address,
                        num_requests=60,
                        concurrency=12,
                        deadline_s=20.0,
                        max_new_tokens=60,
                    )
                )
                await wait_until(
                    lambda: router.core.worker_view(slow.worker_id).num_active >= 2,
                    "requests in flight on the worker about to stall",
                )
                slow.proc.popen.send_signal(signal.SIGSTOP)
                stalled_at = time.perf_counter()
                try:
                    out_s = await wait_until(
                        lambda: router.pool.num_healthy == 1, "stalled worker left out", 15
                    )
                    load = await load_task
                finally:
                    slow.proc.popen.send_signal(signal.SIGCONT)
                await wait_until(lambda: router.pool.num_healthy == 2, "worker readmitted", 15)
                await assert_no_leak(workers, router)
            finally:
                await router.stop(0)
    codes = load.codes()
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    # only a call that had already streamed tokens from the stalled worker may fail
    assert all(o.first_token for o in load.outcomes if o.code != "OK")
    # the calls that were waiting on the stalled worker when it stopped
    caught = [o for o in load.outcomes if o.started < stalled_at < o.started + o.elapsed_s]
    worst = max(o.elapsed_s - max(0.0, stalled_at - o.started) for o in caught)
    assert out_s < 5.0 and worst < 5.0, (out_s, worst)
    record(
        Row(
            test="worker_stall_defaults",
            fault="a worker SIGSTOPped under load (12 concurrent paced streams), the router "
            "on its default keepalive (2 s ping, 1 s timeout)",
            client_sees=f"{codes_text(load)}; each failure had streamed tokens from the "
            f"stalled worker; the longest a call waited on it after the stall: {worst:.1f} s",
            index_after="kept its entries while out; readmitted after SIGCONT",
            recovery="stall -> worker left out of routing",
            recover_s=round(out_s, 2),
            details={"left_out_s": round(out_s, 2), "worst_wait_s": round(worst, 2)},
        )
    )
