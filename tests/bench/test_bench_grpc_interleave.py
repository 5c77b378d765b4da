"""bench.bench_grpc_interleave: a grpc.aio server and a subscription through the real Redis at
127.0.0.1:6379; every call and every batch is logged once, in the order the loop ran them."""

from __future__ import annotations

import json

import pytest

from bench import bench_grpc_interleave as bench


def test_every_call_and_batch_is_logged_in_the_order_run(redis_url, tmp_path, capsys):
    out = tmp_path / "il.json"
    argv = ["--redis-url", redis_url, "--calls", "8", "--messages", "20", "--gap-us", "200"]
    assert bench.main([*argv, "--block-ms", "10", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    order = result["order"]
    assert (result["routed"], result["applied"]) == (8, 20)
    assert sorted(order) == ["R"] * 8 + ["a"] * 20 and order[0] == "R"
    first, last = order.index("R"), order.rindex("R")
    assert result["applied_between_routes"] == order[first:last].count("a")
    assert 0 <= result["route_gaps_with_a_batch"] <= 7
    printed = capsys.readouterr().out
    assert printed.startswith(order) and "8 calls routed, 20 batches applied" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--calls", "1"], "--calls must be >= 2"), (["--gap-us", "-1"], "must be >= 0")],
)
def test_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
