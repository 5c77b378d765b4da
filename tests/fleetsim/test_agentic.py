"""The agentic-sessions workload: a shared tool spec, sessions that only append, growing
contexts, determinism, the CLI."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from fleetsim.agentic import AgenticSessionsConfig, generate_agentic_sessions
from fleetsim.replay.trace import read_trace
from fleetsim.workload import main

SMALL = AgenticSessionsConfig(rate_rps=0.5, duration_s=60.0, seed=3)


def _sessions(records, config):
    """Records grouped by session: the first block id after the tool spec."""
    shared = config.tool_spec_tokens // config.block_size
    by_session = defaultdict(list)
    for r in records:
        by_session[r.hash_ids[shared]].append(r)
    return shared, by_session


def test_every_turn_starts_with_the_tool_spec_and_extends_its_sessions_last_prompt():
    records = generate_agentic_sessions(SMALL)
    shared, sessions = _sessions(records, SMALL)
    spec = records[0].hash_ids[:shared]
    assert all(r.hash_ids[:shared] == spec for r in records)
    assert len(sessions) > 5
    turns = [len(s) for s in sessions.values()]
    assert max(turns) >= 10  # tens of turns, not a few
    for turns_of_one in sessions.values():
        for before, after in itertools.pairwise(turns_of_one):
            assert after.timestamp_ms >= before.timestamp_ms + 1000 * SMALL.tool_pause_s[0] - 1
            # the next prompt is the last one + the action + a tool result
            grown = after.input_length - before.input_length - before.output_length
            lo, hi = SMALL.tool_result_tokens
            assert lo <= grown <= hi
            full = before.input_length // SMALL.block_size  # full blocks stay the same
            assert after.hash_ids[:full] == before.hash_ids[:full]
    # no two sessions share a block past the spec
    owners = defaultdict(set)
    for key, turns_of_one in sessions.items():
        for r in turns_of_one:
            for h in r.hash_ids[shared:]:
                owners[h].add(key)
    assert all(len(o) == 1 for o in owners.values())


def test_contexts_grow_to_tens_of_thousands_and_stay_under_the_cap():
    records = generate_agentic_sessions(AgenticSessionsConfig(seed=1, duration_s=120.0))
    lengths = [r.input_length for r in records]
    assert max(lengths) > 30_000
    assert max(lengths) <= AgenticSessionsConfig().max_prompt_tokens
    assert min(lengths) >= AgenticSessionsConfig().tool_spec_tokens + 2000
    assert records == sorted(records, key=lambda r: r.timestamp_ms)


def test_deterministic_for_a_seed():
    assert generate_agentic_sessions(SMALL) == generate_agentic_sessions(SMALL)
    other = AgenticSessionsConfig(rate_rps=0.5, duration_s=60.0, seed=4)
    assert generate_agentic_sessions(other) != generate_agentic_sessions(SMALL)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_rps": 0}, "rate_rps"),
        ({"turns": (5, 2)}, "turns"),
        ({"tool_pause_s": (-1.0, 2.0)}, "tool_pause_s"),
        ({"max_prompt_tokens": 1000}, "max_prompt_tokens"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AgenticSessionsConfig(**kwargs)


def test_cli_writes_the_agentic_workload(tmp_path, capsys):
    out = tmp_path / "ag.jsonl"
    assert main(["agentic-sessions", "-o", str(out), "--duration-s", "30", "--seed", "2"]) == 0
    assert "agentic-sessions requests" in capsys.readouterr().out
    expected = AgenticSessionsConfig(duration_s=30.0, seed=2)
    assert [r.hash_ids for r in read_trace(out, block_size=16)] == [
        r.hash_ids for r in generate_agentic_sessions(expected)
    ]
    assert main(["agentic-sessions", "-o", str(out), "--tenants", "3"]) == 2
    assert "--tenants applies to the zipf-tenants workload" in capsys.readouterr().err
