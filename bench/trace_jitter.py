"""A copy of a trace with every request's output length moved by at most one token.

``python -m bench.trace_jitter --trace in.jsonl --seed K -o out.jsonl`` writes the trace
with each ``output_length`` changed by -1, 0 or +1 (seeded; never below 1) and nothing
else: the same arrivals, prompts, prefixes and bursts. A routing comparison that flips
when the workload changes this little is inside the noise of one run; replaying K such
copies measures that floor (decision 0023).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def jitter_lines(lines: list[str], seed: int) -> list[str]:
    """The trace's JSON lines with each output length moved by -1, 0 or +1."""
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    steps = np.random.default_rng(seed).integers(-1, 2, size=len(numbered))
    out = []
    for (n, line), step in zip(numbered, steps, strict=True):
        record = json.loads(line)
        if "output_length" not in record:
            raise ValueError(f"line {n}: no output_length")
        record["output_length"] = max(1, int(record["output_length"]) + int(step))
        out.append(json.dumps(record))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trace_jitter", description=__doc__)
    p.add_argument("--trace", required=True, help="a JSON-lines trace (kvroute workload)")
    p.add_argument("--seed", type=int, required=True, help="which copy (any integer)")
    p.add_argument("-o", "--output", required=True, help="where to write the copy")
    args = p.parse_args(argv)
    with open(args.trace, encoding="utf-8") as f:
        lines = f.readlines()
    try:
        out = jitter_lines(lines, args.seed)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"trace_jitter: {args.trace}: {exc}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {len(out)} requests to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
