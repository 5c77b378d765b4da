"""The support-agent workload generator: shape, prefix structure, determinism, CLI."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from fleetsim.replay.trace import TokenExpander, read_trace
from fleetsim.workload import (
    ColdBurstsConfig,
    SupportAgentConfig,
    ZipfTenantsConfig,
    generate_cold_bursts,
    generate_support_agent,
    generate_zipf_tenants,
    main,
)

SMALL = SupportAgentConfig(rate_rps=40.0, duration_s=30.0, num_conversations=20, seed=7)


def _split(records, config):
    """(conversation groups keyed by their first own block id, rag records)."""
    bs = config.block_size
    conv_shared = (config.system_tokens + config.fewshot_tokens) // bs
    first = records[0]  # any conversation turn's shared ids
    convs = [r for r in records if len(r.hash_ids) > conv_shared]
    shared = max(
        (r.hash_ids[:conv_shared] for r in convs),
        key=lambda ids: sum(1 for r in convs if r.hash_ids[:conv_shared] == ids),
    )
    groups = defaultdict(list)
    rag = []
    for r in records:
        if r.hash_ids[:conv_shared] == shared:
            groups[r.hash_ids[conv_shared]].append(r)
        else:
            rag.append(r)
    assert first is not None
    return groups, rag, shared


def test_shape_and_prefix_structure():
    cfg = SMALL
    records = generate_support_agent(cfg)
    assert 1000 < len(records) < 1400  # Poisson(40/s * 30 s)
    ts = [r.timestamp_ms for r in records]
    assert ts == sorted(ts) and ts[-1] < 30_000
    bs = cfg.block_size
    for r in records:
        assert len(r.hash_ids) == -(-r.input_length // bs)
        assert cfg.reply_tokens[0] <= r.output_length <= cfg.reply_tokens[1]
        assert r.input_length <= cfg.max_prompt_tokens
        assert r.input_length + r.output_length <= 8192
    groups, rag, shared = _split(records, cfg)
    # every request starts with the system prompt blocks (512 / 16 = 32 of them)
    sys_blocks = cfg.system_tokens // bs
    assert all(r.hash_ids[:sys_blocks] == shared[:sys_blocks] for r in records)
    assert len(shared) == 2055 // 16 == 128
    # a share of one-off RAG requests with long unique contexts
    assert 0.12 < len(rag) / len(records) < 0.28
    rag_own = [h for r in rag for h in r.hash_ids[sys_blocks:]]
    assert len(rag_own) == len(set(rag_own))  # nothing shared beyond the system prompt
    assert all(r.input_length >= cfg.system_tokens + cfg.rag_context_tokens[0] for r in rag)
    # conversations: each turn extends the previous one by its reply and a new message
    assert len(groups) >= cfg.num_conversations
    multi = [g for g in groups.values() if len(g) >= 3]
    assert multi
    for turns in groups.values():
        first = turns[0]
        assert (
            cfg.system_tokens + cfg.fewshot_tokens + cfg.user_tokens[0]
            <= first.input_length
            <= cfg.system_tokens + cfg.fewshot_tokens + cfg.user_tokens[1]
        )
        for prev, cur in itertools.pairwise(turns):
            assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
            grown = cur.input_length - prev.input_length - prev.output_length
            assert cfg.user_tokens[0] <= grown <= cfg.user_tokens[1]
        assert len(turns) <= cfg.max_turns[1]


def test_partial_last_block_expands_to_a_prefix_of_the_next_turn():
    records = generate_support_agent(SMALL)
    groups, _, _ = _split(records, SMALL)
    ex = TokenExpander(block_size=SMALL.block_size, seed=0)
    turns = max(groups.values(), key=len)
    for prev, cur in itertools.pairwise(turns):
        a = ex.expand_record(prev)
        b = ex.expand_record(cur)
        assert b[: len(a)].tolist() == a.tolist()


def test_block_size_one_is_exact():
    cfg = SupportAgentConfig(
        rate_rps=5.0, duration_s=5.0, num_conversations=3, rag_share=0.0, block_size=1
    )
    records = generate_support_agent(cfg)
    shared = records[0].hash_ids[:2055]
    assert all(r.hash_ids[:2055] == shared for r in records)
    assert all(r.hash_ids[2055] not in shared for r in records)


def test_deterministic_for_a_seed():
    assert generate_support_agent(SMALL) == generate_support_agent(SMALL)
    other = SupportAgentConfig(rate_rps=40.0, duration_s=30.0, num_conversations=20, seed=8)
    assert generate_support_agent(other) != generate_support_agent(SMALL)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_rps": 0}, "rate_rps"),
        ({"rag_share": 1.5}, "rag_share"),
        ({"num_conversations": 0}, "num_conversations"),
        ({"user_tokens": (5, 2)}, "user_tokens"),
        ({"max_prompt_tokens": 100}, "max_prompt_tokens"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SupportAgentConfig(**kwargs)


def test_cli_writes_a_replayable_trace(tmp_path, capsys):
    out = tmp_path / "sa.jsonl"
    rc = main(
        [
            "support-agent",
            "-o",
            str(out),
            "--rate",
            "10",
            "--duration-s",
            "10",
            "--seed",
            "1",
            "--block-size",
            "32",
            "--conversations",
            "5",
        ]
    )
    assert rc == 0
    assert "--trace-block-size 32" in capsys.readouterr().out
    records = read_trace(out, block_size=32)
    assert 50 < len(records) < 160
    assert main(["support-agent", "-o", str(out), "--rate", "-1"]) == 2


# ---- held-out workloads: zipf-tenants and cold-bursts ------------------------------------

ZT = ZipfTenantsConfig(rate_rps=50.0, duration_s=20.0, num_tenants=200, seed=3)


def test_zipf_tenants_shape_and_skew():
    records = generate_zipf_tenants(ZT)
    assert 850 < len(records) < 1150  # Poisson(50/s * 20 s)
    ts = [r.timestamp_ms for r in records]
    assert ts == sorted(ts) and ts[-1] < 20_000
    bs = ZT.block_size
    by_tenant = defaultdict(list)  # first block id -> requests: one tenant's system prompt
    for r in records:
        assert len(r.hash_ids) == -(-r.input_length // bs)
        assert ZT.reply_tokens[0] <= r.output_length <= ZT.reply_tokens[1]
        lo = ZT.system_tokens[0] + ZT.user_tokens[0]
        assert lo <= r.input_length <= ZT.system_tokens[1] + ZT.user_tokens[1]
        by_tenant[r.hash_ids[0]].append(r)
    sizes = sorted((len(v) for v in by_tenant.values()), reverse=True)
    weights = ZT.tenant_weights()
    top_share = weights[0] / sum(weights)  # ~0.31 for s=1.3 over 200 tenants
    assert abs(sizes[0] / len(records) - top_share) < 0.05
    assert sizes[0] > 5 * sizes[len(sizes) // 2]  # skewed: the hottest far above the median
    for group in by_tenant.values():
        # a tenant's requests share its whole system prompt (full blocks), then diverge
        shared = min(len(r.hash_ids) for r in group) - 1
        common = [r.hash_ids[: ZT.system_tokens[0] // bs] for r in group]
        assert all(c == common[0] for c in common)
        if len(group) > 1:
            tails = [h for r in group for h in r.hash_ids[shared + 1 :]]
            assert len(tails) == len(set(tails))  # the messages are unique per request
    # different tenants share nothing
    firsts = {r.hash_ids[0] for r in records}
    assert len(firsts) == len(by_tenant)


def test_zipf_tenants_hottest_prompt_is_shared_and_deterministic():
    assert generate_zipf_tenants(ZT) == generate_zipf_tenants(ZT)
    other = ZipfTenantsConfig(rate_rps=50.0, duration_s=20.0, num_tenants=200, seed=4)
    assert generate_zipf_tenants(other) != generate_zipf_tenants(ZT)
    with pytest.raises(ValueError, match="zipf_s"):
        ZipfTenantsConfig(zipf_s=0)
    with pytest.raises(ValueError, match="num_tenants"):
        ZipfTenantsConfig(num_tenants=0)


CB = ColdBurstsConfig(rate_rps=5.0, duration_s=20.0, burst_interval_s=5.0, seed=2)


def test_cold_bursts_shape():
    records = generate_cold_bursts(CB)
    ts = [r.timestamp_ms for r in records]
    assert ts == sorted(ts)
    bs = CB.block_size
    prefix_blocks = CB.burst_prefix_tokens // bs
    groups = defaultdict(list)
    for r in records:
        assert len(r.hash_ids) == -(-r.input_length // bs)
        groups[r.timestamp_ms].append(r)
    bursts = {t: g for t, g in groups.items() if len(g) == CB.burst_size}
    # one burst every 5 s from 2.5 s: 2.5, 7.5, 12.5, 17.5
    assert sorted(bursts) == [2500.0, 7500.0, 12500.0, 17500.0]
    seen_prefixes = set()
    for burst in bursts.values():
        prefix = burst[0].hash_ids[:prefix_blocks]
        assert all(r.hash_ids[:prefix_blocks] == prefix for r in burst)  # one shared prefix
        assert not seen_prefixes & set(prefix)  # cold: no earlier request holds it
        seen_prefixes |= set(prefix)
        for r in burst:
            lo, hi = CB.burst_question_tokens
            assert lo <= r.input_length - CB.burst_prefix_tokens <= hi
        tails = [h for r in burst for h in r.hash_ids[prefix_blocks:]]
        assert len(tails) == len(set(tails))  # each its own question
    background = [r for t, g in groups.items() if t not in bursts for r in g]
    assert 60 < len(background) < 145  # Poisson(5/s * 20 s)
    own = [h for r in background for h in r.hash_ids]
    assert len(own) == len(set(own))  # unique documents share nothing
    assert not set(own) & seen_prefixes
    assert generate_cold_bursts(CB) == records


def test_cli_writes_the_held_out_workloads(tmp_path, capsys):
    for name, extra in (
        ("zipf-tenants", ["--tenants", "50", "--zipf-s", "1.3"]),
        ("cold-bursts", ["--burst-size", "8", "--burst-interval-s", "2"]),
    ):
        out = tmp_path / f"{name}.jsonl"
        argv = [name, "-o", str(out), "--rate", "5", "--duration-s", "6", "--seed", "9"]
        assert main([*argv, *extra]) == 0
        assert name in capsys.readouterr().out
        assert read_trace(out, block_size=16)
    bursts = read_trace(tmp_path / "cold-bursts.jsonl", block_size=16)
    assert sum(1 for r in bursts if r.timestamp_ms == 1000.0) == 8
    assert main(["zipf-tenants", "-o", str(out), "--burst-size", "3"]) == 2
    assert "--burst-size applies to the cold-bursts workload" in capsys.readouterr().err
    assert main(["cold-bursts", "-o", str(out), "--burst-size", "0"]) == 2
    assert "burst_size must be >= 1" in capsys.readouterr().err
