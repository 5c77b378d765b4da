"""Router values -> protobuf messages (the service shells' one place for it).

The core's :class:`~router.core.core_types.Explanation` knows neither protobuf nor the pool; the
gRPC servicer (and anything else answering Explain) turns it into an ``ExplainResponse``
here, filling the address from the pool and the health from ejections.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from router.core.core_types import Explanation, WorkerScore
from router.core.pools import PoolsExplanation
from router.core.router_core import UNHEALTHY


def worker_score_to_pb(
    score: WorkerScore,
    *,
    address: str | None = "",
    ejected: bool = False,
    last_error: str = "",
) -> pb.WorkerScore:
    """One worker's Explain line: ``address`` when the core has none (None: no address at
    all, not even the core's), unhealthy while ``ejected``. The cost is left unset (not NaN)
    where the policy has none for that worker; ``not_candidate_reason`` says why a worker
    is not a candidate, with the connection's ``last_error`` for an unhealthy one."""
    reason = score.not_candidate_reason
    if reason == UNHEALTHY and last_error:
        reason = f"{UNHEALTHY}: {last_error}"
    elif ejected and not reason:
        reason = "ejected after consecutive failures (cooling down)"
    msg = pb.WorkerScore(
        worker_id=score.worker_id,
        address="" if address is None else score.address or address,
        healthy=score.healthy and not ejected,
        matched_tokens=score.matched_tokens,
        event_matched_tokens=score.event_matched_tokens,
        predicted_matched_tokens=score.predicted_matched_tokens,
        inflight_prefill_tokens=score.inflight_prefill_tokens,
        recent_prefill_tokens=score.recent_prefill_tokens,
        not_candidate_reason=reason,
        slot_queue=score.slot_queue,
    )
    if score.cost is not None and math.isfinite(score.cost):
        msg.cost = score.cost
    if score.load is not None:
        msg.load.CopyFrom(codec.load_to_pb(score.load))
    return msg


def explanation_to_pb(
    expl: Explanation,
    *,
    address_of: Callable[[str], str | None] = lambda _worker_id: "",
    ejected: Container[str] = (),
    last_error_of: Callable[[str], str] = lambda _worker_id: "",
) -> pb.ExplainResponse:
    """The ExplainResponse for ``expl`` (``address_of``: worker id -> address, the pool's,
    None to show none; ``ejected``: worker ids ejected for failures; ``last_error_of``:
    worker id -> its connection's last error)."""
    return pb.ExplainResponse(
        policy=expl.policy,
        prompt_tokens=expl.prompt_tokens,
        chosen_worker_id=expl.chosen_worker_id or "",
        miss_factor=expl.miss_factor,
        workers=[
            worker_score_to_pb(
                w,
                address=address_of(w.worker_id),
                ejected=w.worker_id in ejected,
                last_error=last_error_of(w.worker_id) if not w.healthy else "",
            )
            for w in expl.workers
        ],
    )


def pools_explanation_to_pb(
    explained: PoolsExplanation,
    *,
    address_of: Callable[[str], str | None] = lambda _worker_id: "",
    ejected: Container[str] = (),
    last_error_of: Callable[[str], str] = lambda _worker_id: "",
) -> pb.ExplainResponse:
    """The ExplainResponse of one pool's explanation, or of every pool's (a request naming
    no model on a router serving several: each pool's workers, each with its model, and no
    pick); ``models``: every served model."""
    parts = []
    for model, expl in explained.explanations:
        part = explanation_to_pb(
            expl, address_of=address_of, ejected=ejected, last_error_of=last_error_of
        )
        for w in part.workers:
            w.model = model
        parts.append(part)
    if explained.model:
        resp = parts[0]
        resp.model = explained.model
    else:
        resp = pb.ExplainResponse(policy=parts[0].policy, prompt_tokens=parts[0].prompt_tokens)
        for part in parts:
            resp.workers.extend(part.workers)
    resp.models.extend(explained.served)
    return resp
