"""Command-line parsing of `kvroute router`, `kvroute up`, `generate`/`explain`, and import
hygiene (the router never imports torch or the worker package)."""

from __future__ import annotations

import sys

import pytest

from router.cli import client, fleet
from router.cli import router as cli
from router.core.core_types import DEFAULT_RECENT_DECODE_RATIO, DEFAULT_RECENT_WINDOW_S
from router.core.policy import (
    DEFAULT_BACKLOG_TOKENS,
    DEFAULT_SATURATED_SCALE_TOKENS,
    DEFAULT_SATURATED_TOKENS,
    CostWeights,
)
from router.core.pools import PoolsConfig
from router.service.tenancy import TenancyConfig


def test_router_flags_map_to_the_config():
    args = cli.build_parser().parse_args(
        [
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--worker",
            "10.0.0.1:7001",
            "--worker",
            "10.0.0.2:7001",
            "--redis-url",
            "redis://r:6379/0",
            "--policy",
            "least_load",
            "--block-size",
            "32",
            "--max-inflight",
            "7",
            "--max-deadline-s",
            "12.5",
            "--tenant-header",
            "X-Org",
            "--tenant-salt-secret",
            "s",
            "--purge-after-s",
            "3",
            "--seed",
            "4",
            "--cost-weights",
            "1,0.5,8",
            "--recent-window-s",
            "12",
            "--backlog-tokens",
            "0",
            "--saturated-tokens",
            "4000",
            "--saturated-scale-tokens",
            "0",
            "--recent-decode-ratio",
            "0.25",
        ]
    )
    config = cli.config_from_args(args)
    assert (config.host, config.port) == ("0.0.0.0", 0)
    assert config.workers == ("10.0.0.1:7001", "10.0.0.2:7001")
    assert config.registry.redis_url == "redis://r:6379/0"
    assert (config.core.policy, config.core.block_size) == ("least_load", 32)
    assert (config.service.max_inflight, config.service.max_deadline_s) == (7, 12.5)
    assert config.service.tenancy == TenancyConfig("x-org", b"s", False)
    assert config.connection.purge_after_s == 3
    assert config.seed == 4
    assert config.core.policy_config.weights == CostWeights(
        1.0, 0.5, 8.0
    )  # RECENT keeps its default
    assert config.core.recent_window_s == 12.0
    assert config.core.policy_config.backlog_tokens == 0.0  # the backlog factor turned off
    assert (
        config.core.policy_config.saturated_tokens,
        config.core.policy_config.saturated_scale_tokens,
    ) == (4000.0, 0.0)
    assert config.core.recent_decode_ratio == 0.25


def test_served_models_name_the_pools():
    """--model / --served-model-name repeat, one pool each (decision 0036); one of them is
    the single-model router of before; neither: pools from what workers announce."""

    def pools(*flags: str):
        return cli.config_from_args(cli.build_parser().parse_args(["--worker", "h:1", *flags]))

    assert pools().pools is None and pools().pools_config() == PoolsConfig(("kvroute-tiny",), True)
    one = pools("--served-model-name", "m")
    assert one.pools == PoolsConfig(("m",)) and one.service.model_name == "m"
    two = pools("--served-model-name", "a", "--served-model-name", "b")
    assert two.pools == PoolsConfig(("a", "b")) and two.service.model_name == "a"
    dirs = pools("--model", "/x/llama-8b", "--model", "/y/llama-70b")
    assert dirs.pools == PoolsConfig(("llama-8b", "llama-70b"))
    with pytest.raises(ValueError, match="got 2 --model and 1 --served-model-name"):
        pools("--model", "/x/a", "--model", "/y/b", "--served-model-name", "n")
    with pytest.raises(ValueError, match="served model names must differ, got m, m"):
        pools("--model", "/x/m", "--model", "/y/m")


def test_router_defaults():
    config = cli.config_from_args(cli.build_parser().parse_args(["--worker", "h:1"]))
    assert config.core.policy == "cache_aware" and config.port == 50051
    assert config.service.tenancy == TenancyConfig()
    assert config.core.policy_config.weights == CostWeights()
    assert config.core.recent_window_s == DEFAULT_RECENT_WINDOW_S
    assert config.core.policy_config.backlog_tokens == DEFAULT_BACKLOG_TOKENS
    assert config.core.policy_config.saturated_tokens == DEFAULT_SATURATED_TOKENS == 10_000
    assert (
        config.core.policy_config.saturated_scale_tokens == DEFAULT_SATURATED_SCALE_TOKENS == 2_000
    )
    assert config.core.recent_decode_ratio == DEFAULT_RECENT_DECODE_RATIO
    assert config.service.split_prompts  # text prompts tokenized as far as a cache matches
    whole = cli.build_parser().parse_args(["--worker", "h:1", "--tokenize-whole"])
    assert not cli.config_from_args(whole).service.split_prompts


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--cost-weights", "1,2", "--cost-weights: cost weights must be three to seven numbers"),
        ("--cost-weights", "1,x,3", "--cost-weights: cost weights must be three to seven"),
        ("--cost-weights", "1,-1,3", "CostWeights.queued_prefill must be >= 0, got -1.0"),
        ("--recent-window-s", "0", "recent_window_s must be > 0, got 0.0"),
        ("--backlog-tokens", "-5", "backlog_tokens must be >= 0, got -5.0"),
        ("--backlog-tokens", "nan", "backlog_tokens must be >= 0, got nan"),
        ("--saturated-tokens", "-1", "saturated_tokens must be finite and >= 0, got -1.0"),
        ("--saturated-scale-tokens", "inf", "saturated_scale_tokens must be finite and >= 0"),
        ("--recent-decode-ratio", "-1", "recent_decode_ratio must be >= 0, got -1.0"),
        ("--registry-grace-s", "-1", "(--registry-grace-s) must be >= 0, got -1.0"),
        ("--admission-window", "0", "(--admission-window) must be >= 1, got 0"),
        ("--replicas", "0", "replicas must be >= 1, got 0"),
        ("--replica-cold-picks", "0.5", "replica_cold_picks must be finite and >= 1, got 0.5"),
        ("--replica-cold-window-picks", "-1", "replica_cold_window_picks must be >= 0, got -1"),
        (
            "--replica-affinity-tokens",
            "-1",
            "replica_affinity_tokens must be finite and >= 0 or None, got -1.0",
        ),
        ("--redis-poll-s", "0", "(--redis-poll-s) must be > 0, got 0.0"),
    ],
)
def test_bad_cost_settings_are_usage_errors(flag, value, message, capsys):
    assert cli.main(["--worker", "h:1", flag, value]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nohost", "h:0", "h:70000", ":1", "h:x"])
def test_bad_worker_address_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["--worker", bad])
    assert exc.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_replica_sync_maps_to_the_config(capsys):
    args = cli.build_parser().parse_args(["--redis-url", "redis://r:6379/0", "--replica-sync"])
    assert cli.config_from_args(args).registry.replica_sync
    assert cli.config_from_args(args).core.replica.sync
    assert cli.config_from_args(args).core.replica.sync_window_s is None  # auto: measured
    window = cli.build_parser().parse_args(
        ["--redis-url", "redis://r:6379/0", "--replica-sync", "--replica-sync-window-s", "0.02"]
    )
    assert cli.config_from_args(window).core.replica.sync_window_s == 0.02
    for value, expected in (("auto", None), ("inf", float("inf")), ("0", 0.0)):
        parsed = cli.build_parser().parse_args(["--replica-sync-window-s", value])
        assert parsed.replica_sync_window_s == expected
    for bad, message in (("-1", "must be auto or >= 0, got -1"), ("x", "got 'x'")):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(["--replica-sync-window-s", bad])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert not cli.config_from_args(
        cli.build_parser().parse_args(["--worker", "h:1"])
    ).registry.replica_sync
    assert cli.main(["--worker", "h:1", "--replica-sync"]) == 2
    assert "--replica-sync needs --redis-url" in capsys.readouterr().err


def test_router_needs_a_worker_or_redis(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "worker source is required" in err and "--worker" in err and "--redis-url" in err


@pytest.mark.parametrize(
    "main", [cli.main, fleet.main, client.main, client.explain_main], ids=lambda f: f.__module__
)
def test_every_command_has_help(main, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_up_validates_flags(capsys):
    assert fleet.main(["--exit"]) == 2
    assert "--exit needs --demo" in capsys.readouterr().err
    assert fleet.main(["--workers", "0"]) == 2
    assert "--workers must be in 1..64" in capsys.readouterr().err


def test_up_worker_command_line():
    config = fleet.FleetConfig(num_workers=1, executor="sim", worker_args=("--kv-slots=64",))
    cmd = fleet.worker_command(config, "worker-0")
    assert cmd[:4] == [sys.executable, "-m", "kvroute_cli", "worker"]
    assert cmd[cmd.index("--port") + 1] == "0"
    assert cmd[cmd.index("--worker-id") + 1] == "worker-0"
    assert cmd[cmd.index("--executor") + 1] == "sim"
    assert cmd[-1] == "--kv-slots=64"


def test_format_explain_marks_the_pick():
    result = client.ExplainResult(
        "cache_aware",
        8,
        "w1",
        (
            client.WorkerScoreView("w0", "h:1", True, 0, 0, 8.0, 0, 0, 1234.4),
            client.WorkerScoreView("w1", "h:2", True, 8, 0, 0.0, 1, 0),
        ),
    )
    lines = client.format_explain(result).splitlines()
    assert lines[0] == "policy=cache_aware prompt_tokens=8 chosen=w1"
    assert lines[1].split()[-4:] == ["slotq", "recent", "cost", "why-not"]
    assert lines[2].startswith("  w0") and lines[3].startswith("* w1")
    assert lines[2].split()[-2:] == ["1234", "8"]


def test_token_id_prompts_are_parsed():
    args = client._common_parser("p", "d").parse_args(["--token-ids", "1, 2,3"])
    assert client._parse_prompt(args) == [1, 2, 3]
    args = client._common_parser("p", "d").parse_args(["--token-ids", "1,x"])
    with pytest.raises(SystemExit, match="comma-separated ints"):
        client._parse_prompt(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-new-tokens", "-5", "x"], "--max-new-tokens must be in 1..4294967295, got -5"),
        (["--max-new-tokens", "1e3", "x"], "--max-new-tokens must be an integer, got '1e3'"),
        (["--seed", "-1", "x"], "--seed must be in 0..18446744073709551615, got -1"),
        (["--timeout", "0", "x"], "--timeout must be a finite number > 0, got 0"),
        (["--timeout", "nan", "x"], "--timeout must be a finite number > 0, got nan"),
        (["--temperature", "-1", "x"], "--temperature must be a finite number >= 0, got -1"),
        (["--token-ids", "--", "-3,2"], "every id must be in 0..4294967295, got -3"),
        (["--token-ids", "--", "4294967296"], "every id must be in 0..4294967295, got 4294967296"),
        (["--token-ids", ","], "every id must be in 0..4294967295, got no ids"),
    ],
)
def test_generate_rejects_bad_numbers_with_one_line(argv, message, capsys):
    """Out-of-range numbers are usage errors on one line, never a traceback; nothing is
    sent (the router address is unreachable: a send would fail differently)."""
    with pytest.raises(SystemExit) as exc:
        client.main(["--router", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err + str(exc.value.code)
    assert message in err
    assert "Traceback" not in err and "UNAVAILABLE" not in err


@pytest.mark.parametrize("port", ["-5", "70000"])
def test_a_bad_router_port_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--worker", "h:1", "--port", port])
    assert exc.value.code == 2
    assert "argument --port: must be in 0..65535" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_replay_speedup_must_be_positive(value, capsys):
    from fleetsim.replay import cli as replay_cli

    with pytest.raises(SystemExit) as exc:
        replay_cli.main(["--trace", "bench/data/mooncake_sample.jsonl", "--speedup", value])
    assert exc.value.code == 2
    assert "argument --speedup: must be a finite number > 0" in capsys.readouterr().err


def test_replicas_reach_the_core_config():
    args = cli.build_parser().parse_args(["--worker", "h:1", "--replicas", "3"])
    assert cli.config_from_args(args).core.replica.count == 3
    args = cli.build_parser().parse_args(["--worker", "h:1"])
    assert cli.config_from_args(args).core.replica.count == 1
    assert cli.config_from_args(args).core.replica.cold_picks == 2.0
    args = cli.build_parser().parse_args(["--worker", "h:1", "--replica-cold-picks", "4"])
    assert cli.config_from_args(args).core.replica.cold_picks == 4.0
    core = cli.config_from_args(cli.build_parser().parse_args(["--worker", "h:1"])).core
    assert core.replica.peer_view is True and core.replica.cold_window_picks == 3
    off = ["--worker", "h:1", "--no-replica-peer-view", "--replica-cold-window-picks", "0"]
    core = cli.config_from_args(cli.build_parser().parse_args(off)).core
    assert core.replica.peer_view is False and core.replica.cold_window_picks == 0


def test_replica_affinity_is_on_without_sync():
    """--replicas R alone turns the cost's affinity term on (the replicas cannot see each
    other's picks); --replica-sync turns it off; --replica-affinity-tokens sets it."""
    parse = cli.build_parser().parse_args
    core = cli.config_from_args(parse(["--worker", "h:1", "--replicas", "3"])).core
    assert core.replica.sync is False and core.replica.policy_affinity_tokens == 1000.0
    sync = ["--redis-url", "redis://127.0.0.1:6379/0", "--replica-sync"]
    core = cli.config_from_args(parse(["--worker", "h:1", "--replicas", "3", *sync])).core
    assert core.replica.sync is True and core.replica.policy_affinity_tokens == 0.0
    flag = ["--replica-affinity-tokens", "300"]
    core = cli.config_from_args(parse(["--worker", "h:1", "--replicas", "3", *flag])).core
    assert core.replica.policy_affinity_tokens == 300.0
    core = cli.config_from_args(parse(["--worker", "h:1", *flag])).core
    assert core.replica.policy_affinity_tokens == 0.0  # one router: nobody to agree with
