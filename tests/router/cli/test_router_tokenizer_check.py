"""The router leaves out a worker whose tokenizer differs from its own (GetLoad's
tokenizer_fingerprint), with one WARNING naming both fingerprints; real in-process workers
and router on 127.0.0.1 port 0."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from edge.tokenizer import ByteTokenizer
from router.cli import router as cli
from tests.router.service.router_harness import FAST_CONN, router_config, running_router, sim_worker

ROUTER_TOK = ByteTokenizer()
OTHER_TOK = ByteTokenizer(add_bos=True)  # a real tokenizer that encodes differently


async def test_a_worker_with_another_tokenizer_is_left_out(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="router.service.worker_conn")
    conn = dataclasses.replace(FAST_CONN, tokenizer_fingerprint=ROUTER_TOK.fingerprint)
    async with (
        sim_worker("w-same") as same,
        sim_worker("w-other", tokenizer=OTHER_TOK) as other,
    ):
        config = router_config([same.address, other.address], connection=conn)
        async with running_router([], config, tokenizer=ROUTER_TOK) as r:
            await r.wait_synced(1)
            bad = r.server.pool.conns[other.address]
            # it keeps retrying GetLoad (backoff 0.02-0.2 s) and is refused each time
            await r.wait_for(lambda: bad.num_failures >= 3)
            assert not bad.healthy and bad.worker_id is None and bad.state == "refused"
            assert r.server.pool.conns[same.address].healthy
            expl = await r.client.explain("hello there")
            assert [w.worker_id for w in expl.workers] == ["w-same"]
            for i in range(3):
                res = await r.client.generate(f"prompt {i}")
                assert res.worker_id == "w-same"
    lines = [
        rec.getMessage() for rec in caplog.records if "tokenizer fingerprint" in rec.getMessage()
    ]
    assert len(lines) == 1, lines  # logged once, not per retry
    assert all(
        rec.levelno == logging.WARNING for rec in caplog.records if "tokenizer" in rec.getMessage()
    )
    line = lines[0]
    assert "w-other" in line and other.address in line
    assert OTHER_TOK.fingerprint in line and ROUTER_TOK.fingerprint in line


async def test_no_fingerprint_configured_means_no_check():
    async with (
        sim_worker("w-other", tokenizer=OTHER_TOK) as other,
        running_router([other.address]) as r,
    ):
        await r.wait_synced(1)
        info = r.server.pool.conns[other.address].info
        assert info is not None and info.tokenizer_fingerprint == OTHER_TOK.fingerprint


async def test_worker_that_changes_tokenizer_on_restart_is_let_go():
    conn = dataclasses.replace(FAST_CONN, tokenizer_fingerprint=ROUTER_TOK.fingerprint)
    async with sim_worker("w0") as first:
        port = int(first.address.rsplit(":", 1)[1])
        config = router_config([first.address], connection=conn)
        async with running_router([], config) as r:
            await r.wait_synced(1)
            assert r.server.core.has_worker("w0")
            await first.server.stop(grace_s=0.0)  # type: ignore[attr-defined]
            await r.wait_for(lambda: r.server.pool.num_healthy == 0)
            async with sim_worker("w0", port=port, tokenizer=OTHER_TOK):
                conn_ = r.server.pool.conns[first.address]
                await r.wait_for(lambda: conn_.num_failures >= 3 and conn_.worker_id is None)
                assert not r.server.core.has_worker("w0")


def test_cli_router_checks_the_fingerprint_of_its_tokenizer(tmp_path):
    args = cli.build_parser().parse_args(["--worker", "127.0.0.1:1"])
    assert cli.config_from_args(args).connection.tokenizer_fingerprint is None
    config = cli.config_from_args(args, tokenizer_fingerprint=ROUTER_TOK.fingerprint)
    assert config.connection.tokenizer_fingerprint == ROUTER_TOK.fingerprint
    model = tmp_path / "my-model"
    model.mkdir()
    args = cli.build_parser().parse_args(["--worker", "127.0.0.1:1", "--model", str(model)])
    assert cli.config_from_args(args).service.model_name == "my-model"
    assert cli.main(["--worker", "127.0.0.1:1", "--model", str(tmp_path / "nope")]) == 2


def test_fleet_passes_its_model_to_every_worker(tmp_path):
    from router.cli.fleet import FleetConfig, worker_command

    argv = worker_command(FleetConfig(model=str(tmp_path)), "worker-0")
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert "--model" not in worker_command(FleetConfig(), "worker-0")
    with pytest.raises(ValueError, match="--model needs --executor torch"):
        FleetConfig(model=str(tmp_path), executor="sim")


class _NoFingerprint(ByteTokenizer):
    """A worker that reports no tokenizer fingerprint, as an engine bridge does."""

    @property
    def fingerprint(self) -> str:
        return ""


async def test_a_worker_without_fingerprint_is_routed_to_by_a_router_without_model(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="router.service.worker_conn")
    conn = dataclasses.replace(
        FAST_CONN, tokenizer_fingerprint=ROUTER_TOK.fingerprint, accept_no_fingerprint=True
    )
    async with sim_worker("bridge-0", tokenizer=_NoFingerprint()) as bridge:
        config = router_config([bridge.address], connection=conn)
        async with running_router([], config, tokenizer=ROUTER_TOK) as r:
            await r.wait_synced(1)
            for i in range(3):
                res = await r.client.generate(f"prompt {i}")
                assert res.worker_id == "bridge-0"
            conn_ = r.server.pool.conns[bridge.address]
            assert conn_.healthy and conn_.state == "healthy"
    lines = [rec.getMessage() for rec in caplog.records if "no tokenizer" in rec.getMessage()]
    assert len(lines) == 1 and "bridge-0" in lines[0], lines


async def test_a_worker_without_fingerprint_is_refused_with_a_hint_by_a_router_with_model(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="router.service.worker_conn")
    conn = dataclasses.replace(FAST_CONN, tokenizer_fingerprint=ROUTER_TOK.fingerprint)
    assert conn.accept_no_fingerprint is False  # the default: refused
    async with sim_worker("bridge-0", tokenizer=_NoFingerprint()) as bridge:
        config = router_config([bridge.address], connection=conn)
        async with running_router([], config, tokenizer=ROUTER_TOK) as r:
            bad = r.server.pool.conns[bridge.address]
            await r.wait_for(lambda: bad.num_failures >= 3)
            assert not bad.healthy and bad.state == "refused"
    lines = [rec.getMessage() for rec in caplog.records if "tokenizer" in rec.getMessage()]
    assert len(lines) == 1, lines
    assert "(none reported)" in lines[0] and "without --model" in lines[0]


def test_cli_router_accepts_bridges_only_without_model(tmp_path):
    args = cli.build_parser().parse_args(["--worker", "127.0.0.1:1"])
    assert cli.config_from_args(args).connection.accept_no_fingerprint is True
    args = cli.build_parser().parse_args(["--worker", "127.0.0.1:1", "--model", str(tmp_path)])
    assert cli.config_from_args(args).connection.accept_no_fingerprint is False


async def test_each_model_pool_tokenizes_and_checks_workers_with_its_own_tokenizer():
    """Several --model (decision 0036): the pool of "b" encodes with b's tokenizer and takes
    only workers reporting its fingerprint; "a"'s with a's."""
    from router.core.pools import PoolsConfig
    from router.service.frontend_config import FrontendConfig

    conn = dataclasses.replace(
        FAST_CONN,
        tokenizer_fingerprint=ROUTER_TOK.fingerprint,
        pool_fingerprints=(("b", OTHER_TOK.fingerprint),),
    )
    async with (
        sim_worker("a0", model_name="a") as a0,
        sim_worker("b0", model_name="b", tokenizer=OTHER_TOK) as b0,
        sim_worker("b-wrong", model_name="b") as wrong,
    ):
        config = router_config(
            [a0.address, b0.address, wrong.address],
            connection=conn,
            pools=PoolsConfig(("a", "b")),
            service=FrontendConfig(model_name="a"),
        )
        tokenizers = {"b": OTHER_TOK}  # as `--model A --model B` gives b's pool
        async with running_router(
            [], config, tokenizer=ROUTER_TOK, pool_tokenizers=tokenizers
        ) as r:
            await r.wait_synced(2)
            bad = r.server.pool.conns[wrong.address]
            await r.wait_for(lambda: bad.num_failures >= 2)
            assert bad.state == "refused" and not r.server.pools.has_worker("b-wrong")
            from router.cli.client import GenerateOptions

            text = "hello pools"
            in_a = await r.client.generate(text, GenerateOptions(max_new_tokens=1, model="a"))
            in_b = await r.client.generate(text, GenerateOptions(max_new_tokens=1, model="b"))
            assert (in_a.worker_id, in_b.worker_id) == ("a0", "b0")
            assert in_a.prompt_tokens == len(ROUTER_TOK.encode(text))
            assert in_b.prompt_tokens == len(OTHER_TOK.encode(text)) == in_a.prompt_tokens + 1
