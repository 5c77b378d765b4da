"""bench.trace_jitter: only output lengths move, by at most one token, reproducibly."""

from __future__ import annotations

import json

from bench.trace_jitter import jitter_lines, main


def _trace(n: int) -> list[str]:
    return [
        json.dumps(
            {"timestamp": i // 4, "input_length": 64, "output_length": 1 + i % 5, "hash_ids": [i]}
        )
        for i in range(n)
    ]


def test_only_output_lengths_move_by_at_most_one_and_never_below_one():
    lines = _trace(400)
    out = [json.loads(x) for x in jitter_lines(lines, seed=3)]
    src = [json.loads(x) for x in lines]
    moved = 0
    for a, b in zip(src, out, strict=True):
        assert {k: v for k, v in a.items() if k != "output_length"} == {
            k: v for k, v in b.items() if k != "output_length"
        }
        assert abs(b["output_length"] - a["output_length"]) <= 1
        assert b["output_length"] >= 1
        moved += b["output_length"] != a["output_length"]
    assert 150 < moved < 350  # about two in three move (one in five of the 1s cannot go down)


def test_a_seed_gives_one_copy_and_another_seed_another():
    lines = _trace(200)
    assert jitter_lines(lines, 1) == jitter_lines(lines, 1)
    assert jitter_lines(lines, 1) != jitter_lines(lines, 2)


def test_cli_writes_the_copy_and_refuses_a_line_without_output_length(tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(_trace(10)) + "\n")
    dst = tmp_path / "o.jsonl"
    assert main(["--trace", str(src), "--seed", "0", "-o", str(dst)]) == 0
    assert len(dst.read_text().splitlines()) == 10
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 4}) + "\n")
    assert main(["--trace", str(bad), "--seed", "0", "-o", str(dst)]) == 2
    assert "line 1: no output_length" in capsys.readouterr().err
