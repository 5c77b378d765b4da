"""``kvroute worker``: flags, the stable "listening on HOST:PORT" line, SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import grpc
import pytest

from edge.tokenizer import ByteTokenizer
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker import cli


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--host", "--port", "--worker-id", "--executor", "--model", "--device", "--kv-slots",
        "--page-size", "--block-size", "--eviction-policy", "--schedule-policy",
        "--max-running", "--max-waiting", "--chunk-size", "--replay-buffer",
        "--load-interval-s", "--step-reports", "--sim-speedup", "--log-level",
    ):  # fmt: skip
        assert flag in out, flag


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-slots", "0"], "num_kv_slots"),
        (["--replay-buffer", "-1"], "replay_buffer_size"),
        (["--executor", "torch", "--sim-speedup", "2"], "--sim-speedup"),
        (["--load-interval-s", "-1"], "load_interval_s"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_setting(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--log-level", "loud"])
    assert info.value.code == 2
    assert "--log-level" in capsys.readouterr().err


async def test_worker_process_serves_and_stops_on_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.cli", "--executor", "sim", "--port", "0",
        "--worker-id", "cli-w", "--block-size", "8", "--kv-slots", "1024",
        "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=20)).decode()
        assert line.startswith("listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerStub(channel)
            info = await stub.GetLoad(pb.GetLoadRequest())
            assert (info.worker_id, info.block_size, info.kv_capacity_tokens) == ("cli-w", 8, 1024)
            assert info.executor == "sim" and info.epoch != 0
            assert info.model_name == "kvroute-tiny"
            assert info.tokenizer_fingerprint == ByteTokenizer().fingerprint
            req = pb.GenerateRequest(
                prompt_text="hello", sampling=pb.SamplingParams(max_new_tokens=3)
            )
            msgs = [m async for m in stub.Generate(req)]
            assert msgs[-1].finished.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_taken_port_exits_1_without_sharing_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.cli", "--port", str(port), "--log-level", "ERROR",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 1
    assert b"listening on" not in out
    assert f"could not bind 127.0.0.1:{port}".encode() in err


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--port", port])
    assert info.value.code == 2
    assert "argument --port: must be" in capsys.readouterr().err
