"""Requests in flight, and how a router replica counts them when several share a fleet.

One router counts each of its picks once: its uncached tokens queue on the worker until
the first token, and it is active there until it ends. With R router replicas behind one
load balancer each replica sees only its own picks, so :class:`ReplicaAccounting` counts
an own pick R times (decision 0016), a cold one at most ``cold_picks`` times (0019). With
replica sync the others' picks arrive and count themselves (``peers``), so an own pick
counts R times only for the sync window (0018), and a warm one then stands for the
replicas' same-moment picks as running requests and recent work too (0024); while the
sync keeps pace with the router a cold pick is not capped (0020).

Sans-I/O: no asyncio, grpc or clock (the core passes ``now``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.core.views import WorkerView

if TYPE_CHECKING:
    from router.core.core_types import ReplicaEvent

__all__ = [
    "DEFAULT_REPLICA_AFFINITY_TOKENS",
    "DEFAULT_REPLICA_COLD_PICKS",
    "DEFAULT_REPLICA_COLD_WINDOW_PICKS",
    "INITIAL_REPLICA_SYNC_WINDOW_S",
    "REPLICA_SYNC_WINDOW_DECAY",
    "REPLICA_WINDOW_PICKS_PERIOD_S",
    "Inflight",
    "ReplicaAccounting",
    "ReplicaConfig",
    "open_flight",
]

DEFAULT_REPLICA_COLD_PICKS = 2.0  # ReplicaConfig.cold_picks (decision 0019)
DEFAULT_REPLICA_COLD_WINDOW_PICKS = 3  # ReplicaConfig.cold_window_picks (decision 0020)
# how long the most own picks one sync window held is remembered: between one and two of these
REPLICA_WINDOW_PICKS_PERIOD_S = 60.0
# ReplicaConfig.affinity_tokens' default for replicas without sync (decision 0021)
DEFAULT_REPLICA_AFFINITY_TOKENS = 1000.0
# an auto sync window (decision 0018) starts here, before the first measured delivery
INITIAL_REPLICA_SYNC_WINDOW_S = 0.005
# how an auto window follows the measured delays: up at once to a longer one, down by this
# share of the difference per measurement (a sync that was slow lately may be again)
REPLICA_SYNC_WINDOW_DECAY = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaConfig:
    """Router replicas sharing the fleet (``kvroute router --replicas`` and friends).

    ``count``: R, the replicas behind one load balancer (1: this router alone).
    ``cold_picks``: a cold pick (nothing of its prompt cached or predicted on the chosen
    worker) counts min(R, this) times. ``sync``: the replicas tell each other their picks
    (``--replica-sync``). ``sync_window_s``: with sync, how long an own pick counts R times
    (None: the sync's measured delivery time; inf: until its first token).
    ``peer_view``: with sync, a peer's pick counts the tokens uncached by the better of the
    peer's view and this router's own. ``cold_window_picks``: with sync and the peer view, a
    cold pick is not capped while the most own picks inside their sync window at once stays
    under this, lately (0: always capped). ``affinity_tokens``: the cost's affinity term
    (None: DEFAULT_REPLICA_AFFINITY_TOKENS with R > 1 and no sync, else 0).
    """

    count: int = 1
    cold_picks: float = DEFAULT_REPLICA_COLD_PICKS
    sync: bool = False
    sync_window_s: float | None = None
    peer_view: bool = True
    cold_window_picks: int = DEFAULT_REPLICA_COLD_WINDOW_PICKS
    affinity_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"replicas must be >= 1, got {self.count}")
        if not 1 <= self.cold_picks < math.inf:  # NaN too
            raise ValueError(f"replica_cold_picks must be finite and >= 1, got {self.cold_picks}")
        if self.cold_window_picks < 0:
            raise ValueError(
                f"replica_cold_window_picks must be >= 0, got {self.cold_window_picks}"
            )
        window = self.sync_window_s
        if window is not None and not window >= 0:  # NaN too; inf allowed
            raise ValueError(f"replica_sync_window_s must be >= 0 or None, got {window}")
        affinity = self.affinity_tokens
        if affinity is not None and not 0 <= affinity < math.inf:  # NaN too
            raise ValueError(
                f"replica_affinity_tokens must be finite and >= 0 or None, got {affinity}"
            )

    @property
    def policy_affinity_tokens(self) -> float:
        """The affinity term's weight the policy gets: 0 with one router; else
        ``affinity_tokens``, or its default when None (on without sync)."""
        if self.count < 2:
            return 0.0
        if self.affinity_tokens is not None:
            return self.affinity_tokens
        return 0.0 if self.sync else DEFAULT_REPLICA_AFFINITY_TOKENS


@dataclass(slots=True)
class Inflight:
    """A request in flight on ``view``'s worker, as this router counts it."""

    view: WorkerView
    prefill_tokens: int
    prefilling: bool = True
    held: Sequence[int] = ()  # predicted blocks held until the first token (index.predict)
    # with replica sync, what an own pick adds for the replicas' unseen picks of the same
    # moment until its sync window ends: requests counted active beyond this one, and
    # recent work in the views' scaled units (with the scale's origin then, so a rebase in
    # between leaves it alone)
    extra_active: int = 0
    extra_recent: float = 0.0
    extra_recent_t0: float = 0.0


def open_flight(view: WorkerView, prefill_tokens: int) -> Inflight:
    """A request in flight on ``view``'s worker: its prefill queued there, one more active."""
    view.inflight_prefill_tokens += prefill_tokens
    view.num_prefilling += 1
    view.num_active += 1
    view.refresh()
    return Inflight(view, prefill_tokens)


class ReplicaAccounting:
    """How this router counts its own picks among R replicas, and the peers' requests it
    hears of through replica sync (``peers``, by (router id, request id))."""

    def __init__(self, config: ReplicaConfig, now: float) -> None:
        self.config = config
        self.peers: dict[tuple[str, str], Inflight] = {}
        # who hears of this router's own picks, first tokens and finishes
        self.listener: Callable[[ReplicaEvent], None] | None = None
        self._window_auto = config.sync_window_s is None
        self._window_measured = False
        synced = config.sync and config.count > 1
        self.window_s = (
            math.inf
            if not synced
            else INITIAL_REPLICA_SYNC_WINDOW_S
            if config.sync_window_s is None
            else config.sync_window_s
        )
        # own picks counted R times until their window ends: (when it ends, request id, its
        # flight, the extra tokens to take off then), in the order placed
        self.unsettled: deque[tuple[float, str, Inflight, int]] = deque()
        # a cold pick is not capped while the most own picks inside their window at once,
        # in this period of REPLICA_WINDOW_PICKS_PERIOD_S and the one before, stays under
        # this (0: nothing to track)
        self._cold_window_picks = (
            config.cold_window_picks
            if config.peer_view and self.window_s != math.inf and config.count > config.cold_picks
            else 0
        )
        self._picks_now = 0
        self._picks_before = 0
        self._picks_since = now

    def count(
        self, request_id: str, view: WorkerView, prefill_tokens: int, cold: bool, now: float
    ) -> Inflight:
        """Open an own pick's flight, its uncached tokens counted as the replicas' same-moment
        picks are likely to add them too."""
        config = self.config
        picks: float = config.count
        if self._cold_window_picks:
            self._note_window_picks(now)
        if (
            cold
            and picks > config.cold_picks
            and max(self._picks_now, self._picks_before) >= self._cold_window_picks
        ):
            picks = config.cold_picks
        counted = round(prefill_tokens * picks)
        flight = open_flight(view, counted)
        if counted > prefill_tokens and self.window_s != math.inf:
            # with sync the others' picks arrive and count themselves: R times only until
            # they can have. A warm pick stands for them in every load term until then; a
            # cold one does not (their picks of that worker would mostly find its prefix)
            self.unsettled.append(
                (now + self.window_s, request_id, flight, counted - prefill_tokens)
            )
            extra = int(picks) - 1
            if extra > 0 and not cold:
                flight.extra_active = extra
                view.num_active += extra
                view.num_prefilling += extra  # the stand-ins are prefilling too
                view.refresh()
        return flight

    def _note_window_picks(self, now: float) -> None:
        """Keep the most own picks found inside their sync window at one pick, per period."""
        if now - self._picks_since >= REPLICA_WINDOW_PICKS_PERIOD_S:
            # a period with no pick at all leaves nothing to carry over
            late = now - self._picks_since >= 2 * REPLICA_WINDOW_PICKS_PERIOD_S
            self._picks_before = 0 if late else self._picks_now
            self._picks_now = 0
            self._picks_since = now
        held = len(self.unsettled)
        if held > self._picks_now:
            self._picks_now = held

    def observe_delay(self, delay_s: float) -> None:
        """The sync delivered a message ``delay_s`` after it was queued. With an auto window
        the first measurement replaces INITIAL_REPLICA_SYNC_WINDOW_S; after it the window
        rises to a longer delay at once and falls toward shorter ones by
        REPLICA_SYNC_WINDOW_DECAY of the difference. Negative or non-finite delays, and a
        fixed window, are left alone."""
        if not self._window_auto or self.window_s == math.inf:
            return
        if not 0 <= delay_s < math.inf:
            return
        window = self.window_s
        if delay_s >= window or not self._window_measured:  # the first replaces the guess
            self.window_s = delay_s
            self._window_measured = True
        else:
            self.window_s = window + (delay_s - window) * REPLICA_SYNC_WINDOW_DECAY

    def settle(self, now: float, own: dict[str, Inflight], recent_t0: float) -> None:
        """Own picks whose sync window has ended count once from now on (``own``: the
        router's flights by request id; ``recent_t0``: its recent-work scale's origin)."""
        unsettled = self.unsettled
        while unsettled and unsettled[0][0] < now:
            _, request_id, flight, extra = unsettled.popleft()
            view = flight.view
            # still the same request, still queued for prefill (a finish or first token
            # already took off all it counted)
            if flight.prefilling and own.get(request_id) is flight:
                flight.prefill_tokens -= extra
                view.inflight_prefill_tokens -= extra
            if flight.extra_active:  # (a finish took it off already)
                view.num_active -= flight.extra_active
                if flight.prefilling:  # (a first token took them off already)
                    view.num_prefilling -= flight.extra_active
                flight.extra_active = 0
            if flight.extra_recent:
                if flight.extra_recent_t0 == recent_t0:  # no rebase since
                    view.recent_prefill = max(0.0, view.recent_prefill - flight.extra_recent)
                flight.extra_recent = 0.0
            view.refresh()
