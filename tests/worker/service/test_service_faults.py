"""The test-only KV event fault injector (worker/service/faults.py)."""

from __future__ import annotations

import pytest

from worker.service.faults import ENV_VAR, EventFaultConfig, EventFaults, faults_from_env


def test_parse_reads_every_key_and_refuses_the_rest() -> None:
    c = EventFaultConfig.parse("drop=0.1, duplicate=0.2,reorder=0.3,seed=7")
    assert c == EventFaultConfig(0.1, 0.2, 0.3, 7)
    with pytest.raises(ValueError, match="expected drop=P"):
        EventFaultConfig.parse("lose=0.1")
    with pytest.raises(ValueError, match="drop is not a number"):
        EventFaultConfig.parse("drop=x")
    with pytest.raises(ValueError, match="must not pass 1"):
        EventFaultConfig.parse("drop=0.6,duplicate=0.6")
    with pytest.raises(ValueError, match=r"reorder must be in \[0, 1\]"):
        EventFaultConfig(reorder=-0.1)


def test_each_fault_alone() -> None:
    assert [EventFaults(EventFaultConfig(drop=1.0)).apply(i) for i in range(3)] == [[], [], []]
    dup = EventFaults(EventFaultConfig(duplicate=1.0))
    assert [dup.apply(i) for i in range(3)] == [[0, 0], [1, 1], [2, 2]]
    swap = EventFaults(EventFaultConfig(reorder=1.0))
    # held, then the next goes first and the held one after it; then again
    assert [swap.apply(i) for i in range(4)] == [[], [1, 0], [], [3, 2]]
    assert (swap.num_reordered, EventFaults(EventFaultConfig()).apply(5)) == (2, [5])


def test_mixed_faults_keep_every_message_that_is_not_dropped() -> None:
    f = EventFaults(EventFaultConfig(drop=0.2, duplicate=0.2, reorder=0.2, seed=1))
    out = [m for i in range(1000) for m in f.apply(i)]
    assert f.num_dropped > 0 and f.num_duplicated > 0 and f.num_reordered > 0
    assert len(out) == 1000 - f.num_dropped + f.num_duplicated - (1 if f._held is not None else 0)
    assert out != sorted(out)  # reordered


def test_off_unless_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert faults_from_env() is None
    monkeypatch.setenv(ENV_VAR, "drop=0.5,seed=2")
    faults = faults_from_env()
    assert faults is not None and faults.config == EventFaultConfig(drop=0.5, seed=2)
