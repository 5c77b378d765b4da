"""Unit tests of the protobuf <-> engine conversion."""

from __future__ import annotations

import numpy as np
import pytest

from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.events import LoadReport, Partition
from worker.engine.tokenizer import ByteTokenizer
from worker.engine.types import FinishReason, SamplingParams, Usage
from worker.errors import InvalidRequestError
from worker.service import convert
from worker.service.convert import WorkerInfo

LIMITS = RequestLimits(default_max_new_tokens=32, max_prompt_text_chars=10)


def decode(msg: pb.GenerateRequest, tokenizer=None):
    return convert.request_from_pb(
        msg, tokenizer=tokenizer, limits=LIMITS, new_request_id=lambda: "fresh"
    )


def test_zero_means_default_or_off() -> None:
    req = decode(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2])))
    assert req.request_id == "fresh"
    assert req.sampling == SamplingParams(max_new_tokens=32, top_p=1.0)
    assert req.prompt_token_ids.dtype == np.int64
    assert req.prompt_token_ids.tolist() == [1, 2]
    assert (req.partition, req.priority) == (Partition(), 0)


def test_every_field_is_carried() -> None:
    msg = pb.GenerateRequest(
        request_id="r",
        prompt_text="héllo",
        sampling=pb.SamplingParams(
            max_new_tokens=5, temperature=0.5, top_p=0.25, top_k=7, seed=0,
            stop_token_ids=[9, 10], ignore_eos=True,
        ),
        partition=pb.Partition(cache_salt="t", extra_key="lora"),
        priority=-3,
    )  # fmt: skip
    req = decode(msg, ByteTokenizer())
    assert req.request_id == "r"
    assert req.prompt_token_ids.tolist() == list("héllo".encode())
    assert req.sampling == SamplingParams(5, 0.5, 0.25, 7, 0, (9, 10), True)
    assert (req.partition, req.priority) == (Partition("t", "lora"), -3)


def test_text_limit_counts_characters() -> None:
    assert len(decode(pb.GenerateRequest(prompt_text="é" * 10), ByteTokenizer()).prompt_token_ids)
    with pytest.raises(InvalidRequestError, match="at most 10 characters, got 11") as info:
        decode(pb.GenerateRequest(prompt_text="é" * 11), ByteTokenizer())
    assert info.value.field == "prompt_text"


def test_finished_and_chunk_encoding() -> None:
    msg = convert.finished_to_pb("r", FinishReason.MAX_CONTEXT, Usage(5, 4, 2), "w")
    assert msg.request_id == "r" and msg.finished.reason == pb.FINISH_REASON_MAX_CONTEXT
    assert (msg.finished.usage.prompt_tokens, msg.finished.usage.cached_prompt_tokens) == (5, 4)
    assert msg.finished.worker_id == "w" and msg.finished.attempts == 0
    for reason in FinishReason:
        assert convert.finished_to_pb("r", reason, None, "w").finished.reason != 0
    chunk = convert.chunk_to_pb("r", (1, 2), "ab")
    assert list(chunk.chunk.token_ids) == [1, 2] and chunk.chunk.text == "ab"


def test_worker_info_encoding() -> None:
    info = WorkerInfo("w", 9, 16, 1, 4096, 8192, 260, "sim", LoadReport(num_waiting=3))
    msg = convert.worker_info_to_pb(info)
    assert (msg.worker_id, msg.epoch, msg.block_size, msg.kv_capacity_tokens) == ("w", 9, 16, 4096)
    assert (msg.max_context_tokens, msg.vocab_size, msg.executor) == (8192, 260, "sim")
    assert msg.load.num_waiting == 3


def test_a_text_suffix_is_tokenized_without_specials_and_appended() -> None:
    """What a router that tokenized only a text prompt's head sends: the head's ids, then
    the rest as text, encoded here with no special tokens (no second bos)."""
    tok = ByteTokenizer(add_bos=True)
    msg = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[tok.BOS, 104]), prompt_text_suffix="é!"
    )
    assert decode(msg, tok).prompt_token_ids.tolist() == [tok.BOS, 104, 0xC3, 0xA9, 33]
    assert decode(msg, tok).prompt_token_ids.tolist() == tok.encode("hé!")


@pytest.mark.parametrize(
    ("msg", "tokenizer", "message"),
    [
        (
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), prompt_text_suffix="x"),
            None,
            "prompt_text_suffix.*no tokenizer",
        ),
        (
            pb.GenerateRequest(prompt_text="a", prompt_text_suffix="x"),
            ByteTokenizer(),
            "prompt_text_suffix.*only follows prompt_token_ids",
        ),
        (
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), prompt_text_suffix="y" * 11),
            ByteTokenizer(),
            "prompt_text_suffix.*at most 10 characters, got 11",
        ),
    ],
)
def test_a_text_suffix_is_refused_with_the_field_named(msg, tokenizer, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        decode(msg, tokenizer)


def test_a_rendered_chat_is_encoded_by_the_templates_rule() -> None:
    """prompt_text_is_chat: the text is a rendered template; a model's template writes its
    own bos (none added), the default template writes none (encode's are added)."""
    from bench.bpe import BOS, CHAT_TEMPLATE, EOS, train_bpe
    from edge.tokenizer import HFTokenizer, TokenizerSettings

    limits = RequestLimits(max_prompt_text_chars=10_000)
    for template in (CHAT_TEMPLATE, None):
        tok = HFTokenizer(
            train_bpe(512, seed=0),
            settings=TokenizerSettings(
                bos_token=BOS, eos_token=EOS, add_bos_token=True, chat_template=template
            ),
        )
        messages = [{"role": "user", "content": "Where is my order?"}]
        msg = pb.GenerateRequest(
            prompt_text=tok.apply_chat_template(messages), prompt_text_is_chat=True
        )
        req = convert.request_from_pb(msg, tokenizer=tok, limits=limits, new_request_id=str)
        assert req.prompt_token_ids.tolist() == tok.encode_chat(messages)
    # a byte tokenizer has no template rule: encoded as plain text
    byte = pb.GenerateRequest(prompt_text="hi", prompt_text_is_chat=True)
    assert decode(byte, ByteTokenizer()).prompt_token_ids.tolist() == [104, 105]
    with pytest.raises(InvalidRequestError, match="prompt_text_is_chat"):
        decode(
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), prompt_text_is_chat=True),
            ByteTokenizer(),
        )
