"""Test-only fault injection on a worker's live KV event stream (issue 12's fault suite).

Set ``KVROUTE_TEST_EVENT_FAULTS`` in a worker's environment, e.g.
``drop=0.05,duplicate=0.05,reorder=0.05,seed=3``: each live batch fanned out to subscribers
is then dropped, sent twice, or held back and sent after the next one, with those
probabilities (a seeded generator, so a run is reproducible). Replays and snapshots sent on
(re)subscription are never touched, which is what lets a subscriber that detected the
fault recover. Unset (the default), the runner holds None and its fan-out pays one
``is None`` check.

Sans-I/O: imports neither asyncio nor grpc; the random generator is seeded here.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["ENV_VAR", "EventFaultConfig", "EventFaults", "faults_from_env"]

ENV_VAR = "KVROUTE_TEST_EVENT_FAULTS"
log = logging.getLogger("kvroute.worker.service")
M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class EventFaultConfig:
    """Per-batch probabilities of each fault (their sum must not pass 1) and the seed."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{ENV_VAR}: {name} must be in [0, 1], got {p}")
        if self.drop + self.duplicate + self.reorder > 1.0:
            raise ValueError(f"{ENV_VAR}: drop + duplicate + reorder must not pass 1")

    @classmethod
    def parse(cls, text: str) -> EventFaultConfig:
        """``drop=P,duplicate=P,reorder=P,seed=N`` (any subset, any order)."""
        values: dict[str, float | int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in ("drop", "duplicate", "reorder", "seed"):
                raise ValueError(
                    f"{ENV_VAR}: expected drop=P,duplicate=P,reorder=P,seed=N, got {part!r}"
                )
            try:
                values[key] = int(raw) if key == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {key} is not a number: {raw!r}") from None
        return cls(**values)  # type: ignore[arg-type]


class EventFaults(Generic[M]):
    """Applies :class:`EventFaultConfig` to a sequence of messages, one at a time."""

    def __init__(self, config: EventFaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._held: M | None = None
        self.num_dropped = 0
        self.num_duplicated = 0
        self.num_reordered = 0

    def apply(self, msg: M) -> list[M]:
        """What goes out instead of ``msg`` (in order): nothing, it twice, or it and the
        message held back before it."""
        c = self.config
        r = self._rng.random()
        out: list[M]
        if r < c.drop:
            self.num_dropped += 1
            out = []
        elif r < c.drop + c.duplicate:
            self.num_duplicated += 1
            out = [msg, msg]
        elif r < c.drop + c.duplicate + c.reorder and self._held is None:
            self.num_reordered += 1
            self._held = msg  # goes out after the next message
            return []
        else:
            out = [msg]
        if self._held is not None:
            out.append(self._held)
            self._held = None
        return out


def faults_from_env() -> EventFaults | None:
    """The injector ``KVROUTE_TEST_EVENT_FAULTS`` asks for, or None when it is unset."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    config = EventFaultConfig.parse(text)
    log.warning("TEST FAULTS ON: live KV event batches are perturbed (%s)", config)
    return EventFaults(config)
