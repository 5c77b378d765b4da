"""`kvroute router --processes 2`: two router processes serve one address and both take
requests; the ports stay the supervisor's (a second router on either is an error)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from e2e_procs import ROOT, procs, run_up

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _server_side_inode(server_port: int, client_port: int) -> int:
    """The inode of the accepted socket of the loopback connection client_port -> server_port."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (
            int(local.split(":")[1], 16) == server_port
            and int(remote.split(":")[1], 16) == client_port
        ):
            return int(fields[9])
    raise AssertionError(f"no accepted socket for {client_port} -> {server_port}")


def _owner(pids: list[int], server_port: int, client_port: int) -> int:
    """Which of ``pids`` accepted the connection (polls: accepting is asynchronous)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # 0 until a process accepted it (a socket in the accept queue has no file yet)
        inode = _server_side_inode(server_port, client_port)
        for pid in pids:
            if inode in _socket_inodes(pid):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no process accepted {client_port} -> {server_port}")


def _complete(sock: socket.socket) -> dict:
    body = json.dumps({"model": "kvroute-tiny", "prompt": "hello", "max_tokens": 2}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return json.loads(payload)


def test_two_processes_serve_one_address_and_both_take_requests() -> None:
    with procs() as p:
        worker = p.worker("w0")
        router = p.start(
            "router",
            [
                *("router", "--worker", worker.address, "--port", "0", "--http-port", "0"),
                *("--processes", "2", "--log-level", "WARNING"),
            ],
            marker="http listening on",
        )
        http_port = int(router.address.rsplit(":", 1)[1])
        grpc_address = router.lines[0].split()[-1]
        children = _children(router.popen.pid)
        assert len(children) == 2
        # the kernel spreads connections over the two: 24 of them all landing on one
        # would happen once in 2**23 runs
        socks = [socket.create_connection(("127.0.0.1", http_port)) for _ in range(24)]
        owner = {s: _owner(children, http_port, s.getsockname()[1]) for s in socks}
        assert set(owner.values()) == set(children)
        for pid in children:  # each process answers on its own connection
            s = next(s for s in socks if owner[s] == pid)
            assert _complete(s)["choices"][0]["finish_reason"] == "length"
        for s in socks:
            s.close()
        with grpc.insecure_channel(grpc_address) as channel:
            request = pb.GenerateRequest(
                prompt_text="hello", sampling=pb.SamplingParams(max_new_tokens=2)
            )
            msgs = list(pb_grpc.RouterStub(channel).Generate(request, timeout=30))
            assert msgs[-1].finished.usage.completion_tokens == 2
        # the ports are held: a plain router and another --processes router both refuse
        for extra in (
            ["--port", grpc_address.rsplit(":", 1)[1]],
            ["--port", "0", "--http-port", str(http_port), "--processes", "2"],
        ):
            second = subprocess.run(
                [sys.executable, "-m", "kvroute_cli", "router", "--worker", worker.address, *extra],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            assert second.returncode == 1
            assert "Address already in use" in second.stderr
        assert router.popen.poll() is None


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return run_up(*args, workers=2, timeout=90)


def test_up_runs_its_router_as_several_processes() -> None:
    done = _up("--port", "0", "--http-port", "0", "--router-processes", "2", "--demo", "--exit")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kvroute router: starting 2 processes" in done.stderr
    assert done.stdout.count("served by worker-") == 2
    assert "router http listening on http://127.0.0.1:" in done.stdout
    refused = _up("--port", "0", "--router-processes", "2", "--metrics-port", "0")
    assert refused.returncode == 2
    assert "--router-processes above 1 runs without --metrics-port" in refused.stderr
