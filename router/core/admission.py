"""Deadline-aware admission: refuse at once what cannot finish in time, so the fleet's work
goes to requests that will.

Without it an overloaded fleet accepts everything and finishes nothing: every request joins
the running batch, every decode step slows down, and every request misses its deadline
(300 requests with 20 s deadlines on two workers: 0 succeeded). With it, a request whose
estimated finish on a worker lies past its deadline is not sent there; when no worker can
finish it in time it is refused (RESOURCE_EXHAUSTED / HTTP 429) within the routing call.

The model, per worker, learnt from the streams the router relays (no worker support needed)::

    step(k)   = a + b * k         decode step time at k requests in flight (least squares
                                  over exponentially weighted samples of (k, inter-token time))
    ttft(x)   = c + d * x         time to the first token with x prefill tokens ahead on the
                                  worker, the request's own included (least squares over
                                  samples of (prompt tokens that began to stream on the
                                  worker between a request's dispatch and its own first
                                  token, its own included; that time to first token))
    finish(n) = ttft(queued + own) + n * step(k + 1)
                                  for a request of n new tokens joining k others, with
                                  ``queued`` prefill tokens dispatched there and not yet begun
                                  to stream, and ``own`` its uncached prompt tokens

The prefill fit is proportional to x (through the origin) until its samples spread over
x, so one first token is enough to stop a cold worker taking prompts it would start only
after their deadlines; without any, the decode model's mean time to first token stands in.
A prompt's own tokens are counted whole when it is checked (before routing, its match is
not known), and its uncached ones once it is dispatched.

A sample is one relayed chunk: the time since that request's previous chunk divided by the
chunk's tokens, paired with the worker's in-flight count; until ``min_samples`` of them the
step is their mean (no slope). With no samples the estimate is unknown and the request is
admitted, but never beyond a **window**: at most ``max(initial_window, 2 * largest
concurrency sampled)`` requests in flight per worker (slow start), so a cold burst cannot
drown a worker before its model exists; and before a worker's first token it holds at most
one engine step's prefill budget of queued prompt tokens (any single prompt when none is
queued), so a cold burst of long prompts cannot queue past every deadline.

Sans-I/O: no asyncio, grpc or clock; times are passed in (seconds, any monotonic origin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Prompt tokens a worker may hold queued before its first token gives a prefill rate:
# one engine step's prefill budget (the worker's max_prefill_tokens_per_step default).
COLD_PREFILL_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """``enabled``: off restores admit-everything (up to max_inflight).
    ``initial_window``: in-flight requests per worker allowed before its model has samples.
    ``min_samples``: samples before the step model is trusted.
    ``halflife_samples``: weight of past samples halves every this many new ones.
    ``margin``: the estimate is multiplied by this before comparing with the deadline.
    ``default_new_tokens``: assumed when a request leaves max_new_tokens to the worker."""

    enabled: bool = True
    initial_window: int = 32
    min_samples: int = 32
    halflife_samples: float = 512.0
    margin: float = 1.1
    default_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.initial_window < 1:
            raise ValueError(
                f"initial_window (--admission-window) must be >= 1, got {self.initial_window}"
            )
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {self.min_samples}")
        if not self.halflife_samples > 0:
            raise ValueError(f"halflife_samples must be > 0, got {self.halflife_samples}")
        if not (math.isfinite(self.margin) and self.margin >= 1):
            raise ValueError(f"margin must be a finite number >= 1, got {self.margin}")
        if self.default_new_tokens < 1:
            raise ValueError(f"default_new_tokens must be >= 1, got {self.default_new_tokens}")


@dataclass(slots=True)
class _StepModel:
    """Exponentially weighted least squares of inter-token time on concurrency."""

    decay: float
    n: int = 0
    w: float = 0.0  # total weight
    sk: float = 0.0
    sy: float = 0.0
    skk: float = 0.0
    sky: float = 0.0
    ttft_s: float = 0.0  # EWMA of dispatch -> first chunk
    num_ttft: int = 0
    max_k: int = 0  # largest concurrency sampled

    def add(self, k: int, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.sk = self.sk * d + k
        self.sy = self.sy * d + y
        self.skk = self.skk * d + k * k
        self.sky = self.sky * d + k * y
        self.n += 1
        if k > self.max_k:
            self.max_k = k

    def add_ttft(self, seconds: float) -> None:
        self.num_ttft += 1
        alpha = max(0.05, 1.0 / self.num_ttft)
        self.ttft_s += alpha * (seconds - self.ttft_s)

    def step_s(self, k: int) -> float:
        """Estimated step time at concurrency ``k`` (callers check ``n`` first)."""
        mean_k = self.sk / self.w
        mean_y = self.sy / self.w
        var_k = self.skk / self.w - mean_k * mean_k
        slope = 0.0
        if var_k > 1e-9:
            slope = max(0.0, (self.sky / self.w - mean_k * mean_y) / var_k)
        # The intercept is where the fit crosses k = mean_k; past the sampled range the line
        # is extrapolated, which is what slow start keeps within a factor of two.
        return max(0.0, mean_y + slope * (k - mean_k))

    def ttft_s_at(self, x: int) -> float:
        """As a time to first token with ``x`` prefill tokens ahead: the fitted line once
        the samples spread over x, before that proportional to x (one sample is enough to
        stop a cold worker from taking prompts it will start only after their deadlines)."""
        mean_x = self.sk / self.w
        if self.n >= 2 and self.skk / self.w - mean_x * mean_x > 1e-9:
            return self.step_s(x)
        mean_y = self.sy / self.w
        return mean_y * x / mean_x if mean_x > 0 else mean_y


@dataclass(slots=True)
class _Flight:
    worker_id: str
    dispatched_at: float
    last_at: float | None = None  # time of the previous chunk (None before the first)
    prefill_tokens: int = 0  # its uncached prompt tokens, queued on the worker until it streams
    prefilled_before: int = 0  # the worker's prefill done (streamed prompts) at dispatch


@dataclass(slots=True)
class AdmissionStats:
    """Plain counters for the metrics shell."""

    num_refused: int = 0  # requests no worker could finish in time
    num_excluded: int = 0  # (request, worker) pairs left out for time or window


@dataclass(slots=True)
class Admission:
    """Per-worker step models and in-flight counts; which workers a request may go to."""

    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    stats: AdmissionStats = field(default_factory=AdmissionStats)
    _models: dict[str, _StepModel] = field(default_factory=dict)
    _prefill: dict[str, _StepModel] = field(default_factory=dict)  # ttft on prefill ahead
    _inflight: dict[str, int] = field(default_factory=dict)
    _queued_prefill: dict[str, int] = field(default_factory=dict)
    _prefilled: dict[str, int] = field(default_factory=dict)  # prompt tokens that streamed
    _flights: dict[str, _Flight] = field(default_factory=dict)

    def _model(self, worker_id: str, models: dict[str, _StepModel] | None = None) -> _StepModel:
        models = self._models if models is None else models
        model = models.get(worker_id)
        if model is None:
            decay = 0.5 ** (1.0 / self.config.halflife_samples)
            model = models[worker_id] = _StepModel(decay)
        return model

    def estimate_s(self, worker_id: str, new_tokens: int, prompt_tokens: int = 0) -> float | None:
        """Estimated seconds for a request of ``new_tokens`` (and ``prompt_tokens`` to
        prefill) joining the worker now, or None while neither model has samples. With
        only the prefill fit the decode is left out: an estimate too low, never a refusal
        too many."""
        model = self._models.get(worker_id)
        prefill = self._prefill.get(worker_id)
        ttft = None
        if prefill is not None and prefill.n >= 1:
            ttft = prefill.ttft_s_at(self._queued_prefill.get(worker_id, 0) + prompt_tokens)
        if model is None or model.n == 0:
            return ttft
        if model.n < self.config.min_samples:
            # too few samples for a slope: their mean step, so a prefill-bound request is
            # not admitted on its first token's estimate alone
            step = model.sy / model.w
            if ttft is None:
                return None
        else:
            step = model.step_s(self._inflight.get(worker_id, 0) + 1)
        return (model.ttft_s if ttft is None else ttft) + new_tokens * step

    def queued_prefill(self, worker_id: str) -> int:
        """Uncached prompt tokens dispatched to the worker that have not begun to stream."""
        return self._queued_prefill.get(worker_id, 0)

    def window(self, worker_id: str) -> int:
        """In-flight requests the worker may hold (slow start: twice what was sampled)."""
        model = self._models.get(worker_id)
        sampled = model.max_k if model is not None else 0
        return max(self.config.initial_window, 2 * sampled)

    def excluded(
        self, worker_ids: list[str], new_tokens: int, time_left_s: float, prompt_tokens: int = 0
    ) -> frozenset[str]:
        """The workers that cannot take this request: full window, or an estimated finish
        past ``time_left_s``. Empty when admission is off."""
        cfg = self.config
        if not cfg.enabled:
            return frozenset()
        n = new_tokens or cfg.default_new_tokens
        out = []
        for worker_id in worker_ids:
            if self._inflight.get(worker_id, 0) >= self.window(worker_id):
                out.append(worker_id)
                continue
            if self._cold_prefill_full(worker_id, prompt_tokens):
                out.append(worker_id)
                continue
            estimate = self.estimate_s(worker_id, n, prompt_tokens)
            if estimate is not None and estimate * cfg.margin > time_left_s:
                out.append(worker_id)
        self.stats.num_excluded += len(out)
        return frozenset(out)

    def _cold_prefill_full(self, worker_id: str, prompt_tokens: int) -> bool:
        """Before its first token the worker's prefill rate is unknown: it takes prompts
        up to one engine step's prefill budget at a time (any single prompt when nothing is
        queued), so a cold burst of long prompts cannot queue past every deadline."""
        prefill = self._prefill.get(worker_id)
        if prefill is not None and prefill.n >= 1:
            return False
        queued = self._queued_prefill.get(worker_id, 0)
        return queued > 0 and queued + prompt_tokens > COLD_PREFILL_TOKENS

    def on_refused(self) -> None:
        self.stats.num_refused += 1

    def idle_estimate_s(
        self, worker_ids: list[str], new_tokens: int, prompt_tokens: int = 0
    ) -> float | None:
        """When every one of ``worker_ids`` is idle (nothing in flight) and has a model: the
        fastest one's estimate for ``new_tokens``, so a refusal can say waiting will not
        help. None otherwise."""
        if any(self._inflight.get(w, 0) for w in worker_ids):
            return None
        n = new_tokens or self.config.default_new_tokens
        estimates = [self.estimate_s(w, n, prompt_tokens) for w in worker_ids]
        if not estimates or any(e is None for e in estimates):
            return None
        return min(e for e in estimates if e is not None)

    # ---- what the front end relays -------------------------------------------------------

    def on_dispatch(
        self, request_id: str, worker_id: str, now: float, prefill_tokens: int = 0
    ) -> None:
        """The request was sent to ``worker_id`` with ``prefill_tokens`` uncached."""
        self.on_done(request_id)  # a retry replaces the earlier attempt
        done = self._prefilled.get(worker_id, 0)
        self._flights[request_id] = _Flight(worker_id, now, None, prefill_tokens, done)
        self._inflight[worker_id] = self._inflight.get(worker_id, 0) + 1
        self._queued_prefill[worker_id] = self._queued_prefill.get(worker_id, 0) + prefill_tokens

    def on_tokens(self, request_id: str, num_tokens: int, now: float) -> None:
        """A chunk of ``num_tokens`` of the request was relayed at ``now``."""
        flight = self._flights.get(request_id)
        if flight is None or num_tokens <= 0:
            return
        model = self._model(flight.worker_id)
        if flight.last_at is None:
            # what it waited for: the prompts that began to stream since it was sent (cut
            # short, not what was queued then: requests ahead of it may have been cancelled)
            done = self._prefilled.get(flight.worker_id, 0) + flight.prefill_tokens
            self._prefilled[flight.worker_id] = done
            ttft = now - flight.dispatched_at
            model.add_ttft(ttft)
            self._model(flight.worker_id, self._prefill).add(done - flight.prefilled_before, ttft)
            self._unqueue(flight)
        else:
            k = self._inflight.get(flight.worker_id, 1)
            model.add(k, (now - flight.last_at) / num_tokens)
        flight.last_at = now

    def on_done(self, request_id: str) -> None:
        """The request finished, failed or was cancelled (idempotent)."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        if flight.last_at is None:
            self._unqueue(flight)
        left = self._inflight[flight.worker_id] - 1
        if left:
            self._inflight[flight.worker_id] = left
        else:
            del self._inflight[flight.worker_id]

    def _unqueue(self, flight: _Flight) -> None:
        """The flight's prefill is no longer queued on its worker (it streams, or ended)."""
        left = self._queued_prefill.get(flight.worker_id, 0) - flight.prefill_tokens
        if left > 0:
            self._queued_prefill[flight.worker_id] = left
        else:
            self._queued_prefill.pop(flight.worker_id, None)
        flight.prefill_tokens = 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker's models (a restarted worker is a new machine to learn)."""
        self._models.pop(worker_id, None)
        self._prefill.pop(worker_id, None)
        self._prefilled.pop(worker_id, None)

    def num_inflight(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)
