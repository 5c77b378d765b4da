"""A stand-in for bench/peers/sglang_difftest.py in the difftest's own tests (SGLang is never
installed in the test environment): the same line protocol, answered by our own RadixCache.

    python tests/bench/difftest_fake_peer.py [--split keep|stamp] [--skew FIELD@OP] [--clock X]

``--skew pr@5`` adds 1 to field ``pr`` of op 5's observation in every trace, so a test can
check that the comparison catches and names a difference it did not expect. ``--clock`` is
accepted and ignored (radix_difftest passes it to every peer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.radix_difftest import replay_ours


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", default="stamp")
    parser.add_argument("--skew", help="FIELD@OP: add 1 to that observation")
    parser.add_argument("--clock")
    args = parser.parse_args()
    print(json.dumps({"peer": "fake", "version": "0", "clock": args.clock}), flush=True)
    for line in sys.stdin:
        obs = replay_ours(json.loads(line), args.split)
        if args.skew:
            field, at = args.skew.split("@")
            obs[int(at)][field] += 1
        print(json.dumps(obs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
