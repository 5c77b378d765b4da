"""add_request validation: every error names its field and limit, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from sched_harness import make_engine, request, run

from worker.engine.engine import EngineConfig
from worker.engine.sim_executor import SimExecutorConfig
from worker.engine.types import EngineRequest, FinishReason
from worker.errors import DuplicateRequestError, InvalidRequestError, QueueFullError


def _engine():
    sim = SimExecutorConfig(vocab_size=1000, max_context_tokens=512)
    return make_engine(sim=sim, num_kv_slots=256, max_waiting_requests=2)[0]


@pytest.mark.parametrize(
    ("req", "field", "fragment"),
    [
        (request("r", []), "prompt_token_ids", "must not be empty"),
        (request("r", [1, 1000]), "prompt_token_ids", "outside [0, 1000)"),
        (request("r", [-1, 2]), "prompt_token_ids", "outside [0, 1000)"),
        (request("r", [1] * 500, max_new_tokens=13), "max_new_tokens", "max_context_tokens=512"),
        (request("r", [1] * 512), "prompt_token_ids", "max_context_tokens=512"),
        (request("r", [1] * 200, max_new_tokens=100), "max_new_tokens", "num_kv_slots=256"),
        (request("r", [1] * 300), "prompt_token_ids", "num_kv_slots=256"),
        (request("r", [1], temperature=-0.5), "temperature", ">= 0"),
        (request("r", [1], temperature=float("nan")), "temperature", ">= 0"),
        (request("r", [1], top_p=0.0), "top_p", "(0, 1]"),
        (request("r", [1], top_p=1.5), "top_p", "(0, 1]"),
        (request("r", [1], top_k=-1), "top_k", ">= 0"),
        (request("r", [1], max_new_tokens=0), "max_new_tokens", ">= 1"),
        (request("r", [1], stop_token_ids=(5000,)), "stop_token_ids", "outside [0, 1000)"),
        (request("", [1]), "request_id", "non-empty"),
        (EngineRequest("r", np.array([1.0, 2.0])), "prompt_token_ids", "integers"),
        (EngineRequest("r", np.array([[1, 2]])), "prompt_token_ids", "1-D"),
        (EngineRequest("r", np.array([1]), priority=1.5), "priority", "integer"),
        (EngineRequest("r", np.array([1]), priority=True), "priority", "integer"),
        (EngineRequest("r", np.array([1]), partition="salt"), "partition", "Partition"),  # type: ignore[arg-type]
    ],
)
def test_invalid_requests_name_field_and_limit(req: EngineRequest, field: str, fragment: str):
    engine = _engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(req)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert not engine.has_work()
    assert engine.stats().num_requests == 0


def test_largest_request_that_fits_is_accepted() -> None:
    engine = _engine()
    # 200 + 57 tokens: the last generated token needs no KV slot, so 256 slots suffice.
    engine.add_request(request("r", [1] * 200, max_new_tokens=57))


@pytest.mark.parametrize(
    ("num_kv_slots", "prompt", "expected"),
    [
        (4096, 100, (412, FinishReason.MAX_CONTEXT)),  # to the context's end (512)
        (256, 100, (157, FinishReason.LENGTH)),  # as far as the KV pool can ever hold
    ],
)
def test_no_max_new_tokens_generates_what_is_left(num_kv_slots, prompt, expected) -> None:
    sim = SimExecutorConfig(vocab_size=1000, max_context_tokens=512)
    engine = make_engine(sim=sim, num_kv_slots=num_kv_slots)[0]
    engine.add_request(request("r", [1] * prompt, max_new_tokens=None))  # type: ignore[arg-type]
    out = run(engine)["r"]
    assert (len(out.tokens), out.finish_reason) == expected


def test_a_full_context_leaves_nothing_to_generate() -> None:
    with pytest.raises(InvalidRequestError, match="leaves no room") as info:
        _engine().add_request(request("r", [1] * 512, max_new_tokens=None))  # type: ignore[arg-type]
    assert info.value.field == "prompt_token_ids"


def test_duplicate_in_flight_id() -> None:
    engine = _engine()
    engine.add_request(request("r", [1, 2]))
    with pytest.raises(DuplicateRequestError) as info:
        engine.add_request(request("r", [3, 4]))
    assert info.value.field == "request_id"
    assert isinstance(info.value, InvalidRequestError)


def test_id_reusable_after_finish() -> None:
    engine = _engine()
    engine.add_request(request("r", [1, 2], max_new_tokens=1))
    while engine.has_work():
        engine.step()
    engine.add_request(request("r", [1, 2], max_new_tokens=1))


def test_queue_full() -> None:
    engine = _engine()
    engine.add_request(request("a", [1]))
    engine.add_request(request("b", [1]))
    with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
        engine.add_request(request("c", [1]))
    assert engine.num_waiting == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_kv_slots": 0}, "num_kv_slots"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"new_token_reserve_ratio": 2.0}, "new_token_reserve_ratio"),
        ({"lpm_rematch_budget": -1}, "lpm_rematch_budget"),
    ],
)
def test_bad_engine_config(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(**kwargs)


def test_unknown_schedule_policy_lists_choices() -> None:
    with pytest.raises(ValueError, match="dfs-weight"):
        make_engine(schedule_policy="nope")


def test_numpy_integers_are_accepted_and_bools_are_not() -> None:
    engine = _engine()
    engine.add_request(request("np", [1, 2], max_new_tokens=np.int64(3), top_k=np.int32(5)))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("b", [1, 2], max_new_tokens=True))
    assert info.value.field == "max_new_tokens"


def test_a_numpy_integer_priority_runs_to_the_end() -> None:
    # The cache stores priorities on nodes and takes plain ints only: a numpy priority
    # that add_request accepts must not fail the first step.
    engine = _engine()
    engine.add_request(EngineRequest("np", np.array([1, 2, 3]), priority=np.int64(2)))
    for _ in range(20):  # bounded: 16 tokens by default
        if not engine.has_work():
            break
        engine.step()
    assert engine.stats().num_finished == 1
