"""The radix cache benchmark: runs (--quick), writes the documented JSON, builds its traces
deterministically, and merges a peer's figures (a stand-in peer here: SGLang is only ever
installed in .peers/, never in the test environment)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import bench_radix_cache
from bench.radix_trace import (
    QUICK,
    TraceSpec,
    make_trace,
    make_tree_trace,
    metric_keys,
    trace_digest,
)

REPO = Path(__file__).resolve().parents[2]


def test_full_spec_names_every_eviction_figure_per_call():
    assert metric_keys(TraceSpec()) == (
        "insert_seq_s",
        "match_full_q_s",
        "match_split_q_s",
        "insert_events_seq_s",
        "evict_us_per_call_flat_10k",
        "evict_us_per_call_flat_100k",
        "evict_us_per_call_flat_1000k",
        "evict_us_per_call_tree_k16",
        "evict_us_per_call_tree_k256",
        "evict_us_per_call_tree_k4096",
    )


def test_quick_run_writes_the_documented_keys(tmp_path, capsys):
    out = tmp_path / "radix.json"
    assert bench_radix_cache.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"kvroute", "tree_freed_tokens_per_call", "rounds"}
    ours = report["kvroute"]
    assert tuple(ours) == metric_keys(QUICK)
    assert "evict_us_per_call_flat_1k" in ours and "evict_us_per_call_tree_k4096" in ours
    assert all(isinstance(v, float) and v > 0 for v in ours.values())
    # Every tree eviction call freed at least the k it asked for.
    freed = report["tree_freed_tokens_per_call"]["kvroute"]
    assert set(freed) == {"k16", "k256", "k4096"}
    assert all(freed[f"k{k}"] >= k for k in QUICK.tree_evict_k)
    table = capsys.readouterr().out
    assert "insert_seq_s" in table and "SGLang" not in table


def test_traces_are_deterministic_and_shaped_as_documented():
    assert np.array_equal(make_trace(QUICK), make_trace(QUICK))
    assert trace_digest(QUICK) == trace_digest(QUICK)
    assert trace_digest(QUICK) != trace_digest(TraceSpec(num_seqs=201, rounds=1))
    a, b = make_tree_trace(QUICK), make_tree_trace(QUICK)
    assert a.locked == b.locked
    assert all(np.array_equal(x, y) for x, y in zip(a.seqs, b.seqs, strict=True))

    tree = a
    assert tree.num_convs == QUICK.tree_tenants * QUICK.tree_prompts * QUICK.tree_convs
    # Locked: the latest turn of tree_locked distinct conversations, the most recent ones.
    assert len(tree.locked) == QUICK.tree_locked
    assert tree.locked == sorted(tree.locked) and tree.locked[-1] == len(tree.seqs) - 1
    # Several depths: sequences share tenant prefixes, system prompts and earlier turns.
    firsts = {int(s[0]) for s in tree.seqs}
    assert len(firsts) == QUICK.tree_tenants
    lengths = [len(s) for s in tree.seqs]
    assert min(lengths) < max(lengths) // 2  # varied lengths
    extended = sum(
        1
        for i, s in enumerate(tree.seqs)
        for t in tree.seqs[:i]
        if len(t) < len(s) and np.array_equal(s[: len(t)], t)
    )
    assert extended > 0  # later turns extend earlier ones
    assert tree.pool_slots >= tree.num_tokens


def test_the_realistic_tree_evicts_at_least_k_per_call_around_locked_paths():
    tree = make_tree_trace(QUICK)
    cache = bench_radix_cache.build_tree(tree)
    protected = cache.protected_size()
    assert protected > 0
    for k in QUICK.tree_evict_k:
        assert cache.evict(k) >= k
    assert cache.protected_size() == protected  # running requests' paths never evicted
    for i in tree.locked:
        assert cache.match_prefix(tree.seqs[i]).num_matched == len(tree.seqs[i])
    cache.check_invariants()


def _fake_peer(tmp_path: Path, digest: str) -> Path:
    """An executable that speaks the peer protocol (as bench/peers/sglang_radix.py --serve
    does): a hello line, then every metric = 2.0 per round."""
    script = tmp_path / "fake_python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from bench.radix_trace import QUICK, metric_keys\n"
        "assert '--serve' in sys.argv and '--quick' in sys.argv, sys.argv\n"
        f"print(json.dumps({{'trace_digest': {digest!r}, 'version': 'fake'}}), flush=True)\n"
        "for _ in sys.stdin:\n"
        "    out = {k: 2.0 for k in metric_keys(QUICK)}\n"
        "    out['freed_per_call'] = {'k16': 100.0}\n"
        "    print(json.dumps(out), flush=True)\n"
    )
    script.chmod(0o755)
    return script


def test_peer_figures_are_merged_with_ratios(tmp_path, capsys):
    peer = _fake_peer(tmp_path, trace_digest(QUICK))
    out = tmp_path / "radix.json"
    argv = ["--quick", "--rounds", "2", "--peer-python", str(peer), "--json", str(out)]
    assert bench_radix_cache.main(argv) == 0
    report = json.loads(out.read_text())
    keys = metric_keys(QUICK)
    assert report["sglang"] == dict.fromkeys(keys, 2.0)
    assert report["sglang_version"] == "fake"
    assert report["rounds"] == 2
    for key in keys:
        assert report["ours_over_sglang"][key] == pytest.approx(report["kvroute"][key] / 2.0)
    assert report["tree_freed_tokens_per_call"]["sglang"] == {"k16": 100.0}
    table = capsys.readouterr().out
    assert "SGLang" in table and "ours/SGLang" in table


def test_a_peer_on_another_trace_is_refused(tmp_path):
    peer = _fake_peer(tmp_path, "0000000000000000")
    with pytest.raises(RuntimeError, match="another trace"):
        bench_radix_cache.main(["--quick", "--peer-python", str(peer)])
