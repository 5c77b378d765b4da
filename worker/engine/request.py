"""A request's mutable state inside the scheduler, and request validation.

Pure: imports neither asyncio, grpc, torch nor a clock.

Buffers, in one picture (``n`` = context length = prompt + generated so far)::

    token_buf [ prompt ............ | generated ...... | unused ]
                0                   prompt_len         n        capacity
    slot_buf  [ KV slot of each computed token | unused ......... ]
                0                              num_computed      capacity

    num_computed <= n - 1 while decoding: the last sampled token's KV is written by the next
    decode step. ``cache_req.token_ids`` / ``cache_req.slots`` are views of the first
    ``num_computed`` entries, so the cache always sees exactly the computed KV.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from kvroute_proto.events import Partition
from kvroute_proto.hashing import block_hashes
from worker.cache.base import CacheReq
from worker.engine.engine_config import EngineConfig
from worker.engine.types import EngineRequest, SamplingParams
from worker.errors import InvalidRequestError

_I64 = np.int64
MAX_ROUTING_KEY_CHARS = 256


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted; some of its context still to compute
    DECODING = "decoding"
    FINISHED = "finished"


class Req:
    """One in-flight request (the scheduler owns it; never shared across threads)."""

    __slots__ = (
        "_hashes",
        "_hashes_len",
        "arrival_time",
        "cache_req",
        "cached_prompt_tokens",
        "est_match",
        "est_node",
        "match_version",
        "max_new_tokens",
        "num_computed",
        "num_tokens",
        "output_ids",
        "partition",
        "partition_seed",
        "priority",
        "prompt_len",
        "queue_shared",
        "request_id",
        "requeued",
        "routing_key",
        "sampling",
        "seq",
        "slot_buf",
        "status",
        "stop_ids",
        "token_buf",
    )

    def __init__(
        self,
        req: EngineRequest,
        seq: int,
        max_new_tokens: int,
        root: object,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``eos_token_ids``: the model's EOS ids this request stops on (empty when its
        sampling sets ``ignore_eos``); they join ``stop_ids`` with its stop_token_ids."""
        prompt = req.prompt_token_ids
        self.request_id = req.request_id
        self.sampling = req.sampling
        self.partition = req.partition
        self.partition_seed = req.partition.seed
        self.priority = int(req.priority)  # validated: an int or a numpy integer
        self.routing_key = req.routing_key
        self.arrival_time = req.arrival_time
        self.seq = seq
        self.max_new_tokens = max_new_tokens
        self.prompt_len = n = len(prompt)
        capacity = n + max_new_tokens
        self.token_buf = np.empty(capacity, dtype=_I64)
        self.token_buf[:n] = prompt
        self.slot_buf = np.empty(capacity, dtype=_I64)
        self.num_tokens = n
        self.num_computed = 0
        self.output_ids: list[int] = []
        self.stop_ids = frozenset(req.sampling.stop_token_ids) | eos_token_ids
        self.cache_req = CacheReq(
            token_ids=self.token_buf[:0],
            slots=self.slot_buf[:0],
            last_node=root,
            partition=req.partition,
            priority=self.priority,
        )
        self.cached_prompt_tokens: int | None = None  # set at first admission
        self.status = ReqStatus.WAITING
        self.requeued = False
        # LPM estimate of the cached prefix, valid while match_version is current.
        self.est_match = 0
        self.est_node: object = root  # the deepest matched node of that estimate
        self.match_version = -1
        # Whole-block tokens shared with contexts queued ahead of it when it (re)joined the
        # waiting queue: computed before it is admitted (the queued-prefill report).
        self.queue_shared = 0
        self._hashes: np.ndarray | None = None
        self._hashes_len = -1

    @property
    def context(self) -> np.ndarray:
        """Prompt + generated tokens (a view)."""
        return self.token_buf[: self.num_tokens]

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    def context_hashes(self, block_size: int) -> np.ndarray:
        """Block hashes of the context's full blocks (cached until the context changes)."""
        if self._hashes_len != self.num_tokens:
            self._hashes = block_hashes(
                self.token_buf[: self.num_tokens].view(np.uint64),
                block_size,
                self.partition_seed,
                validate=False,
            )
            self._hashes_len = self.num_tokens
        return self._hashes  # type: ignore[return-value]

    def sync_cache_views(self) -> None:
        """Point cache_req at the computed prefix of the buffers (after a forward), copying
        back slots the cache replaced with the tree's copies."""
        cr = self.cache_req
        k = self.num_computed
        slots = cr.slots
        if slots.base is not self.slot_buf and len(slots):
            self.slot_buf[: len(slots)] = slots
        cr.token_ids = self.token_buf[:k]
        cr.slots = self.slot_buf[:k]

    def reset_cache_state(self, root: object) -> None:
        """After cache_finished_req: the request owns no KV and holds no lock."""
        cr = self.cache_req
        cr.token_ids = self.token_buf[:0]
        cr.slots = self.slot_buf[:0]
        cr.last_node = root
        cr.num_tree_tokens = 0
        self.num_computed = 0


def validate_request(
    req: EngineRequest,
    config: EngineConfig,
    vocab_size: int,
    max_context_tokens: int,
) -> int:
    """Check a request against the engine's limits; returns the effective max_new_tokens.

    Raises InvalidRequestError naming the field and the limit.
    """
    if not isinstance(req.request_id, str) or not req.request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    prompt = req.prompt_token_ids
    if not isinstance(prompt, np.ndarray) or prompt.ndim != 1:
        raise InvalidRequestError("prompt_token_ids", "must be a 1-D numpy int array")
    if prompt.dtype.kind not in "iu":
        raise InvalidRequestError("prompt_token_ids", f"must hold integers, got {prompt.dtype}")
    n = len(prompt)
    if n == 0:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        bad = int(np.flatnonzero((prompt < 0) | (prompt >= vocab_size))[0])
        raise InvalidRequestError(
            "prompt_token_ids",
            f"token id {int(prompt[bad])} at position {bad} is outside [0, {vocab_size})",
        )
    if not _is_int(req.priority):
        raise InvalidRequestError("priority", f"must be an integer, got {req.priority!r}")
    key = req.routing_key
    if not isinstance(key, str) or len(key) > MAX_ROUTING_KEY_CHARS:
        raise InvalidRequestError(
            "routing_key",
            f"must be a string of at most {MAX_ROUTING_KEY_CHARS} characters, got "
            + (f"{len(key)} characters" if isinstance(key, str) else type(key).__name__),
        )
    if not isinstance(req.partition, Partition):
        raise InvalidRequestError(
            "partition", f"must be a Partition, got {type(req.partition).__name__}"
        )
    max_new = _validate_sampling(req.sampling, vocab_size)
    if max_new is None:  # what is left of the context, as much as the KV pool can ever hold
        if n >= max_context_tokens:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"prompt ({n} tokens) leaves no room to generate in "
                f"max_context_tokens={max_context_tokens}",
            )
        max_new = min(max_context_tokens - n, config.num_kv_slots - n + 1)
    if n + max_new > max_context_tokens:
        if not config.clamp_max_new_tokens or n >= max_context_tokens:
            field = "prompt_token_ids" if n >= max_context_tokens else "max_new_tokens"
            raise InvalidRequestError(
                field,
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds "
                f"max_context_tokens={max_context_tokens}",
            )
        max_new = max_context_tokens - n
    # The last generated token never needs KV: a request needs n + max_new - 1 slots at most.
    if n + max_new - 1 > config.num_kv_slots:
        field = "prompt_token_ids" if n > config.num_kv_slots else "max_new_tokens"
        raise InvalidRequestError(
            field,
            f"prompt ({n} tokens) + max_new_tokens ({max_new}) can never fit the KV pool of "
            f"num_kv_slots={config.num_kv_slots} tokens",
        )
    return max_new


def _validate_sampling(sp: SamplingParams, vocab_size: int) -> int | None:
    if sp.max_new_tokens is not None and (not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1):
        raise InvalidRequestError(
            "max_new_tokens", f"must be an integer >= 1, got {sp.max_new_tokens!r}"
        )
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise InvalidRequestError(
            "temperature", f"must be a finite number >= 0, got {sp.temperature}"
        )
    if not (0.0 < sp.top_p <= 1.0):
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {sp.top_p}")
    if not _is_int(sp.top_k) or sp.top_k < 0:
        raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {sp.top_k!r}")
    biased = [t for t, _ in sp.logit_bias]
    for name, ids in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", biased)):
        for t in ids:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(name, f"token id {t} is outside [0, {vocab_size})")
    return None if sp.max_new_tokens is None else int(sp.max_new_tokens)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def reserve_tokens(req: Req, ratio: float) -> int:
    """KV tokens admission keeps aside for ``req``'s future decode steps."""
    if ratio == 0.0:
        return 0
    remaining = req.max_new_tokens - len(req.output_ids)
    return math.ceil(min(remaining, 4096) * ratio)
