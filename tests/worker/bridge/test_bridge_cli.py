"""``kvroute bridge``: --help leads with a first start, bad arguments fail clearly, and the
real process serves the Worker service and its metrics in front of a fake engine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

import kvroute_cli
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from tests.worker.bridge.fake_engine import FakeEngine
from worker.bridge.service import cli

ROOT = Path(__file__).resolve().parents[3]


def test_help_leads_with_what_a_first_start_needs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exc:
        kvroute_cli.main(["bridge", "--help"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    first = "\n".join(lines[:30])
    for flag in ("--engine-url", "--events", "--events-bind", "--replay", "--block-size", "--port"):
        assert flag in first, flag
    assert "bridge" in kvroute_cli._usage()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--events", "tcp://127.0.0.1:1"], "--engine-url"),
        (["--engine-url", "http://127.0.0.1:1"], "one of the arguments --events --events-bind"),
        (
            ["--engine-url", "127.0.0.1:8000", "--events", "tcp://127.0.0.1:1"],
            "--engine-url must be the engine's HTTP address",
        ),
        (
            ["--engine-url", "http://127.0.0.1:1", "--events", "127.0.0.1:5557"],
            "--events must be a ZMQ endpoint",
        ),
        (
            ["--engine-url", "http://h:1", "--events", "tcp://h:1", "--block-size", "0"],
            "--block-size must be >= 1",
        ),
        (
            ["--engine-url", "http://h:1", "--events-bind", "tcp://256.1.1.1:1"],
            "cannot open the events socket",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


async def test_the_process_serves_the_worker_service_and_metrics():
    engine = FakeEngine()
    await engine.start()
    argv = [
        sys.executable, "-m", "kvroute_cli", "bridge",
        "--engine-url", engine.url,
        "--events", engine.pub_endpoint,
        "--replay", engine.replay_endpoint,
        "--worker-id", "cli-bridge",
        "--metrics-port", "0",
        "--load-interval-s", "0.2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() else "",
        )
        address = line.removeprefix("listening on ")
        metrics_url = proc.stdout.readline().strip().removeprefix("metrics on ")
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            info = await stub.GetLoad(pb.GetLoadRequest(), timeout=10)
            assert info.worker_id == "cli-bridge" and info.model_name == "tiny"
            req = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=list(range(1, 70))),
                sampling=pb.SamplingParams(max_new_tokens=2),
            )
            out = [m async for m in stub.Generate(req, timeout=10)]
            assert out[-1].finished.reason == pb.FINISH_REASON_LENGTH
            assert out[-1].finished.worker_id == "cli-bridge"
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'kvroute_bridge_requests_total{outcome="forwarded",worker="cli-bridge"} 1.0' in text
        assert "kvroute_bridge_events_replay_requests_total" in text
        assert 'kvroute_bridge_blocks_dropped_total{reason="lora",worker="cli-bridge"} 0.0' in text
        names = set(re.findall(r"^(kvroute_bridge_\w+?)(?:\{| )", text, re.MULTILINE))
        documented = (ROOT / "docs" / "METRICS.md").read_text()
        assert len(names) > 15
        assert sorted(n for n in names if f"`{n}" not in documented) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await engine.stop()


def test_the_peer_test_fails_clearly_without_its_virtualenv(tmp_path):
    """Never a silent skip: with no peer virtualenv the peer test fails and says how to
    make one."""
    env = {**os.environ, "KVROUTE_VLLM_VENV": str(tmp_path / "none"), "KVROUTE_FAIL_ON_SKIP": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "peer",
         "tests/peers/test_vllm_bridge.py"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:]
    assert "1 error" in out.stdout or "1 failed" in out.stdout, out.stdout[-2000:]
    assert "bench/peers/make_vllm_venv.sh" in out.stdout
    assert "skipped" not in out.stdout


def test_the_default_run_deselects_the_peer_tests():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         "tests/peers/test_vllm_bridge.py"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert "1 deselected" in out.stdout, out.stdout[-2000:]
