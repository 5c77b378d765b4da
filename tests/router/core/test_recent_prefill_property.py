"""Property: the core's decayed recent-prefill sums match a direct model.

The core stores each worker's sum scaled by exp((t - t0) / window) and rebases t0 when the
scale grows large; the model keeps every (time, tokens) pair and decays them directly. Gaps
of hours force rebases and underflow; the two must agree on every worker at every step.
"""

from __future__ import annotations

import math
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.router_core import RouterConfig, RouterCore, RouteRequest

WINDOW_S = 10.0
B = 16

steps = st.lists(
    st.tuples(
        st.one_of(
            st.floats(0.0, 30.0),  # ordinary spacing
            st.floats(2_000.0, 40_000.0),  # idle gaps: rebase (x > 230) and underflow
        ),
        st.integers(1, 400),  # prompt tokens (unique content: nothing ever matches)
        st.booleans(),  # explain instead of route
    ),
    min_size=1,
    max_size=40,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=200, deadline=None)
@given(steps)
def test_recent_prefill_matches_a_direct_decay_model(script) -> None:
    clock = Clock()
    core = RouterCore(
        RouterConfig(policy="round_robin", recent_window_s=WINDOW_S),
        clock=clock,
        rng=random.Random(0),
    )
    workers = ["w0", "w1", "w2"]
    for w in workers:
        core.add_worker(w, block_size=B)
    routed: dict[str, list[tuple[float, int]]] = {w: [] for w in workers}
    next_token = 0
    for i, (dt, n, explain_only) in enumerate(script):
        clock.now += dt
        prompt = np.arange(next_token, next_token + n, dtype=np.uint32)
        next_token += n
        if explain_only:
            e = core.explain(RouteRequest("probe", prompt))
            for score in e.workers:
                want = sum(
                    k * math.exp(-(clock.now - t) / WINDOW_S) for t, k in routed[score.worker_id]
                )
                assert math.isfinite(score.recent_prefill_tokens)
                assert math.isclose(score.recent_prefill_tokens, want, rel_tol=1e-9, abs_tol=1e-9)
        else:
            d = core.route(RouteRequest(f"r{i}", prompt))
            assert d.matched_tokens == 0
            routed[d.worker_id].append((clock.now, n))
            core.on_finished(f"r{i}")
