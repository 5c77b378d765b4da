"""Block hashing with and without a deployment key (``--hash-key``), A/B alternating.

The figure is bench_index's ``hash_seq_s`` (``block_hashes`` of a 2,000-token sequence at
B=16, sequences/s) plus an 8,192-token prompt (the route path's size), measured for the
unkeyed numpy closed form (A) and the keyed BLAKE2b chain (B) in alternating rounds, so
drift on a shared machine hits both alike; medians are reported::

    python -m bench.bench_hash_key [--rounds 7] [--json OUT]

Results (command, date, machine, numbers) go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvroute_proto.hashing import block_hashes, set_hash_key

KEY = b"bench-deployment-secret"


def _rate(seq: np.ndarray, block_size: int, n: int, repeats: int = 3) -> float:
    """Sequences per second, best of ``repeats`` runs of ``n``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            block_hashes(seq, block_size)
        best = min(best, time.perf_counter() - t0)
    return n / best


def run(rounds: int, *, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    cases = {
        "2000": (rng.integers(0, 32_000, 2000).tolist(), 2000),
        "8192": (rng.integers(0, 32_000, 8192).tolist(), 500),
    }
    samples: dict[str, list[float]] = {f"{c}_{m}": [] for c in cases for m in ("unkeyed", "keyed")}
    try:
        for _ in range(rounds):
            for mode, key in (("unkeyed", None), ("keyed", KEY)):
                set_hash_key(key)
                for name, (seq, n) in cases.items():
                    samples[f"{name}_{mode}"].append(_rate(np.asarray(seq), 16, n))
    finally:
        set_hash_key(None)
    out = {f"hash_seq_s_{k}": statistics.median(v) for k, v in samples.items()}
    for name in cases:
        out[f"slowdown_{name}"] = (
            out[f"hash_seq_s_{name}_unkeyed"] / out[f"hash_seq_s_{name}_keyed"]
        )
        out[f"us_per_seq_{name}_keyed"] = 1e6 / out[f"hash_seq_s_{name}_keyed"]
        out[f"us_per_seq_{name}_unkeyed"] = 1e6 / out[f"hash_seq_s_{name}_unkeyed"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="block hashing with vs without --hash-key (A/B)")
    p.add_argument("--rounds", type=int, default=7, help="A/B rounds (default 7)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    results = run(args.rounds)
    for k, v in results.items():
        print(f"{k:<32} {v:,.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
