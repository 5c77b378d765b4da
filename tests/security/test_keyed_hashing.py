"""Keyed block hashing (--hash-key): the chain is seeded by a deployment secret, a crafted
collision of the unkeyed hash no longer collides, and a router refuses a worker whose key
differs from its own."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from secure_harness import WAIT_S, secure_worker

from kvroute_proto import hashing
from kvroute_proto.hashing import (
    block_hash_list,
    chain_block_hash,
    hash_key_fingerprint,
    key_fingerprint,
    partition_seed,
    set_hash_key,
    unfmix64,
)
from router.cli import router as router_cli
from router.cli.client import GenerateOptions, RouterClient
from router.service.server import RouterServer

HERE = Path(__file__).resolve().parent
KEY_1, KEY_2 = b"deployment-secret-one", b"deployment-secret-two"


def _router_config(workers, **overrides):
    sys.path.insert(0, str(HERE.parent / "router" / "service"))
    from router_harness import router_config

    return router_config(workers, **overrides)


@pytest.fixture(autouse=True)
def unkeyed_after() -> Iterator[None]:
    """The key is process-wide: every test leaves the process unkeyed."""
    yield
    set_hash_key(None)


def _thue_morse(n: int, a: int, b: int) -> list[int]:
    seq = [a]
    for _ in range(n):
        seq = seq + [b if t == a else a for t in seq]
    return seq


def test_crafted_collision_of_the_unkeyed_chain_does_not_survive_a_key():
    # Thue-Morse: 2**11 tokens and their complement reach the same chain state mod 2**64
    # for any odd multiplier (proto/hashing.py documents it): the last block's hash collides
    p = _thue_morse(11, 7, 9)
    q = [9 if t == 7 else 7 for t in p]
    assert p != q and len(p) == 2048
    plain_p, plain_q = block_hash_list(p, 16), block_hash_list(q, 16)
    assert plain_p[-1] == plain_q[-1]  # the crafted collision, today
    set_hash_key(KEY_1)
    keyed_p, keyed_q = block_hash_list(p, 16), block_hash_list(q, 16)
    assert keyed_p[-1] != keyed_q[-1]
    assert len(set(keyed_p) & set(keyed_q)) == 0


def test_keyed_chain_matches_its_scalar_spec_and_stays_chained():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2**32, 96, dtype=np.uint64).tolist()
    seed = partition_seed("tenant:a", "")
    unkeyed = block_hash_list(tokens, 8, seed)
    set_hash_key(KEY_1)
    keyed = block_hash_list(tokens, 8, seed)
    assert keyed != unkeyed
    parent = None
    for i, h in enumerate(keyed):  # the slow reference, block by block
        parent_h = chain_block_hash(parent, tokens[i * 8 : (i + 1) * 8], seed)
        assert parent_h == h
        parent = h
    # a chain continues from a block's hash (what the worker and the index rely on)
    assert block_hash_list(tokens[40:], 8, unfmix64(keyed[4])) == keyed[5:]
    # a uint32 array (the router's decoded prompts) hashes the same as a list
    assert block_hash_list(np.asarray(tokens, dtype=np.uint32), 8, seed) == keyed
    set_hash_key(KEY_2)
    assert block_hash_list(tokens, 8, seed) != keyed  # another key, other hashes
    set_hash_key(None)
    assert block_hash_list(tokens, 8, seed) == unkeyed  # unkeyed is unchanged


def test_fingerprints_name_keys_without_revealing_them():
    assert hash_key_fingerprint() == "" and key_fingerprint(None) == ""
    set_hash_key(KEY_1)
    fp = hash_key_fingerprint()
    assert fp == key_fingerprint(KEY_1) == key_fingerprint(KEY_1.decode())
    assert fp != key_fingerprint(KEY_2) and KEY_1.hex() not in fp and fp.startswith("hk1:")
    with pytest.raises(ValueError, match=r"1\.\.64 bytes"):
        set_hash_key(b"x" * 65)
    assert hashing._HASH_KEY == KEY_1  # a refused key changes nothing


def test_router_flag_sets_the_expected_fingerprint(monkeypatch):
    monkeypatch.delenv("KVROUTE_HASH_KEY", raising=False)
    args = router_cli.build_parser().parse_args(["--worker", "127.0.0.1:7001"])
    assert router_cli.config_from_args(args).connection.hash_key_fingerprint == ""
    args = router_cli.build_parser().parse_args(
        ["--worker", "127.0.0.1:7001", "--hash-key", KEY_1.decode()]
    )
    config = router_cli.config_from_args(args)
    assert config.connection.hash_key_fingerprint == key_fingerprint(KEY_1)


async def test_router_refuses_a_worker_with_another_key_and_routes_with_the_same(caplog):
    set_hash_key(KEY_1)
    async with secure_worker("w-k1") as worker:  # reports KEY_1's fingerprint
        conn = dataclasses.replace(
            _router_config([]).connection, hash_key_fingerprint=key_fingerprint(KEY_2)
        )
        router = RouterServer(_router_config([worker.address], connection=conn))
        await router.start()
        try:
            (c,) = router.pool.conns.values()
            await router.pool.wait_for(lambda: c.num_failures >= 2, WAIT_S)
            assert router.pool.num_healthy == 0 and c.num_connects == 0
            assert "block-hashing key fingerprint" in caplog.text
        finally:
            await router.stop(grace_s=0.1)

        conn = dataclasses.replace(conn, hash_key_fingerprint=key_fingerprint(KEY_1))
        router = RouterServer(_router_config([worker.address], connection=conn))
        await router.start()
        try:
            await router.pool.wait_for(lambda: router.pool.num_healthy == 1, WAIT_S)
            prompt = "keyed hashing still finds the cached prefix " * 3
            async with RouterClient(router.address, timeout_s=WAIT_S) as client:
                await client.generate(prompt, GenerateOptions(max_new_tokens=2))
                (c,) = router.pool.conns.values()
                # the worker's keyed KV events are verified and indexed by the router
                await router.pool.wait_for(lambda: router.core.index.size() > 0, WAIT_S)
                expl = await client.explain(prompt)
                assert expl.workers[0].event_matched_tokens > 0
                assert router.core.index.errors["hash_mismatch"] == 0
        finally:
            await router.stop(grace_s=0.1)
