"""The simulated executor: the same scheduler, cache and events as the torch executor, with the
model math replaced by a cost model and deterministic tokens.

Pure: imports neither asyncio, grpc, torch nor a clock. It never reads time: the step cost is
*modelled* (:attr:`SimCostModel`), and a replay simulator advances its virtual clock by
``Engine.last_step_cost_s`` after each ``step()``.

Cost model (Llama-3-8B, bf16, one H100 SXM; derived, not measured)::

    prefill(c tokens at positions p .. p+c)  = c * prefill_s_per_token
                                             + (c*p + c*c/2) * prefill_s_per_attn_pair
    decode(batch of b, contexts n_1 .. n_b)  = decode_base_s
                                             + b * decode_s_per_seq
                                             + sum(n_i) * decode_s_per_context_token
    step                                     = step_overhead_s (if anything ran)
                                             + sum(prefill items) + decode(batch)

* ``prefill_s_per_token`` = 2 * 8.0e9 FLOP / 400 TFLOP/s achieved = 40 us (the weight GEMMs).
* ``prefill_s_per_attn_pair`` = 4 * 32 layers * 4096 * 2 FLOP / 400 TFLOP/s ~= 1.31 ns (QK^T
  and AV per query/key pair). An 8,192-token cold prefill costs 328 ms + 44 ms = 372 ms,
  i.e. ~22,000 tokens/s -- the figure docs/ARCHITECTURE.md uses.
* ``decode_base_s`` = 8 ms: streaming 16 GB of weights at ~2.5 TB/s achieved HBM bandwidth,
  plus launch overhead. ``decode_s_per_context_token`` = 128 KiB of KV per token / 2.5 TB/s
  ~= 52 ns, rounded to 60 ns. ``decode_s_per_seq`` = 0.1 ms (sampling and per-row work).
  A batch of 32 at 2k context: 8 + 3.2 + 3.9 ~= 15 ms; 64 at 4k: ~30 ms ("tens of ms").

Tokens: ``token(request, k)`` for the k-th generated token is a 64-bit hash of the request's
``sampling.seed`` (or, without one, its ``request_id``) and ``k``, folded into
``[0, vocab_size)``. It never equals ``eos_token_id`` unless ``eos_at`` asks for it, and it is
the same whether the request ran straight through or was retracted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from worker.engine.types import ForwardItem


@dataclass(frozen=True, slots=True)
class SimCostModel:
    """Per-step cost coefficients (seconds); see the module docstring for the derivation."""

    prefill_s_per_token: float = 40e-6
    prefill_s_per_attn_pair: float = 1.31e-9
    decode_base_s: float = 8e-3
    decode_s_per_seq: float = 1e-4
    decode_s_per_context_token: float = 6e-8
    step_overhead_s: float = 0.0

    @classmethod
    def zero(cls) -> SimCostModel:
        """Every cost 0: pure scheduling throughput (the scheduling benchmark)."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def prefill_cost_s(self, num_tokens: int, start_pos: int) -> float:
        """Modelled time of prefilling ``num_tokens`` tokens after ``start_pos`` cached ones."""
        pairs = num_tokens * start_pos + num_tokens * num_tokens / 2
        return num_tokens * self.prefill_s_per_token + pairs * self.prefill_s_per_attn_pair

    def decode_cost_s(self, batch_size: int, num_context_tokens: int) -> float:
        """Modelled time of one decode step over ``batch_size`` sequences whose contexts sum
        to ``num_context_tokens``."""
        if batch_size == 0:
            return 0.0
        return (
            self.decode_base_s
            + batch_size * self.decode_s_per_seq
            + num_context_tokens * self.decode_s_per_context_token
        )


@dataclass(frozen=True, slots=True)
class SimExecutorConfig:
    """What the simulated model looks like from outside (Llama-3-8B defaults)."""

    vocab_size: int = 128256
    max_context_tokens: int = 8192
    eos_token_id: int | None = None
    eos_at: int | None = None  # emit eos as the eos_at-th generated token (0-based); None: never

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {self.max_context_tokens}")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"eos_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.eos_token_id}"
            )
        if self.eos_at is not None and (self.eos_at < 0 or self.eos_token_id is None):
            raise ValueError("eos_at must be >= 0 and needs an eos_token_id")


class SimExecutor:
    """An :class:`~worker.engine.types.Executor` with no model: modelled cost, hashed tokens."""

    def __init__(
        self, cost_model: SimCostModel | None = None, config: SimExecutorConfig | None = None
    ) -> None:
        self.cost_model = cost_model if cost_model is not None else SimCostModel()
        self.config = config if config is not None else SimExecutorConfig()
        self.vocab_size = self.config.vocab_size
        self.max_context_tokens = self.config.max_context_tokens
        self.eos_token_id = self.config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (
            () if self.eos_token_id is None else (self.eos_token_id,)
        )
        self._zero_cost = self.cost_model == SimCostModel.zero()

    def token_for(self, item: ForwardItem) -> int:
        """The deterministic token an item samples (-1 when it does not sample)."""
        if not item.sample:
            return -1
        k = item.num_generated
        cfg = self.config
        if cfg.eos_at is not None and k == cfg.eos_at:
            return cfg.eos_token_id  # type: ignore[return-value]
        seed = item.sampling.seed
        key = f"s{seed}" if seed is not None else f"r{item.request_id}"
        h = xxhash.xxh3_64_intdigest(key.encode() + k.to_bytes(8, "little"))
        eos = cfg.eos_token_id
        if eos is None:
            return h % cfg.vocab_size
        # Draw from the vocab minus eos, then skip over eos.
        t = h % (cfg.vocab_size - 1)
        return t + 1 if t >= eos else t

    def forward(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> list[int]:
        """One token per item, prefill items first (-1 for a non-final prefill chunk)."""
        token_for = self.token_for
        return [token_for(item) for item in prefill] + [token_for(item) for item in decode]

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float:
        """Modelled seconds of the step that ran ``prefill`` and ``decode`` together."""
        if self._zero_cost or not (prefill or decode):
            return 0.0
        cm = self.cost_model
        cost = cm.step_overhead_s
        for item in prefill:
            cost += cm.prefill_cost_s(len(item.token_ids), item.start_pos)
        if decode:
            # A decode item attends to its whole context, the new token included.
            ctx = sum(item.start_pos + 1 for item in decode)
            cost += cm.decode_cost_s(len(decode), ctx)
        return cost
