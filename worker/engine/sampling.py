"""Token sampling: logit bias and presence / frequency penalties, then greedy or temperature,
top-k, top-p, with per-request reproducible seeds.

A seeded request's token at generation step n depends only on its own logits row and
(seed, n): each sampled row gets its own ``torch.Generator`` seeded from a hash of the pair,
and rows are processed independently, so batch composition never changes the draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from worker.engine.types import SamplingParams, TokenLogprobs

# Below this temperature sampling is greedy: the float32 logits / temperature would overflow
# to inf (and softmax to NaN) long before a draw could differ from argmax.
MIN_SAMPLING_TEMPERATURE = 1e-5


def step_seed(seed: int, num_generated: int) -> int:
    """A 63-bit generator seed derived from (request seed, generation step)."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float32 logits of one row ([vocab]) with top-k / top-p cuts set to
    -inf. top_k <= 0 and top_p >= 1 disable the respective cut; at least one token survives."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from a [vocab] row by inverse CDF with one uniform from ``generator``."""
    probs = torch.softmax(filter_logits(logits.cpu(), params), dim=-1, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    token = int(torch.searchsorted(cdf, u.unsqueeze(0), right=True)[0])
    token = min(token, probs.shape[-1] - 1)
    # searchsorted never lands on a zero-probability token unless u hits an exact boundary;
    # step back to the last token with mass in that case.
    while probs[token] == 0.0 and token > 0:
        token -= 1
    return token


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, output_ids: np.ndarray | None
) -> torch.Tensor:
    """One row ([vocab]) with OpenAI's logit_bias added and its presence / frequency
    penalties subtracted for the tokens generated so far (``output_ids``): vLLM's rule."""
    row = logits.float().clone()
    if params.penalized and output_ids is not None and len(output_ids):
        ids = torch.as_tensor(np.asarray(output_ids, dtype=np.int64), device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[-1]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=row.device)
        row[ids] += torch.tensor([b for _, b in params.logit_bias], device=row.device)
    return row


def token_logprobs(row: torch.Tensor, token: int, top_k: int) -> TokenLogprobs:
    """``token``'s log probability in ``row`` ([vocab], after bias and penalties, before
    temperature, as vLLM reports them) and the ``top_k`` most likely tokens."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_k:
        values, ids = torch.topk(lp, min(top_k, lp.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(float(lp[token]), top)


class Sampler:
    """Turns logits rows into tokens. Unseeded requests draw from one generator seeded at
    construction (reproducible per process and call order, not per request)."""

    def __init__(self, seed: int = 0) -> None:
        self._unseeded = torch.Generator().manual_seed(seed)
        # row -> the sampled token's logprob and its step's top k, for rows that asked
        self.last_logprobs: dict[int, TokenLogprobs] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_generated: list[int],
        output_ids: Sequence[np.ndarray | None] | None = None,
    ) -> list[int]:
        """One token per row of ``logits`` [B, vocab] (float32, any device); ``output_ids``:
        each row's tokens generated so far (for the penalties; None where not penalized)."""
        if logits.shape[0] != len(params) or len(params) != len(num_generated):
            raise ValueError(
                f"sample: {logits.shape[0]} logits rows, {len(params)} params, "
                f"{len(num_generated)} step counts; they must match"
            )
        adjusted = [i for i, p in enumerate(params) if p.logit_bias or p.penalized]
        if adjusted:
            logits = logits.clone()
            for i in adjusted:
                history = None if output_ids is None else output_ids[i]
                logits[i] = adjust_logits(logits[i], params[i], history)
        tokens = self._pick(logits, params, num_generated)
        self.last_logprobs = {
            i: token_logprobs(logits[i], tokens[i], p.logprobs)
            for i, p in enumerate(params)
            if p.logprobs is not None
        }
        return tokens

    def _pick(
        self, logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]
    ) -> list[int]:
        tokens = [0] * len(params)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature < MIN_SAMPLING_TEMPERATURE]
        if greedy_rows:
            picked = torch.argmax(logits[greedy_rows], dim=-1).tolist()
            for row, token in zip(greedy_rows, picked, strict=True):
                tokens[row] = int(token)
        sampled_rows = [
            i for i, p in enumerate(params) if p.temperature >= MIN_SAMPLING_TEMPERATURE
        ]
        if not sampled_rows:
            return tokens
        host = logits[sampled_rows].float().cpu()  # one device->host copy for the batch
        for row, row_logits in zip(sampled_rows, host, strict=True):
            p, step = params[row], num_generated[row]
            if p.seed is None:
                gen = self._unseeded
            else:
                gen = torch.Generator().manual_seed(step_seed(p.seed, step))
            tokens[row] = sample_row(row_logits, p, gen)
        return tokens
