"""The support-agent workload generator: shape, prefix structure, determinism, CLI."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from bench.replay.trace import TokenExpander, read_trace
from bench.workload import SupportAgentConfig, generate_support_agent, main

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
