"""What the worker's request path reports to whoever watches it (metrics), and a no-op.

``WorkerGeneration`` (generation.py) calls these hooks while it streams a request: when the
first tokens leave, for each later chunk, and when the request ends. It never reads anything
back: observability watches, it does not steer. ``worker.service.metrics.WorkerMetrics``
implements the protocol with Prometheus instruments; this module imports no metrics library.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NO_OBSERVER", "GenerationObserver", "NullObserver"]


class GenerationObserver(Protocol):
    """Hooks of the worker's request path. Implementations must be cheap and never raise."""

    def on_first_token(self, seconds: float) -> None:
        """The first generated tokens left ``seconds`` after the request arrived (TTFT)."""

    def on_tokens(self, num_tokens: int, seconds: float) -> None:
        """A later chunk of ``num_tokens`` left ``seconds`` after the previous one."""

    def on_end(self, outcome: str, seconds: float) -> None:
        """The request ended ``seconds`` after it arrived: a finish reason ("stop",
        "length", "abort") or "cancelled" / "error" when it did not finish."""


class NullObserver:
    """Watches nothing (the default: a worker without ``--metrics-port``)."""

    def on_first_token(self, seconds: float) -> None:
        pass

    def on_tokens(self, num_tokens: int, seconds: float) -> None:
        pass

    def on_end(self, outcome: str, seconds: float) -> None:
        pass


NO_OBSERVER: GenerationObserver = NullObserver()
