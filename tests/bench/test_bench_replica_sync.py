"""bench.bench_replica_sync: router processes syncing through the real Redis at 127.0.0.1:6379,
every pick counted at every peer; its options refused with the limit named."""

from __future__ import annotations

import json

import pytest

from bench import bench_replica_sync as bench


def test_every_pick_reaches_every_peer_through_redis(redis_url, tmp_path):
    out = tmp_path / "sync.json"
    argv = [
        "--redis-url",
        redis_url,
        "--routers",
        "3",
        "--workers",
        "4",
        "--duration-s",
        "0.6",
        "--rate",
        "50",
        "--burst",
        "7",
        "--burst-interval-s",
        "0.5",
        "--prompt-tokens",
        "64",
        "--first-token-s",
        "0.01",
        "--finish-s",
        "0.05",
        "--raw",
        "--raw-messages",
        "40",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    per_router = result["per_router"]
    assert [r["router"] for r in per_router] == [0, 1, 2]
    # a burst of 7 over 3 routers: shares 3, 2, 2, one burst in 0.6 s
    assert [r["sent"]["burst"] for r in per_router] == [3, 2, 2]
    steady = sum(r["sent"]["steady"] for r in per_router)
    assert steady >= 20  # 50/s for 0.6 s, each router its third
    # each pick is applied once at each of the two other routers
    assert result["peer_delay_steady"]["n"] == 2 * steady
    assert result["peer_delay_burst"]["n"] == 2 * 7
    for r in per_router:
        assert r["counters"]["gaps"] == 0
        assert r["counters"]["batches_malformed"] == 0
        assert r["echo_delay"]["n"] > 0  # its own batches came back: the auto window's input
    for q in (result["peer_delay_steady"], result["raw_pubsub"]):
        assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= q["max"]
    assert result["raw_pubsub"]["n"] == 40  # plain pub/sub: every message came


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routers", "1"], "--routers must be >= 2"),
        (["--raw-messages", "0"], "--raw-messages must be >= 1, got 0"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
        (["--burst", "-1"], "--burst and --rate must be >= 0"),
        (["--duration-s", "0"], "--duration-s and --burst-interval-s must be > 0"),
        (["--first-token-s", "2", "--finish-s", "1"], "need 0 <= --first-token-s <= --finish-s"),
    ],
)
def test_bad_options_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_redis_is_an_error_not_a_hang(capsys):
    # nothing listens on port 1 of the loopback: the routers cannot subscribe
    argv = ["--redis-url", "redis://127.0.0.1:1/0", "--duration-s", "0.2", "--rate", "10"]
    assert bench.main(argv) == 1
    assert "bench_replica_sync:" in capsys.readouterr().err
