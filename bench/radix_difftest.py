"""Differential test: our RadixCache against SGLang's own, op by op, on random traces.

    bench/peers/install_sglang.sh                                    # once: SGLang in .peers/
    python -m bench.radix_difftest --peer-python .peers/sglang-radix/bin/python --traces 400

Each trace (bench/radix_difftrace.py: insert / match / lock / unlock / evict k, sequences
sharing prefixes at several depths, page sizes 1 and 16 alternating) is generated here, sent
to the peer (bench/peers/sglang_difftest.py, SGLang's RadixCache run by the given python), and
replayed here on our RadixCache once per ``split_recency`` setting. Both sides observe through
the same replay code, so per op they report the same things: tokens matched (and whose KV
the matched slots hold), tokens already cached on insert, tokens freed and the nodes evicted,
evictable / protected / total tokens, and a digest of the whole tree after each eviction.

For each setting and trace the observations are compared in order up to the first op where
they differ (after it the two trees differ, so later ops prove nothing); that first
difference is classified as

    victims   an evict op whose difference is only which nodes went (and so, possibly, how
              many tokens that freed and the sizes after it); everything before it agreed
    other     anything else: a match length, an origin, a size after a non-evict op, ...

Expected: with "stamp" (SGLang's rule) every trace agrees to the end; with "keep" a trace
either agrees or first differs in eviction victims. Exit status 0 exactly then, and when
neither side's self-checks (slots in use = total = evictable + protected = the walked tree)
failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.radix_difftrace import DiffSpec, make_trace, replay
from worker.cache.allocator import SlotAllocator
from worker.cache.base import SPLIT_RECENCY, CacheConfig
from worker.cache.node import TreeNode
from worker.cache.radix_cache import RadixCache

_DEFAULTS = DiffSpec()
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "sglang_difftest.py"

FIELDS = ("n", "org", "ev", "pr", "tot", "vic", "tree", "nodes")
# What may differ at an evict op when only its victims differ: the nodes removed, the tree
# left, and the tokens freed with the sizes that follow from them.
VICTIM_FIELDS = frozenset({"vic", "tree", "n", "ev", "tot"})


class OurAdapter:
    """radix_difftrace.Adapter over our RadixCache (LRU) and SlotAllocator."""

    def __init__(self, page: int, pool: int, split_recency: str) -> None:
        self.now = 0
        self.alloc = SlotAllocator(pool)
        config = CacheConfig(page_size=page, split_recency=split_recency)
        self.cache = RadixCache(config, self.alloc, clock=lambda: self.now)
        self.root = self.cache.root

    def set_clock(self, now: int) -> None:
        self.now = now

    def insert(self, seq: list[int]) -> tuple[int, list[int]]:
        slots = self.alloc.alloc(len(seq))
        assert slots is not None, "pool too small"
        cached = self.cache.insert(np.asarray(seq, dtype=np.int64), slots)
        if cached:
            self.alloc.free(slots[:cached])  # the tree kept its own slots for these
        return cached, slots.tolist()

    def match(self, seq: list[int]) -> tuple[list[int], Any]:
        m = self.cache.match_prefix(np.asarray(seq, dtype=np.int64))
        return m.slots.tolist(), m.last_node

    def lock(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def evict(self, k: int) -> int:
        return self.cache.evict(k)

    def sizes(self) -> tuple[int, int, int, int]:
        c = self.cache
        return c.evictable_size(), c.protected_size(), c.total_size, self.alloc.num_allocated

    def children(self, node: TreeNode) -> list[TreeNode]:
        return list(node.children.values())

    def edge(self, node: TreeNode) -> bytes:
        return node.kb


def replay_ours(trace: dict[str, Any], split_recency: str) -> list[dict[str, Any]]:
    return replay(OurAdapter(trace["page"], trace["pool"], split_recency), trace)


class Peer:
    """The peer process: a hello line, then one trace per line written, one answer per line."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"difftest peer exited ({rc}) without an answer")
        return json.loads(line)

    def send(self, trace: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(trace, separators=(",", ":")) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> list[dict[str, Any]]:
        obs: list[dict[str, Any]] = self._read()
        return obs

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------- comparison


def first_difference(
    ours: list[dict[str, Any]], peer: list[dict[str, Any]]
) -> tuple[int, list[str]] | None:
    """(op index, differing fields) of the first op where the observations differ; None when
    they agree throughout."""
    for i, (a, b) in enumerate(zip(ours, peer, strict=False)):
        if a["op"] != b["op"]:
            return i, ["op"]
        diff = [f for f in FIELDS if a.get(f) != b.get(f)]
        if diff:
            return i, diff
    if len(ours) != len(peer):
        return min(len(ours), len(peer)), ["length"]
    return None


def classify(op: str, fields: list[str]) -> str:
    """ "victims" when an evict op differs only in what it evicted (and what follows from
    it), with "same freed" when the tokens freed still agree; else "op: fields"."""
    if op == "evict" and "vic" in fields and set(fields) <= VICTIM_FIELDS:
        return "victims, other tokens freed" if "n" in fields else "victims, same tokens freed"
    return f"{op}: {', '.join(fields)}"


def is_victims(kind: str) -> bool:
    return kind.startswith("victims")


def compare_trace(
    trace: dict[str, Any], ours: list[dict[str, Any]], peer: list[dict[str, Any]]
) -> dict[str, Any]:
    """One trace's verdict: the first difference (None = agree) and what agreed before it."""
    found = first_difference(ours, peer)
    upto = len(ours) if found is None else found[0]
    ops = Counter(o["op"] for o in ours[:upto])
    result: dict[str, Any] = {
        "id": trace["id"],
        "page": trace["page"],
        "kind": "agree",
        "matches_agreed": ops["match"] + ops["lock"],
        "inserts_agreed": ops["insert"],
        "evictions_agreed": ops["evict"],
        "sizes_agreed": upto - ops["end"],
    }
    if found is not None:
        i, fields = found
        a = ours[i] if i < len(ours) else {}
        b = peer[i] if i < len(peer) else {}
        op = a.get("op", "?")
        result["kind"] = classify(op, fields)
        result["at"] = {
            "op_index": i,
            "op": op,
            "fields": fields,
            "ours": {f: a.get(f) for f in fields},
            "peer": {f: b.get(f) for f in fields},
        }
    return result


def self_check_failures(obs: list[dict[str, Any]]) -> int:
    return sum(1 for o in obs if o.get("inv"))


def summarize(verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = Counter(v["kind"] for v in verdicts)
    by_page: dict[str, Counter[str]] = {}
    for v in verdicts:
        by_page.setdefault(str(v["page"]), Counter())[v["kind"]] += 1
    total = {
        key: sum(v[key] for v in verdicts)
        for key in ("matches_agreed", "inserts_agreed", "evictions_agreed", "sizes_agreed")
    }
    return {
        "traces": len(verdicts),
        "agree": kinds["agree"],
        "first_difference": {k: n for k, n in kinds.most_common() if k != "agree"},
        "by_page": {p: dict(c) for p, c in sorted(by_page.items(), key=lambda kv: int(kv[0]))},
        **total,
    }


def passed(report: dict[str, Any]) -> bool:
    """stamp: every trace agrees; keep: every difference is in eviction victims; no
    self-check failed on either side."""
    if any(report["self_check_failures"].values()):
        return False
    for mode, summary in report["modes"].items():
        kinds = summary["first_difference"]
        if mode == "stamp" and kinds:
            return False
        if not all(is_victims(k) for k in kinds):
            return False
    return True


def run(
    spec: DiffSpec,
    peer_cmd: list[str],
    modes: tuple[str, ...] = SPLIT_RECENCY,
    examples: int = 3,
) -> dict[str, Any]:
    """Replay every trace on the peer and on ours (each mode); the report as a dict."""
    peer = Peer(peer_cmd)
    verdicts: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    failures = {"ours": 0, "peer": 0}
    try:
        for index in range(spec.traces):
            trace = make_trace(spec, index)
            peer.send(trace)  # the peer replays while we do
            ours = {m: replay_ours(trace, m) for m in modes}
            theirs = peer.receive()
            failures["peer"] += self_check_failures(theirs)
            for m in modes:
                failures["ours"] += self_check_failures(ours[m])
                verdicts[m].append(compare_trace(trace, ours[m], theirs))
    finally:
        peer.close()
    return {
        "spec": {
            "traces": spec.traces,
            "ops": spec.ops,
            "pages": list(spec.pages),
            "vocab": spec.vocab,
            "seed": spec.seed,
        },
        "peer": peer.hello,
        "modes": {m: summarize(v) for m, v in verdicts.items()},
        "examples": {m: [v for v in verdicts[m] if v["kind"] != "agree"][:examples] for m in modes},
        "self_check_failures": failures,
    }


def format_report(report: dict[str, Any]) -> str:
    spec, hello = report["spec"], report["peer"]
    pages = ", ".join(str(p) for p in spec["pages"])
    lines = [
        f"radix cache differential test: {spec['traces']} traces x {spec['ops']} ops "
        f"(page sizes {pages}, vocab {spec['vocab']}, seed {spec['seed']}); peer "
        f"{hello.get('peer', '?')} {hello.get('version', '?')}, clock {hello.get('clock', '?')}",
        f"{'split_recency':<15}{'agree':>8}{'victims':>9}{'other':>7}"
        f"{'matches':>10}{'inserts':>9}{'evicts':>8}{'sizes':>8}   (agreed before any difference)",
    ]
    for mode, s in report["modes"].items():
        diffs = s["first_difference"]
        victims = sum(n for k, n in diffs.items() if is_victims(k))
        other = sum(n for k, n in diffs.items() if not is_victims(k))
        lines.append(
            f"{mode:<15}{s['agree']:>4}/{s['traces']:<3}{victims:>9}{other:>7}"
            f"{s['matches_agreed']:>10}{s['inserts_agreed']:>9}{s['evictions_agreed']:>8}"
            f"{s['sizes_agreed']:>8}"
        )
        for kind, n in diffs.items():
            lines.append(f"    first difference {kind}: {n}")
        for page, kinds in s["by_page"].items():
            shown = ", ".join(f"{k} {n}" for k, n in kinds.items())
            lines.append(f"    page {page}: {shown}")
    for mode, examples in report["examples"].items():
        for ex in examples:
            at = ex["at"]
            lines.append(
                f"{mode}: trace {ex['id']} (page {ex['page']}) op {at['op_index']} "
                f"({at['op']}): ours {at['ours']} / peer {at['peer']}"
            )
    failures = report["self_check_failures"]
    lines.append(f"self-check failures: ours {failures['ours']}, peer {failures['peer']}")
    lines.append("PASS" if passed(report) else "FAIL")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="radix_difftest", description="Our RadixCache vs SGLang's, op by op."
    )
    parser.add_argument(
        "--peer-python",
        required=True,
        metavar="PATH",
        help="python of the SGLang venv (bench/peers/install_sglang.sh)",
    )
    parser.add_argument(
        "--peer-script",
        default=str(PEER_SCRIPT),
        metavar="PATH",
        help="the peer it runs (default: bench/peers/sglang_difftest.py)",
    )
    parser.add_argument(
        "--peer-clock", choices=("op", "real"), default="op", help="see sglang_difftest.py"
    )
    parser.add_argument("--traces", type=int, default=_DEFAULTS.traces)
    parser.add_argument("--ops", type=int, default=_DEFAULTS.ops, help="ops per trace")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    parser.add_argument("--examples", type=int, default=3, help="differences shown per mode")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
    args = parser.parse_args(argv)
    if args.traces < 1 or args.ops < 1:
        parser.error("--traces and --ops must be >= 1")
    spec = DiffSpec(traces=args.traces, ops=args.ops, seed=args.seed)
    cmd = [args.peer_python, "-W", "ignore", args.peer_script, "--clock", args.peer_clock]
    report = run(spec, cmd, examples=args.examples)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
