"""kvroute up --metrics-port P: the router takes P, worker i takes P+1+i (0: free ports)."""

from __future__ import annotations

import pytest

from router.cli.fleet import FleetConfig, build_parser, worker_command, worker_metrics_port


def test_workers_take_the_ports_after_the_router() -> None:
    config = FleetConfig(num_workers=3, metrics_port=9100, executor="sim")
    assert [worker_metrics_port(config, i) for i in range(3)] == [9101, 9102, 9103]
    argv = worker_command(config, "worker-1", worker_metrics_port(config, 1))
    assert argv[argv.index("--metrics-port") + 1] == "9102"


def test_port_zero_gives_every_process_a_free_port() -> None:
    config = FleetConfig(num_workers=2, metrics_port=0)
    assert worker_metrics_port(config, 1) == 0


def test_no_metrics_port_means_no_endpoint() -> None:
    config = FleetConfig(num_workers=2)
    assert worker_metrics_port(config, 0) is None
    assert "--metrics-port" not in worker_command(config, "worker-0")


def test_a_port_range_past_65535_is_refused() -> None:
    with pytest.raises(ValueError, match="no port for each of the 4 workers"):
        FleetConfig(num_workers=4, metrics_port=65533)


def test_cli_option() -> None:
    assert build_parser().parse_args(["--metrics-port", "9100"]).metrics_port == 9100
    assert build_parser().parse_args([]).metrics_port is None
