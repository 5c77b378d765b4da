"""What the router's request path reports to whoever watches it (metrics), and a no-op.

The Frontend (frontend.py) calls these hooks at fixed points of a request: the route
decision, the first relayed message, the worker's Finished, a retry, and the request's end
with its outcome. It never reads anything back: observability watches, it does not steer.
``router.service.metrics.RouterMetrics`` implements the protocol with Prometheus
instruments; this module imports no metrics library, so the request path does not either.

Outcomes are gRPC status code names ("OK", "INVALID_ARGUMENT", "UNAVAILABLE", "CANCELLED",
...): the code the client saw (ServiceError.grpc_code), whichever front door it came in by.
"""

from __future__ import annotations

from typing import Protocol

from kvroute_proto import kvroute_pb2 as pb
from router.core.router_core import RouteDecision

__all__ = ["NO_OBSERVER", "NullObserver", "RequestObserver"]


class RequestObserver(Protocol):
    """Hooks of the router's request path. Implementations must be cheap and never raise."""

    def on_route(self, decision: RouteDecision, seconds: float) -> None:
        """A route decision was made; ``seconds``: how long core.route took."""

    def on_first_message(self, worker_id: str, seconds: float) -> None:
        """The worker's first message was relayed ``seconds`` after the request arrived."""

    def on_finished(self, decision: RouteDecision, finished: pb.Finished, seconds: float) -> None:
        """The worker finished the request (its usage: realised cached tokens)."""

    def on_retry(self, worker_id: str, code: str) -> None:
        """The attempt on ``worker_id`` failed with ``code`` and is retried elsewhere."""

    def on_end(self, worker_id: str, policy: str, outcome: str) -> None:
        """The request ended with ``outcome`` (a gRPC code name); ``worker_id`` is the last
        worker tried ("" when none was chosen)."""


class NullObserver:
    """Watches nothing (the default: a router without ``--metrics-port``)."""

    def on_route(self, decision: RouteDecision, seconds: float) -> None:
        pass

    def on_first_message(self, worker_id: str, seconds: float) -> None:
        pass

    def on_finished(self, decision: RouteDecision, finished: pb.Finished, seconds: float) -> None:
        pass

    def on_retry(self, worker_id: str, code: str) -> None:
        pass

    def on_end(self, worker_id: str, policy: str, outcome: str) -> None:
        pass


NO_OBSERVER: RequestObserver = NullObserver()
