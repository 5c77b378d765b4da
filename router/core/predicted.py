"""Predicted index entries: blocks a worker is expected to hold soon, kept for a TTL.

Sans-I/O: imports neither asyncio, grpc, torch nor a clock; deadlines are passed in.

When the router sends a request to a worker, it records that the worker will soon hold the
request's blocks, so a burst of requests with a new shared prefix follows the first one
before any event arrives. Predictions live apart from the event-fed (confirmed) entries and
are *sparse*: only every ``stride``-th block hash is kept (positions stride-1, 2*stride-1,
...). Because block hashes chain, a hit at position j names the whole prefix [0, j], so a
sparse walk measures a predicted prefix to within ``stride`` blocks at 1/stride of the
cost -- for an 8,192-token prompt at B=16 and stride 4, 128 entries instead of 512::

    query blocks     0  1  2  3  4  5  6  7  8  9 ...
    sparse probes             ^           ^           ^
    _pred[h]                 0b10        0b10       (absent)  -> worker 1: 8 blocks

A worker's predicted depth is stride times the number of leading probes it holds *or* is
predicted to hold, so a prediction only needs the probes past the worker's known prefix
(``start``). Events never touch predictions: a prediction confirmed by an event is simply
also a confirmed entry, and one that never materialises expires at its deadline. A hash's
deadline is the latest any prediction gave it (``_pred_until``); records in deadline order
(``_pred_queue``) drop a hash at their deadline only if no later prediction refreshed it.
Extending one worker's prediction extends the others' on the same block: a deliberate
simplification.

Holds: a request still waiting for its prefill will write its blocks, however long the
worker's queue is, so the core *holds* the hashes it predicted for it (``add(...,
hold=True)``) until the request's first token, then :meth:`release` starts their TTL. A held
hash outlives its deadline; holds are counted per hash (two queued requests predicting the
same block keep it until both are released), and like deadlines they are shared by every
worker predicted on that block. Without holds, a prediction for a request that queued for
longer than the TTL lapsed before the blocks existed, and the next request of its prefix
family went to a worker that had none of it (Mooncake replay at 4 workers: queues of 5-30 s).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from itertools import chain, compress, repeat, takewhile
from operator import add, itemgetter, not_, or_, sub

__all__ = ["PredictedEntries", "bits_of"]


def bits_of(mask: int) -> list[int]:
    """Slots whose bit is set in ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class PredictedEntries:
    """Sparse block hash -> predicted worker bitset, with deadlines.

    ``stride``: keep every stride-th block (1 keeps all).
    """

    def __init__(self, stride: int = 4) -> None:
        if stride < 1:
            raise ValueError(f"predict_stride must be >= 1, got {stride}")
        self.stride = stride
        self._pred: dict[int, int] = {}  # sparse block hash -> bitset of slots
        self._until: dict[int, float] = {}  # sparse block hash -> latest deadline
        self._queue: deque[tuple[float, Sequence[int]]] = deque()  # (deadline, hashes)
        self._held: dict[int, int] = {}  # sparse block hash -> requests holding it
        self._latest = -math.inf  # no deadline in _until is later (held ones have no record)

    def __len__(self) -> int:
        return len(self._pred)

    def has(self, h: int) -> bool:
        """Whether sparse block hash ``h`` is predicted for anyone."""
        return h in self._pred

    @property
    def num_pairs(self) -> int:
        """(sparse block, worker) pairs predicted."""
        return sum(m.bit_count() for m in self._pred.values())

    def hashes_of(self, slot: int) -> set[int]:
        """Sparse block hashes predicted for ``slot``."""
        bit = 1 << slot
        return {h for h, m in self._pred.items() if m & bit}

    def sparse(self, hashes: Sequence[int]) -> Sequence[int]:
        """The hashes a prediction keeps / a match probes: every stride-th."""
        stride = self.stride
        return hashes if stride == 1 else hashes[stride - 1 :: stride]

    def add(
        self,
        bit: int,
        hashes: Sequence[int],
        deadline: float,
        start: int = 0,
        hold: bool = False,
    ) -> Sequence[int]:
        """Predict ``bit``'s worker holds the prefix ``hashes`` until ``deadline``.

        Probes before block ``start`` (the worker's known depth) are left as they are.
        ``hold``: the probes entered also stay past ``deadline`` until :meth:`release`.
        Returns the probes entered (what a holder passes to :meth:`release`).
        """
        sparse = self.sparse(hashes)
        if start >= self.stride:
            sparse = sparse[start // self.stride :]  # probes at positions >= start
        if not sparse:
            return ()
        pred = self._pred
        if pred.keys().isdisjoint(sparse):  # all new (usual): C-level bulk insert
            pred.update(zip(sparse, repeat(bit)))
        else:  # OR the bit in, still without a Python loop
            ors = map(or_, map(pred.get, sparse, repeat(0)), repeat(bit))
            pred.update(zip(sparse, ors, strict=False))
        # a held hash needs no deadline record now: release() queues the one that counts
        self._set_deadline(sparse, deadline, record=not hold)
        if hold:
            held = self._held
            if held.keys().isdisjoint(sparse):  # usual: nobody holds these yet
                held.update(zip(sparse, repeat(1)))
            else:  # one hold per add, a repeated hash too (release frees it once):
                # every count is read before any is written
                counts = list(map(add, map(held.get, sparse, repeat(0)), repeat(1)))
                held.update(zip(sparse, counts, strict=True))
        return sparse

    def release(self, sparse: Sequence[int], deadline: float) -> None:
        """End one hold on the probes ``sparse`` (an :meth:`add` result); those no request
        holds any more live until ``deadline`` (or a later deadline they already had)."""
        if not sparse:
            return
        held = self._held
        left = list(map(sub, map(held.get, sparse, repeat(1)), repeat(1)))
        held.update(zip(sparse, left, strict=True))
        # dict.fromkeys: a hash repeated in ``sparse`` (a hash collision within a prompt)
        # was counted once by add(), and is freed once
        free = list(dict.fromkeys(compress(sparse, map(not_, left))))
        deque(map(held.pop, free), 0)
        live = list(filter(self._pred.__contains__, free))  # remove_slot may have dropped some
        if not live:
            return
        old = list(map(self._until.__getitem__, live))
        self._set_deadline(live, deadline)
        if max(old) > deadline:  # later deadlines they had get the records they lacked
            for h, t in zip(live, old, strict=True):
                if t > deadline:
                    self._set_deadline([h], t)

    def refresh(self, hashes: Sequence[int], deadline: float) -> None:
        """Extend the deadline of the predicted blocks among ``hashes`` (approx mode's LRU)."""
        pred = self._pred
        sparse = self.sparse(hashes)
        if pred.keys().isdisjoint(sparse):
            return
        self._set_deadline([h for h in sparse if h in pred], deadline)

    def _set_deadline(self, sparse: Sequence[int], deadline: float, record: bool = True) -> None:
        """Give ``sparse`` the deadline (or keep a later one they have), and queue the
        record expire() acts on unless ``record`` is False."""
        queue, until = self._queue, self._until
        if deadline >= self._latest:
            # in order (the core's clock is monotonic): overwriting is taking the latest
            self._latest = deadline
            until.update(zip(sparse, repeat(deadline)))
            if record:
                queue.append((deadline, sparse))
            return
        for h in sparse:
            until[h] = max(until.get(h, -math.inf), deadline)
        if record:
            i = bisect.bisect_right(queue, deadline, key=itemgetter(0))
            queue.insert(i, (deadline, sparse))

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the blocks dropped."""
        queue = self._queue
        if not queue or queue[0][0] > now:
            return 0
        pred, until, held = self._pred, self._until, self._held
        dropped = 0
        while queue and queue[0][0] <= now:
            deadline, hashes = queue.popleft()
            if list(map(until.get, hashes)).count(deadline) == len(hashes) and (
                not held or held.keys().isdisjoint(hashes)
            ):
                # nobody refreshed them: C-level bulk delete
                deque(map(until.pop, hashes, repeat(None)), 0)
                before = len(pred)
                deque(map(pred.pop, hashes, repeat(None)), 0)
                dropped += before - len(pred)
                continue
            for h in hashes:
                t = until.get(h)
                if t is not None and t <= now and h not in held:
                    del until[h]
                    dropped += pred.pop(h, None) is not None
        if not pred and (until or queue):  # nothing left: drop the grown tables
            self._until, self._queue = {}, deque()
        if not pred:
            self._pred = {}
        return dropped

    def remove_slot(self, bit: int) -> None:
        """Forget every prediction for the worker with bit ``bit``."""
        pred = {h: (m ^ bit if m & bit else m) for h, m in self._pred.items() if m != bit}
        self._pred = pred
        self._until = {h: t for h, t in self._until.items() if h in pred}

    def depth_of(self, bit: int, hashes: Sequence[int], confirmed: int) -> int:
        """:meth:`match` for one worker (``bit``, its bitset) whose confirmed prefix of
        ``hashes`` is ``confirmed`` blocks: how many leading probes it has, predicted or
        covered by that prefix, times the stride (blocks)."""
        stride = self.stride
        get = self._pred.get
        n = 0
        for h in self.sparse(hashes):
            if (n + 1) * stride > confirmed and not get(h, 0) & bit:
                break
            n += 1
        return n * stride

    def match(self, hashes: Sequence[int], confirmed: list[int]) -> list[int]:
        """Per probe of ``hashes``, the workers predicted to hold it or whose confirmed
        prefix covers it, up to the first probe nobody has. ``confirmed``: the running AND
        of the confirmed bitsets along ``hashes`` (worker sets by depth), so a worker's
        predicted tail continues its confirmed prefix."""
        predicted = map(self._pred.get, self.sparse(hashes), repeat(0))
        both = map(or_, predicted, chain(self.sparse(confirmed), repeat(0)))
        return list(takewhile(bool, both))
