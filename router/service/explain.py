"""The router's Explain over its model pools (router.core.pools): one pool's explanation,
or every pool's for a request naming no model on a router serving several (the fleet view
``kvroute status`` asks for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge.frontdoor import BadRequest, CallInfo
from kvroute_proto import kvroute_pb2 as pb
from router.core.errors import InvalidRouteRequestError
from router.core.pools import PoolsExplanation
from router.core.router_core import Explanation, RouteRequest
from router.service.tenancy import tenant_of

if TYPE_CHECKING:
    from router.service.frontend import Frontend
    from router.service.prepare import Prepared


def explain_pools(
    frontend: Frontend, request: pb.GenerateRequest, call: CallInfo
) -> PoolsExplanation:
    """Each worker's match, load and cost, and the pick; routes nothing. A text prompt is
    tokenized whole here (exact ``prompt_tokens``; a route may estimate the length of a tail
    no cache matches, which moves costs, never matches). Rate-limited like Generate."""
    tenant = tenant_of(frontend.config.tenancy, call.metadata, call.tenant_id)
    sure = frontend._sure_cost(request, with_output=False)
    frontend.quotas.precheck(tenant, sure)
    served = tuple(frontend.served_models())
    every = not request.model and len(served) > 1
    out: list[tuple[str, Explanation]] = []
    cost = 0
    for model in served if every else (request.model,):
        one = request
        if every:
            one = pb.GenerateRequest()
            one.CopyFrom(request)
            one.model = model
        prepared = frontend.prepare(one, call, split=False)
        cost = max(cost, frontend._quota_cost(prepared, with_output=False))
        out.append((prepared.model, _explain(prepared, frontend.ejector.ejected())))
    frontend.quotas.charge(tenant, cost, sure)
    return PoolsExplanation("" if every else out[0][0], tuple(out), served)


def _explain(prepared: Prepared, ejected: frozenset[str]) -> Explanation:
    route = prepared.route
    try:
        return prepared.core.explain(
            RouteRequest(route.request_id, route.token_ids, route.partition, exclude=ejected)
        )
    except InvalidRouteRequestError as exc:
        raise BadRequest(str(exc), param=exc.field) from None
