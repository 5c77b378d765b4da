"""Processes' CPU time from /proc, and the cgroups that cap a front's processes at a CPU
budget (``bench_dataplane --router-cpu-budget``; decision 0047). Bench only: Linux, and the
budget needs root and a writable cgroup ``cpu`` controller (v1 or v2).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
BUDGET_PERIOD_US = 100_000
SHARES_FACTOR = 8


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its descendants (the live ones)."""
    return sum(own_cpu_seconds(p) for p in descendants(pid))


def own_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` alone (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return sorted(out)


class CpuBudget:
    """The cgroups of ``--router-cpu-budget`` (see the module's docstring): under one parent
    with ``SHARES_FACTOR`` x the default weight, ``groups`` router groups each capped at
    ``cores`` cores and a ``load`` group (the client and the workers) without a cap; created
    on entry, removed on exit (their processes back in the root group)."""

    def __init__(self, cores: float, groups: int) -> None:
        if CGROUP_V1_CPU.joinpath("cpu.cfs_quota_us").exists():
            self.v2, base = False, CGROUP_V1_CPU
        elif "cpu" in CGROUP_V2.joinpath("cgroup.controllers").read_text().split():
            self.v2, base = True, CGROUP_V2
        else:
            raise RuntimeError("no writable cgroup cpu controller (v1 or v2)")
        self.cores = cores
        self.parent = base / f"kvroute-bench-{os.getpid()}"
        self.groups = [self.parent / f"router-{i}" for i in range(groups)]
        self.load = self.parent / "load"

    def __enter__(self) -> CpuBudget:
        self.parent.mkdir()
        if self.v2:
            (self.parent / "cgroup.subtree_control").write_text("+cpu")
            (self.parent / "cpu.weight").write_text(str(100 * SHARES_FACTOR))
        else:
            (self.parent / "cpu.shares").write_text(str(1024 * SHARES_FACTOR))
        quota = round(self.cores * BUDGET_PERIOD_US)
        self.load.mkdir()
        for group in self.groups:
            group.mkdir()
            if self.v2:
                (group / "cpu.max").write_text(f"{quota} {BUDGET_PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(BUDGET_PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
        return self

    def __exit__(self, *exc: object) -> None:
        root = self.parent.parent / "cgroup.procs"
        for group in [*self.groups, self.load, self.parent]:
            for _ in range(50):  # bounded: the routers are stopped before this
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        root.write_text(pid)
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    def add_load(self, pids: list[int]) -> None:
        """``pids`` (and what runs below them) into the uncapped ``load`` group."""
        for pid in pids:
            for p in descendants(pid):
                with contextlib.suppress(OSError):
                    (self.load / "cgroup.procs").write_text(str(p))

    def place(self, router_pid: int) -> list[list[int]]:
        """The router's processes into the groups: with ``--processes`` the supervisor's
        children one per group (the supervisor with the first), else the router in the
        first; the pids placed per group."""
        kids = children_of(router_pid)
        placed: list[list[int]] = [[] for _ in self.groups[: max(1, len(kids))]]
        if not kids:
            placed[0] = descendants(router_pid)
        else:
            if len(kids) > len(self.groups):
                raise RuntimeError(f"{len(kids)} router processes, {len(self.groups)} groups")
            placed[0].append(router_pid)
            for i, kid in enumerate(kids):
                placed[i] += descendants(kid)
        for group, pids in zip(self.groups, placed, strict=False):
            for pid in pids:
                (group / "cgroup.procs").write_text(str(pid))
        return placed

    def throttled(self, groups: int) -> list[tuple[int, int]]:
        """(periods, throttled periods) so far in each of the first ``groups`` groups."""
        out = []
        for group in self.groups[:groups]:
            stat = dict(
                line.split() for line in (group / "cpu.stat").read_text().splitlines() if line
            )
            out.append((int(stat["nr_periods"]), int(stat["nr_throttled"])))
        return out
