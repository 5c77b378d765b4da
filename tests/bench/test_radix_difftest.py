"""The radix cache differential test's own logic: traces, replay observations, the comparison
and its verdicts, driven through a stand-in peer (difftest_fake_peer.py: our own RadixCache
behind the peer's line protocol), since SGLang is only ever installed in .peers/."""

import json
import sys
from pathlib import Path

from bench import radix_difftest
from bench.radix_difftest import (
    OurAdapter,
    classify,
    compare_trace,
    first_difference,
    passed,
    replay_ours,
    run,
)
from bench.radix_difftrace import EVICT_ALL, DiffSpec, make_trace, replay

FAKE_PEER = str(Path(__file__).resolve().parent / "difftest_fake_peer.py")
SMALL = DiffSpec(traces=6, ops=120)


def fake_peer(*args: str) -> list[str]:
    return [sys.executable, FAKE_PEER, *args]


def test_traces_are_deterministic_page_aligned_and_fit_their_pool():
    for i in range(4):
        trace = make_trace(SMALL, i)
        assert trace == make_trace(SMALL, i)
        assert trace["page"] == SMALL.pages[i % 2]
        inserts = [op[1] for op in trace["ops"] if op[0] == "insert"]
        assert inserts and all(len(s) > 0 and len(s) % trace["page"] == 0 for s in inserts)
        assert trace["pool"] > sum(len(s) for s in inserts)
        held = set()
        for op in trace["ops"]:  # every unlock names a lock that is held
            if op[0] == "lock":
                held.add(op[2])
            elif op[0] == "unlock":
                held.remove(op[1])
    assert make_trace(SMALL, 0) != make_trace(DiffSpec(seed=1), 0)


def test_replay_observes_matches_origins_sizes_and_victims():
    ops = [
        ["insert", [1, 2, 3]],
        ["insert", [1, 2, 4, 5]],
        ["lock", [1, 2, 4, 5, 9], 2],
        ["match", [1, 2, 3]],
        ["evict", EVICT_ALL],
        ["unlock", 2],
        ["evict", 1],
    ]
    obs = replay(OurAdapter(1, 16, "keep"), {"id": 0, "page": 1, "pool": 16, "ops": ops})
    assert [o["n"] for o in obs[:5]] == [0, 2, 4, 3, 1]
    assert [(o["ev"], o["pr"], o["tot"]) for o in obs[:7]] == [
        (3, 0, 3),
        (5, 0, 5),
        (1, 4, 5),  # [1,2] and [4,5] locked, [3] not
        (1, 4, 5),
        (0, 4, 4),  # evict everything: only the unlocked [3] goes
        (4, 0, 4),
        (2, 0, 2),  # [4,5], the only leaf, goes
    ]
    assert obs[4]["vic"] == [obs[4]["vic"][0]] and obs[4]["vic"][0].startswith("2+1:")
    assert obs[6]["vic"][0].startswith("2+2:")
    # [1,2,3] is served wholly from the first insert, [1,2,4,5] partly from the second:
    assert obs[2]["org"] != obs[3]["org"]
    assert obs[-1]["op"] == "end" and obs[-1]["nodes"] == 1
    assert not any("inv" in o for o in obs)


def test_split_recency_changes_only_which_leaf_goes():
    # [1,2] splits the [1,2,3,4] edge at t=3; "stamp" makes the unused [3,4] as recent as
    # [1,2], "keep" leaves it older than [7], so one evict(1) takes a different leaf.
    ops = [["insert", [1, 2, 3, 4]], ["insert", [7]], ["match", [1, 2]], ["evict", 1]]
    trace = {"id": 0, "page": 1, "pool": 8, "ops": ops}
    keep, stamp = replay_ours(trace, "keep"), replay_ours(trace, "stamp")
    assert keep[3]["vic"][0].startswith("2+2:") and stamp[3]["vic"][0].startswith("0+1:")
    assert first_difference(keep, stamp) == (3, ["n", "ev", "tot", "vic", "tree"])
    verdict = compare_trace(trace, keep, stamp)
    assert verdict["kind"] == "victims, other tokens freed"
    assert verdict["matches_agreed"] == 1 and verdict["sizes_agreed"] == 3


def test_classify_tells_victims_from_other_differences():
    assert classify("evict", ["vic", "tree"]) == "victims, same tokens freed"
    assert classify("evict", ["n", "ev", "tot", "vic", "tree"]) == "victims, other tokens freed"
    assert classify("evict", ["pr", "vic"]) == "evict: pr, vic"  # a protected size moved
    assert classify("evict", ["n"]) == "evict: n"  # freed differs, victims do not
    assert classify("match", ["n", "org"]) == "match: n, org"
    a = [{"op": "match", "n": 2}, {"op": "end", "tree": "x"}]
    assert first_difference(a, a) is None
    assert first_difference(a, [{"op": "match", "n": 3}, a[1]]) == (0, ["n"])
    assert first_difference(a, a[:1]) == (1, ["length"])


def test_stamp_agrees_with_a_stamp_peer_and_keep_differs_only_in_victims():
    report = run(SMALL, fake_peer("--split", "stamp"))
    stamp, keep = report["modes"]["stamp"], report["modes"]["keep"]
    assert stamp["agree"] == SMALL.traces and stamp["first_difference"] == {}
    assert stamp["sizes_agreed"] == SMALL.traces * SMALL.ops
    assert keep["agree"] < SMALL.traces
    assert all(kind.startswith("victims") for kind in keep["first_difference"])
    assert report["self_check_failures"] == {"ours": 0, "peer": 0}
    assert report["peer"]["peer"] == "fake" and passed(report)


def test_an_unexpected_difference_is_named_and_fails():
    report = run(SMALL, fake_peer("--split", "stamp", "--skew", "pr@7"))
    kinds = report["modes"]["stamp"]["first_difference"]
    ops7 = {make_trace(SMALL, i)["ops"][7][0] for i in range(SMALL.traces)}
    assert sum(kinds.values()) == SMALL.traces
    assert set(kinds) <= {classify(op, ["pr"]) for op in ops7}
    example = report["examples"]["stamp"][0]["at"]
    assert example["op_index"] == 7 and example["fields"] == ["pr"]
    assert example["peer"]["pr"] == example["ours"]["pr"] + 1
    assert not passed(report)


def test_a_keep_peer_fails_the_stamp_expectation():
    report = run(SMALL, fake_peer("--split", "keep"))
    assert report["modes"]["keep"]["agree"] == SMALL.traces
    assert report["modes"]["stamp"]["first_difference"]
    assert not passed(report)


def test_main_writes_the_report_and_exits_zero_on_agreement(tmp_path, capsys):
    out = tmp_path / "diff.json"
    argv = ["--peer-python", sys.executable, "--peer-script", FAKE_PEER]
    rc = radix_difftest.main([*argv, "--traces", "4", "--ops", "80", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["spec"]["traces"] == 4 and report["peer"]["clock"] == "op"
    assert report["modes"]["stamp"]["agree"] == 4
    text = capsys.readouterr().out
    assert "stamp" in text and text.rstrip().endswith("PASS")
