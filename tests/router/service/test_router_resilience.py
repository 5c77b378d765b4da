"""Backoff bounds and outlier ejection, with an injected clock and rng."""

import random

import pytest

from router.service.resilience import (
    Backoff,
    BackoffConfig,
    EjectionConfig,
    OutlierEjector,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_grows_exponentially_and_is_bounded():
    b = Backoff(BackoffConfig(initial_s=0.1, max_s=1.0, multiplier=2.0), random.Random(0))
    caps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for cap in caps:
        d = b.next_delay()
        assert 0.1 * cap <= d <= cap
    for _ in range(200):
        assert b.next_delay() <= 1.0
    b.reset()
    assert b.next_delay() <= 0.1


def test_backoff_jitter_differs_between_seeds():
    cfg = BackoffConfig()
    a = [Backoff(cfg, random.Random(1)).next_delay() for _ in range(1)]
    b = [Backoff(cfg, random.Random(2)).next_delay() for _ in range(1)]
    assert a != b


def test_backoff_config_validation():
    with pytest.raises(ValueError, match="initial_s"):
        BackoffConfig(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="multiplier"):
        BackoffConfig(multiplier=0.5)


def test_ejection_after_n_consecutive_failures_for_cooldown():
    clock = FakeClock()
    ej = OutlierEjector(EjectionConfig(max_consecutive_failures=3, cooldown_s=10.0), clock)
    assert not ej.record_failure("w0")
    assert not ej.record_failure("w0")
    assert ej.record_failure("w0")
    assert ej.is_ejected("w0") and ej.ejected() == {"w0"}
    clock.now = 9.9
    assert ej.is_ejected("w0")
    clock.now = 10.0
    assert not ej.is_ejected("w0")
    # probation: one more failure ejects again at once
    assert ej.record_failure("w0")
    assert ej.is_ejected("w0") and ej.num_ejections == 2


def test_success_resets_the_count():
    clock = FakeClock()
    ej = OutlierEjector(EjectionConfig(max_consecutive_failures=2, cooldown_s=5.0), clock)
    ej.record_failure("w0")
    ej.record_success("w0")
    assert not ej.record_failure("w0")
    assert not ej.is_ejected("w0")
    assert ej.record_failure("w0")
    ej.record_success("w0")
    assert not ej.is_ejected("w0")


def test_failures_while_ejected_do_not_double_count():
    clock = FakeClock()
    ej = OutlierEjector(EjectionConfig(max_consecutive_failures=1, cooldown_s=5.0), clock)
    assert ej.record_failure("w0")
    assert not ej.record_failure("w0")
    assert ej.num_ejections == 1
    ej.forget("w0")
    assert not ej.is_ejected("w0")


def test_ejection_config_validation():
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        EjectionConfig(max_consecutive_failures=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        EjectionConfig(cooldown_s=-1)


def test_calls_that_fail_together_count_once():
    """One connection reset fails every stream on it at once: calls already in flight when
    the last counted failure happened are the same incident. Calls sent after it count."""
    clock = FakeClock()
    ej = OutlierEjector(EjectionConfig(max_consecutive_failures=3, cooldown_s=10.0), clock)
    clock.now = 5.0
    assert not ej.record_failure("w0", started_at=1.0)  # the reset: counted
    for sent in (1.0, 2.0, 4.9, 5.0):  # the other streams on that connection
        assert not ej.record_failure("w0", started_at=sent)
    assert not ej.is_ejected("w0")
    clock.now = 6.0
    assert not ej.record_failure("w0", started_at=5.5)  # sent after it: a second failure
    clock.now = 7.0
    assert ej.record_failure("w0", started_at=6.5)  # the third: ejected
    assert ej.num_ejections == 1
