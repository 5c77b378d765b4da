"""The OpenAI compatibility suite: every request of tests/peers/compat_cases.py sent to a live
vLLM and to kvroute, both serving the same model directory, compared, and the table
written to docs/openai-compat-vllm.md.

The model directory is ``kvroute model init``'s (its BPE tokenizer and chat template) with
a checkpoint of the shape vLLM's CPU attention takes (heads of 64 dimensions) and a
1024-token context for both; vLLM runs it in float32, as kvroute's CPU executor does, so
greedy outputs can be compared token for token. One engine start each: vLLM (its own
virtualenv, bench/peers/make_vllm_venv.sh), and ``kvroute router --model DIR`` in front of
one ``kvroute worker --executor torch --model DIR``.

Fails when kvroute puts a stop string in its text, when a request differs from vLLM's
answer without a reason in its case, or when the table it wrote differs from the committed
one (review the new table and commit it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.e2e_procs import ROOT, _read_until_listening, procs
from tests.peers import free_port, stop, vllm_python
from tests.peers.compat_cases import (
    CASES,
    CHAT,
    COMPLETIONS,
    FREE_TOKENS,
    MESSAGES,
    MODEL,
    PROMPT,
    Comparison,
    Ctx,
    Outcome,
    compare,
    render_table,
)
from tests.peers.test_vllm_bridge import _engine_log_tail

pytestmark = [pytest.mark.peer, pytest.mark.timeout(900)]

TABLE = ROOT / "docs" / "openai-compat-vllm.md"
START_S = 300.0  # each server; ~50 s on 2 shared cores
MODEL_NOTE = (
    "`kvroute model init`'s byte-level BPE tokenizer and chat template with random\n"
    "weights of 2 layers, hidden 256, 4 heads of 64 over 2 KV heads, vocabulary 512, context\n"
    "1024, float32 on both"
)


def write_compat_model(out: Path) -> Path:
    """``kvroute model init``'s directory with a checkpoint vLLM's CPU build serves."""
    from worker.engine.loader import read_config, save_hf
    from worker.engine.model import LlamaConfig, build_tiny_model
    from worker.model_dir import write_model_dir

    write_model_dir(out)
    raw = read_config(out)
    config = LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # the CPU attention backend's smallest
        max_position_embeddings=1024,
        bos_token_id=raw["bos_token_id"],
        eos_token_ids=(raw["eos_token_id"],),
    )
    save_hf(build_tiny_model(0, config=config), out)
    return out


def _wait_ok(url: str, timeout_s: float, what: str, log: Path | None = None) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:  # bounded by the timeout
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    tail = _engine_log_tail(log) if log else ""
    raise AssertionError(f"{what} was not healthy within {timeout_s} s\n{tail}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("compat")
    model = write_compat_model(tmp / "model")
    port = free_port()
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL, "--enforce-eager",
        "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
        "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    log = tmp / "vllm.log"
    with log.open("w") as out:
        engine = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    try:
        with procs() as p:
            worker = p.start(
                "worker",
                ["worker", "--executor", "torch", "--model", str(model), "--torch-threads", "1",
                 "--port", "0", "--worker-id", "kv0", "--log-level", "WARNING"],
                wait=False,
            )  # fmt: skip
            _read_until_listening(worker, "listening on", START_S)
            router = p.start(
                "router",
                ["router", "--port", "0", "--worker", worker.address, "--model", str(model),
                 "--served-model-name", MODEL, "--http-port", "0", "--log-level", "WARNING"],
                wait=False,
            )  # fmt: skip
            _read_until_listening(router, "http listening on", START_S)
            kvroute = f"http://{router.address}"
            vllm = f"http://127.0.0.1:{port}"
            print(f"vLLM healthy after {_wait_ok(vllm + '/health', START_S, 'vLLM', log):.0f} s")
            _wait_ok(kvroute + "/health", START_S, "kvroute's router")
            with urllib.request.urlopen(vllm + "/version", timeout=10) as r:
                version = json.loads(r.read())["version"]
            yield {"vllm": vllm, "kvroute": kvroute, "version": version, "model": str(model)}
    finally:
        stop(engine)


def send(base: str, path: str, request: dict[str, object]) -> Outcome:
    """POST ``request`` (``__raw__``: a body sent as is) and read the answer: the JSON, or
    a stream's chunks."""
    raw = request.get("__raw__")
    content = raw.encode() if isinstance(raw, str) else json.dumps(request).encode()
    post = urllib.request.Request(
        base + path, data=content, headers={"Content-Type": "application/json"}
    )
    try:
        r = urllib.request.urlopen(post, timeout=300)
    except urllib.error.HTTPError as err:
        r = err
    with r:
        if r.status != 200 or not request.get("stream"):
            data = r.read()
            try:
                body = json.loads(data)
            except ValueError:
                body = data.decode(errors="replace")
            return Outcome(r.status, body=body)
        chunks, done = [], False
        for raw_line in r:
            line = raw_line.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[len("data: ") :]))
        return Outcome(200, chunks=chunks, done=done, stream=True)


def _context(base: str, model: str) -> Ctx:
    greedy = {"model": MODEL, "max_tokens": FREE_TOKENS, "temperature": 0}
    free = send(base, COMPLETIONS, {**greedy, "prompt": PROMPT})
    chat = send(base, CHAT, {**greedy, "messages": MESSAGES})
    assert free.ok and chat.ok, (free.body, chat.body)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return Ctx(
        free.texts()[0], chat.texts()[0], tok.token_to_id("\u010a"), tok.token_to_id("\u0120the")
    )


def run_cases(servers: dict[str, str]) -> list[Comparison]:
    out = []
    ctx = _context(servers["vllm"], servers["model"])
    for case in CASES:
        request = case.request(ctx)
        vllm = send(servers["vllm"], case.path, request)
        kvroute = send(servers["kvroute"], case.path, request)
        comparison = compare(case, request, vllm, kvroute)
        if case.repeat:
            for name, first in (("vLLM", vllm), ("kvroute", kvroute)):
                again = send(servers[name.lower()], case.path, request)
                same = again.texts() == first.texts()
                comparison.notes.append(f"{name} {'repeats' if same else 'does not repeat'}")
        out.append(comparison)
    return out


def test_kvroute_answers_as_vllm_does(servers: dict[str, str]) -> None:
    comparisons = run_cases(servers)
    table = render_table(comparisons, vllm_version=servers["version"], model=MODEL_NOTE)
    before = TABLE.read_text() if TABLE.is_file() else ""
    TABLE.write_text(table)
    print(table)
    leaks = [leak for c in comparisons for leak in c.stop_leaks if leak.startswith("kvroute")]
    assert not leaks, leaks
    unexplained = [
        c.case.name + ": " + "; ".join(c.differences)
        for c in comparisons
        if not c.same and not c.case.why
    ]
    assert not unexplained, "\n".join(unexplained)
    repeats = [n for c in comparisons for n in c.notes if "does not repeat" in n]
    assert not any(n.startswith("kvroute") for n in repeats), repeats
    assert table == before, (
        f"{TABLE.relative_to(ROOT)} changed (rewritten): review it and commit it "
        f"(git diff {TABLE.relative_to(ROOT)})"
    )


if __name__ == "__main__":  # against two servers already up: VLLM_URL KVROUTE_URL MODEL_DIR
    urls = {"vllm": sys.argv[1], "kvroute": sys.argv[2], "model": sys.argv[3]}
    print(render_table(run_cases(urls), vllm_version="(by hand)", model=MODEL_NOTE))
