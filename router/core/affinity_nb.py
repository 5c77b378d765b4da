"""The cost's affinity term (router.core.policy) compiled: one numba call per route instead of a
dozen numpy calls on a few dozen candidates (~1 µs against 10-25 µs on the 2-core box).

Same answers as the numpy definition in tests/router/test_policy_affinity.py (checked
against each other on generated inputs): per candidate
below the deepest match (every candidate, when none matches), its rank among the
candidates of its depth by ``splitmix64(first block it lacks ^ worker id hash)``, highest
first, times ``tokens / (m - 1)``; in a group of more than RANKED_MAX, ``tokens`` times the
complement of the score's top 53 bits over 2**53 (no sort; the same spread on average).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.jit import jit as _jit

__all__ = ["RANKED_MAX", "affinity_into"]

_C0 = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TWO53 = float(2**53)
RANKED_MAX = 64  # larger groups: score-proportional terms (router.core.policy's docstring)


@_jit
def _mix(x: Any) -> Any:
    x = x + _C0
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


@_jit
def affinity_into(hashes: Any, depths: Any, ids: Any, tokens: float, out: Any) -> bool:
    """Write each candidate's affinity term into ``out`` (float64, one per candidate):
    ``hashes`` the request's block hashes (uint64), ``depths`` each candidate's matched
    blocks (intp), ``ids`` each candidate's worker id hash (uint64). Returns whether any
    term is not 0."""
    n = hashes.shape[0]
    m = depths.shape[0]
    out[:m] = 0.0
    if n == 0 or m < 2:
        return False
    deepest = min(depths.max(), n)  # past the request's blocks: it holds them all
    seen = np.zeros(m, dtype=np.bool_)
    members = np.empty(m, dtype=np.intp)
    scores = np.empty(m, dtype=np.uint64)
    ranked = False
    for i in range(m):
        d = depths[i]
        if seen[i] or (deepest > 0 and d >= deepest):
            continue
        key = hashes[d]
        g = 0
        for j in range(i, m):
            if depths[j] == d:
                seen[j] = True
                members[g] = j
                scores[g] = _mix(key ^ ids[j])
                g += 1
        if g < 2:
            continue
        if g > RANKED_MAX:  # the score's place in [0, 2**64) for its rank: no sort
            for t in range(g):
                out[members[t]] = tokens * float(~scores[t] >> _S11) / _TWO53
        else:
            order = np.argsort(scores[:g])
            for r in range(g):  # highest score first: rank 0
                out[members[order[g - 1 - r]]] = tokens * r / (g - 1)
        ranked = True
    return ranked
