"""The simulated executor: the same scheduler, cache and events as the torch executor, with the
model math replaced by a cost model and deterministic tokens.

Pure: imports neither asyncio, grpc, torch nor a clock. It never reads time: the step cost is
*modelled* (:attr:`SimCostModel`), and a replay simulator advances its virtual clock by
``Engine.last_step_cost_s`` after each ``step()``.

Cost model, default profile ``h100`` (Llama-3-8B, bf16, one H100 SXM, a well-tuned engine;
derived, not measured)::

    prefill(c tokens at positions p .. p+c)  = c * prefill_s_per_token
                                             + p * prefill_s_per_context_token
                                             + (c*p + c*c/2) * prefill_s_per_attn_pair
    decode(batch of b, contexts n_1 .. n_b)  = decode_base_s
                                             + b * decode_s_per_seq
                                             + sum(n_i) * decode_s_per_context_token
    step                                     = step_overhead_s (if anything ran)
                                             + max(weight_read_s,
                                                   sum(prefill items) + decode(batch))

* ``prefill_s_per_token`` = 2 * 8.0e9 FLOP / 400 TFLOP/s achieved = 40 us (the weight GEMMs).
* ``prefill_s_per_attn_pair`` = 4 * 32 layers * 4096 * 2 FLOP / 400 TFLOP/s ~= 1.31 ns (QK^T
  and AV per query/key pair). An 8,192-token cold prefill costs 328 ms + 44 ms = 372 ms,
  i.e. ~22,000 tokens/s -- the figure docs/ARCHITECTURE.md uses.
* ``decode_base_s`` = 8 ms: streaming 16 GB of weights at ~2.5 TB/s achieved HBM bandwidth,
  plus launch overhead. ``decode_s_per_context_token`` = 128 KiB of KV per token / 2.5 TB/s
  ~= 52 ns, rounded to 60 ns. ``decode_s_per_seq`` = 0.1 ms (sampling and per-row work).
  A batch of 32 at 2k context: 8 + 3.2 + 3.9 ~= 15 ms; 64 at 4k: ~30 ms ("tens of ms").
* ``prefill_s_per_context_token`` = 0: a tuned engine attends to cached KV in place.
* ``weight_read_s`` = 16.06 GB of bf16 weights (8.03 B parameters x 2 bytes) / 3.35 TB/s
  (the H100 SXM's peak HBM bandwidth) = 4.79 ms: every forward pass reads every weight once,
  so no step is faster, however few tokens it prefills (a 64-token suffix prefill, 2.6 ms of
  GEMM work, costs 4.79 ms). A decode step (8 ms base) is above it already; it binds short
  prefill-only steps. Peak, not achieved, bandwidth: a floor, not an estimate.

Other profiles (:data:`COST_PROFILES`, ``kvroute replay --cost-profile``): ``kvroute-h200``,
our own torch executor as issue 14 measured it on one H200 (launch- and gather-bound);
``kvroute-h200-fused``, the same executor after that issue's work (paged attention, fused
kernels, CUDA-graph decode: its defaults on CUDA), measured on one H200 on 2026-12-04; and
any ``bench/bench_gpu.py --json`` output, fitted by :meth:`SimCostModel.from_bench_gpu`.

Tokens: ``token(request, k)`` for the k-th generated token is a 64-bit hash of the request's
``sampling.seed`` (or, without one, its ``request_id``) and ``k``, folded into
``[0, vocab_size)``. It never equals ``eos_token_id`` unless ``eos_at`` asks for it, and it is
the same whether the request ran straight through or was retracted and recomputed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import xxhash

from worker.engine.types import ForwardItem, TokenLogprobs

# One pass over Llama-3-8B's bf16 weights at the H100 SXM's peak HBM bandwidth
LLAMA3_8B_PARAM_BYTES = 8.03e9 * 2
H100_HBM_BYTES_PER_S = 3.35e12
H100_LLAMA3_8B_WEIGHT_READ_S = LLAMA3_8B_PARAM_BYTES / H100_HBM_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class SimCostModel:
    """Per-step cost coefficients (seconds); see the module docstring for the derivation."""

    prefill_s_per_token: float = 40e-6
    prefill_s_per_attn_pair: float = 1.31e-9
    decode_base_s: float = 8e-3
    decode_s_per_seq: float = 1e-4
    decode_s_per_context_token: float = 6e-8
    step_overhead_s: float = 0.0
    prefill_s_per_context_token: float = 0.0  # reading each cached token's KV (a gather)
    weight_read_s: float = 0.0  # no step is shorter; H100_LLAMA3_8B_WEIGHT_READ_S (module doc)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0.0:  # also rejects NaN
                raise ValueError(f"SimCostModel.{f.name} must be >= 0, got {value}")

    def step_profile_s(self) -> tuple[float, float, float, float]:
        """(decode base, per sequence, per context token, per prefill token) in seconds: the
        step profile a worker states in ``WorkerInfo`` (the router's decode-time term)."""
        return (
            self.decode_base_s + self.step_overhead_s,
            self.decode_s_per_seq,
            self.decode_s_per_context_token,
            self.prefill_s_per_token,
        )

    @classmethod
    def zero(cls) -> SimCostModel:
        """Every cost 0: pure scheduling throughput (the scheduling benchmark)."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    @classmethod
    def from_bench_gpu(cls, result: dict) -> SimCostModel:
        """Fit the model to a ``bench/bench_gpu.py --json`` result (full or smoke mode).

        Every step pays a fixed floor (``step_overhead_s``): the batch-1 decode step minus
        one request's share. Decode: the per-request cost is the slope between batch 1 and
        the largest batch, spread over the context (``decode_s_per_context_token``). Prefill:
        the two cold prefills give ``prefill_s_per_token`` and ``prefill_s_per_attn_pair``,
        the cached step what is left for reading the cached KV. A coefficient the data
        would make negative is 0."""
        steps = {m["name"]: float(m["median_s"]) for m in result["steps"]}
        decodes = sorted(
            (int(name.removeprefix("decode_b")), t)
            for name, t in steps.items()
            if name.startswith("decode_b")
        )
        colds = sorted(
            (int(name.removeprefix("prefill_cold_")), t)
            for name, t in steps.items()
            if name.startswith("prefill_cold_")
        )
        cached = [n for n in steps if n.startswith("prefill_cached_")]
        if len(decodes) < 2 or len(colds) < 2 or len(cached) != 1:
            raise ValueError(
                "bench_gpu result: need decode_b* at two batch sizes, prefill_cold_* at two "
                f"lengths and one prefill_cached_*; got steps {sorted(steps)}"
            )
        ctx = int(result["decode_context"])
        (b1, t1), (bn, tn) = decodes[0], decodes[-1]
        per_req = max((tn - t1) / (bn - b1), 0.0)
        floor = max(t1 - b1 * per_req, 0.0)
        (l1, c1), (l2, c2) = colds[0], colds[-1]
        # c_i - floor = l_i * tok + l_i^2 / 2 * attn  (2x2 linear system)
        y1, y2 = c1 - floor, c2 - floor
        det = l1 * l2 * l2 / 2 - l2 * l1 * l1 / 2
        attn = max((l1 * y2 - l2 * y1) / det, 0.0)
        tok = max((y1 - l1 * l1 / 2 * attn) / l1, 0.0)
        new_s, _, prefix_s = cached[0].removeprefix("prefill_cached_").partition("_after_")
        new, prefix = int(new_s), int(prefix_s)
        rest = steps[cached[0]] - floor - new * tok - (new * prefix + new * new / 2) * attn
        return cls(
            prefill_s_per_token=tok,
            prefill_s_per_attn_pair=attn,
            decode_base_s=0.0,
            decode_s_per_seq=0.0,
            decode_s_per_context_token=per_req / ctx,
            step_overhead_s=floor,
            prefill_s_per_context_token=max(rest / prefix, 0.0),
            weight_read_s=0.0,  # the measured floor is step_overhead_s
        )

    def prefill_cost_s(self, num_tokens: int, start_pos: int) -> float:
        """Modelled time of prefilling ``num_tokens`` tokens after ``start_pos`` cached ones."""
        pairs = num_tokens * start_pos + num_tokens * num_tokens / 2
        return (
            num_tokens * self.prefill_s_per_token
            + start_pos * self.prefill_s_per_context_token
            + pairs * self.prefill_s_per_attn_pair
        )

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


# Issue 14's measurements of our torch executor on one H200 (Llama-3-8B shape, bf16):
# decode at 2k context 65 ms (batch 1) / 81 ms (batch 128); cold prefill of 8,064 tokens
# 1.80 s; 64 new tokens after 8,000 cached 152 ms. No 2k cold point was measured, so the
# attention coefficient is the h100 profile's; the rest is fitted as from_bench_gpu does.
_KVROUTE_H200_FLOOR = 0.065 - (0.081 - 0.065) / 127
_KVROUTE_H200_TOK = (1.80 - _KVROUTE_H200_FLOOR - 8064 * 8064 / 2 * 1.31e-9) / 8064

# bench_gpu on one H200, 2026-12-04 (bench/results/gpu/h200_2026-12-04_5_graphs_fused.json),
# after issue 14's work, as the torch executor runs by default on CUDA: paged attention with
# the fused Triton kernels, cold prefills eagerly (column paged+fused), decode and the lone
# cached-prefix step as CUDA graph replays (paged+graphs+fused). Medians in seconds; fitted
# as from_bench_gpu fits.
_KVROUTE_H200_FUSED_STEPS = {
    "prefill_cold_2048": 0.051203,
    "prefill_cold_8064": 0.260010,
    "prefill_cached_64_after_8000": 0.008005,
    "decode_b1": 0.005087,
    "decode_b128": 0.015388,
}

COST_PROFILES: dict[str, SimCostModel] = {
    "h100": SimCostModel(),
    "kvroute-h200": SimCostModel(
        prefill_s_per_token=_KVROUTE_H200_TOK,
        prefill_s_per_attn_pair=1.31e-9,
        decode_base_s=0.0,
        decode_s_per_seq=0.0,
        decode_s_per_context_token=(0.081 - 0.065) / 127 / 2048,
        step_overhead_s=_KVROUTE_H200_FLOOR,
        prefill_s_per_context_token=(
            0.152
            - _KVROUTE_H200_FLOOR
            - 64 * _KVROUTE_H200_TOK
            - (64 * 8000 + 64 * 64 / 2) * 1.31e-9
        )
        / 8000,
        weight_read_s=0.0,  # measured: its floor is step_overhead_s (65 ms)
    ),
    "kvroute-h200-fused": SimCostModel.from_bench_gpu(
        {
            "steps": [{"name": k, "median_s": v} for k, v in _KVROUTE_H200_FUSED_STEPS.items()],
            "decode_context": 2048,
        }
    ),
}


def cost_profile(name_or_path: str) -> SimCostModel:
    """A profile of :data:`COST_PROFILES` by name, or a ``bench_gpu --json`` file fitted by
    :meth:`SimCostModel.from_bench_gpu`. ValueError names the choices."""
    if name_or_path in COST_PROFILES:
        return COST_PROFILES[name_or_path]
    if name_or_path.endswith(".json"):
        try:
            result = json.loads(Path(name_or_path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cost profile {name_or_path!r}: {exc}") from None
        return SimCostModel.from_bench_gpu(result)
    raise ValueError(
        f"cost profile must be one of {sorted(COST_PROFILES)} or a bench_gpu --json file, "
        f"got {name_or_path!r}"
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
        self._last: tuple[list[ForwardItem], list[ForwardItem], list[int]] = ([], [], [])
        self.num_steps = 0  # steps that ran something
        self.num_floor_steps = 0  # of them, steps whose work was under weight_read_s

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
        tokens = [token_for(item) for item in prefill] + [token_for(item) for item in decode]
        self._last = (prefill, decode, tokens)  # take_logprobs reads it, when asked
        return tokens

    def take_logprobs(self) -> dict[str, TokenLogprobs]:
        """The last forward's logprobs, by request id, of the items that asked: stand-ins
        (the sim has no distribution): every token of a uniform one, ln(1/vocab), the sampled
        token first among the top ones."""
        prefill, decode, tokens = self._last
        self._last = ([], [], [])
        return {
            item.request_id: self._stand_in(token, item.sampling.logprobs)
            for item, token in zip((*prefill, *decode), tokens, strict=True)
            if item.sampling.logprobs is not None and token >= 0
        }

    def _stand_in(self, token: int, top_k: int) -> TokenLogprobs:
        vocab = self.config.vocab_size
        lp = -math.log(vocab)
        top = [(token, lp)] + [((token + i) % vocab, lp) for i in range(1, min(top_k, vocab))]
        return TokenLogprobs(lp, tuple(top[:top_k]))

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float:
        """Modelled seconds of the step that ran ``prefill`` and ``decode`` together."""
        if self._zero_cost or not (prefill or decode):
            return 0.0
        cm = self.cost_model
        work = 0.0
        for item in prefill:
            work += cm.prefill_cost_s(len(item.token_ids), item.start_pos)
        if decode:
            # A decode item attends to its whole context, the new token included.
            ctx = sum(item.start_pos + 1 for item in decode)
            work += cm.decode_cost_s(len(decode), ctx)
        # the pass reads every weight once, however little it computes
        self.num_steps += 1
        if work < cm.weight_read_s:
            self.num_floor_steps += 1
            work = cm.weight_read_s
        return cm.step_overhead_s + work
