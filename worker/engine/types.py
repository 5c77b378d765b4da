"""Value types shared by the scheduler, the executors and the engine facade.

Pure: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, Partition


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Decoding settings of one request. temperature 0 means greedy; ``max_new_tokens``
    None means what is left of the context (OpenAI's and vLLM's chat default)."""

    max_new_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI's, on the tokens generated so far
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: off; k: each token's logprob and its step's top k

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens generated so far (ForwardItem.output_ids)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated request as the engine receives it."""

    request_id: str
    prompt_token_ids: np.ndarray  # int64, non-empty
    sampling: SamplingParams = field(default_factory=SamplingParams)
    partition: Partition = DEFAULT_PARTITION
    priority: int = 0
    arrival_time: float = 0.0
    routing_key: str = ""  # conversation / tenant key for the routing-key policy; "" = none


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    MAX_CONTEXT = "max_context"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log probability and its step's most likely (token id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set with finish_reason
    # on a request's first output: seconds from add_request to its first prefill step
    queue_wait_s: float | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per new token, when asked


@dataclass(frozen=True, slots=True)
class ForwardItem:
    """One request's slice of a forward pass.

    ``token_ids`` are the new tokens to run (a prefill chunk, or the single last token for
    decode) at absolute positions ``start_pos ..``. ``slots`` are the KV slots of the whole
    context, cached prefix included: ``slots[:start_pos]`` are read, ``slots[start_pos:]``
    are written. ``sample`` is False for a non-final prefill chunk (no token is produced).
    """

    request_id: str
    token_ids: np.ndarray
    start_pos: int
    slots: np.ndarray
    sampling: SamplingParams
    sample: bool = True
    num_generated: int = 0  # tokens generated so far (for per-request seeded sampling)
    output_ids: np.ndarray | None = None  # the tokens generated so far, when penalized


class Executor(Protocol):
    """Runs forward passes over the paged KV pool; returns one sampled token per item
    (-1 for an item with sample=False). ``step_cost_s`` is the time the step took or, for
    the simulated executor, the modelled time.

    ``eos_token_ids`` are every id that ends a sequence (a Llama-3-Instruct checkpoint lists
    both ``<|end_of_text|>`` and ``<|eot_id|>``; may be empty); generating any of them
    finishes a request unless its sampling sets ``ignore_eos``. ``eos_token_id`` is the
    first of them (None when there is none), for code that wants a single id."""

    vocab_size: int
    max_context_tokens: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def forward(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> list[int]: ...

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float: ...
