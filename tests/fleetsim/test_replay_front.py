"""--front parsing, expansion, peer command lines, and the replay CLI's errors for them."""

from __future__ import annotations

import itertools

import pytest

from fleetsim.replay.cli import available_policies, main
from fleetsim.replay.front import (
    KVROUTE,
    SGLANG_ROUTER,
    URL,
    VLLM_ROUTER,
    FrontSpec,
    FrontSpecError,
    KvEventSource,
    expand_fronts,
    parse_front,
    peer_command,
)
from fleetsim.replay.trace import write_trace
from fleetsim.workload import SupportAgentConfig, generate_support_agent

POLICIES = ("cache_aware", "round_robin", "least_load")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("kvroute", FrontSpec(KVROUTE)),
        ("kvroute:round_robin", FrontSpec(KVROUTE, "round_robin")),
        ("sglang-router", FrontSpec(SGLANG_ROUTER, "cache_aware")),
        ("sglang-router:power_of_two", FrontSpec(SGLANG_ROUTER, "power_of_two")),
        ("vllm-router", FrontSpec(VLLM_ROUTER, "cache_aware")),
        ("vllm-router:consistent_hash", FrontSpec(VLLM_ROUTER, "consistent_hash")),
        ("http://127.0.0.1:8000/", FrontSpec(URL, url="http://127.0.0.1:8000")),
        (" https://gw.example:443 ", FrontSpec(URL, url="https://gw.example:443")),
    ],
)
def test_parse_front(value, expected):
    assert parse_front(value, POLICIES) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "must not be empty"),
        ("nginx", "is not one of kvroute\\[:POLICY\\], sglang-router"),
        ("kvroute:fastest", "kvroute policy 'fastest' is not one of cache_aware, round_robin"),
        ("sglang-router:consistent_hash", "sglang-router policy 'consistent_hash' is not one"),
        ("sglang-router:manual", "manual routes by a per-request header"),
        ("vllm-router:bogus", "vllm-router policy 'bogus' is not one of cache_aware"),
        ("ftp://127.0.0.1:21", "a URL must be http\\(s\\)://HOST\\[:PORT\\]"),
        ("http://:8000", "a URL must be http"),
        ("http://127.0.0.1:99999", "Port out of range"),
    ],
)
def test_bad_front_names_what_is_wrong(value, message):
    with pytest.raises(FrontSpecError, match=message):
        parse_front(value, POLICIES)


def test_labels():
    assert parse_front("sglang-router").label == "sglang-router:cache_aware"
    assert parse_front("kvroute:least_load").label == "kvroute:least_load"
    assert parse_front("http://h:1").label == "http://h:1"
    assert not parse_front("http://h:1").starts_fleet and parse_front("kvroute").starts_fleet


def test_a_bare_kvroute_front_runs_every_policy_and_duplicates_go():
    specs = [parse_front(v, POLICIES) for v in ("kvroute", "sglang-router", "kvroute:round_robin")]
    assert [s.label for s in expand_fronts(specs, ["cache_aware", "round_robin"])] == [
        "kvroute:cache_aware",
        "kvroute:round_robin",
        "sglang-router:cache_aware",
    ]


def test_peer_command_binds_loopback_only(tmp_path):
    python = tmp_path / "sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    argv = peer_command(
        parse_front("sglang-router"),
        port=30000,
        metrics_port=29000,
        worker_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        peers_dir=tmp_path,
    )
    assert argv[:3] == [str(python), "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "30000"
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_vllm_router_kv_aware_reads_each_workers_zmq_events(tmp_path):
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").touch()
    spec = parse_front("vllm-router:kv_aware")
    assert spec.reads_zmq_events and not parse_front("vllm-router").reads_zmq_events
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sources = [
        KvEventSource(u, f"tcp://127.0.0.1:1{i}", f"tcp://127.0.0.1:2{i}")
        for i, u in enumerate(urls)
    ]
    argv = peer_command(
        spec, port=3, metrics_port=4, worker_urls=urls, peers_dir=tmp_path,
        kv_events=sources, block_size=32, model="m",
    )  # fmt: skip
    pairs = list(itertools.pairwise(argv))
    assert ("--kv-event-source", "http://127.0.0.1:1=tcp://127.0.0.1:10") in pairs
    assert ("--kv-event-source", "http://127.0.0.1:2=tcp://127.0.0.1:11") in pairs
    assert ("--kv-event-replay-source", "http://127.0.0.1:2=tcp://127.0.0.1:21") in pairs
    assert ("--kv-event-block-size", "32") in pairs and ("--kv-event-model", "m") in pairs
    plain = peer_command(parse_front("vllm-router"), port=3, metrics_port=4, worker_urls=urls,
                         peers_dir=tmp_path)  # fmt: skip
    assert not any(a.startswith("--kv-event") for a in plain)


def test_a_missing_peer_venv_says_how_to_make_it(tmp_path):
    with pytest.raises(FrontSpecError, match=r"vllm-router is not installed.*install_peers\.sh"):
        peer_command(
            parse_front("vllm-router"),
            port=1,
            metrics_port=2,
            worker_urls=["http://127.0.0.1:3"],
            peers_dir=tmp_path,
        )
    with pytest.raises(FrontSpecError, match="is not a peer router"):
        peer_command(FrontSpec(KVROUTE, "cache_aware"), port=1, metrics_port=2, worker_urls=[])


@pytest.fixture
def trace(tmp_path):
    records = generate_support_agent(
        SupportAgentConfig(rate_rps=5.0, duration_s=1.0, num_conversations=2, seed=1)
    )
    path = tmp_path / "sa.jsonl"
    write_trace(path, records)
    return str(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--front", "kvroute"], "--front needs --mode live"),
        (["--mode", "live", "--front", "haproxy"], "--front 'haproxy' is not one of"),
        (["--mode", "live", "--peers-dir", "/x"], "only apply with --front"),
        (["--mode", "live", "--model", "m"], "only apply with --front"),
        (["--mode", "live", "--requests-dir", "d"], "only apply with --front"),
    ],
)
def test_cli_refuses_bad_fronts_before_any_work(trace, capsys, extra, message):
    assert main(["--trace", trace, "--trace-block-size", "16", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_kvroute_front_policies_come_from_the_registry(trace, capsys):
    bad = ["--trace", trace, "--mode", "live", "--front", "kvroute:nope"]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in available_policies())
