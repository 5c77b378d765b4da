"""A Llama-architecture decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
that reads and writes the paged KV pool.

Parameter names equal Hugging Face's ``LlamaForCausalLM`` state dict (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ..., ``model.norm``, ``lm_head``), so a checkpoint loads
with ``load_state_dict`` and ``save_hf`` writes one that ``transformers`` reads.

A forward pass runs one packed sequence of T new tokens from several requests:

    tokens: [ prefill item 0 (n0 tokens) | prefill item 1 (n1) | ... | decode (1 per item) ]

Projections and MLP run on all T tokens at once. Each layer first writes the new tokens' K/V
into their slots, then attends. How is the batch's ``attention``:

* "gather" (the original path): per request over the K/V gathered by slot index, a prefill
  item over ``slots[:start_pos + n]`` with a causal mask offset by ``start_pos`` (one SDPA
  per item), the decode items together over a padded [B, max_len] gather with a length mask;
* "torch" / "triton" (``paged_attention``): all prefill items in one packed (varlen)
  computation described by ``batch.prefill_plan``, and the decode items in one call that
  reads K/V through their slot table (the Triton kernels never gather).

The batch's ``fused`` picks how the elementwise ops around attention and MLP run: "off" (the
default) as separate torch ops; "torch" / "triton" (``fused_ops``) as one residual-add +
RMSNorm pass before each attention and MLP (the layers carry the residual and hand on their
last output unadded), one pass of RoPE over q and k (float32 cos/sin) that also writes the
step's K/V into the pool, and one SwiGLU pass.
The fused layers also run q/k/v as one matmul and gate/up as one (``fuse_projections``: each
layer's weights concatenated once, the HF-named parameters left as views into them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import fused_ops, paged_attention
from worker.engine.kv_pool import KVPool
from worker.engine.paged_attention import PrefillPlan

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rotary scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Architecture hyper-parameters (names follow HF ``config.json`` where they exist)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig.num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even, got {self.head_dim}")

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (None when there is none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None


def tiny_config(
    *,
    vocab_size: int = 512,
    eos_token_id: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> LlamaConfig:
    """The default model: small enough that tests and the CPU demo run in milliseconds.

    Give its end-of-sequence id as ``eos_token_id`` or, for several, ``eos_token_ids``."""
    if eos_token_id is not None and eos_token_ids:
        raise ValueError("tiny_config: give eos_token_id or eos_token_ids, not both")
    return LlamaConfig(
        vocab_size=vocab_size,
        eos_token_ids=(eos_token_id,) if eos_token_id is not None else tuple(eos_token_ids),
    )


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """Where one prefill item sits in the packed batch."""

    token_offset: int  # first row of this item's new tokens in the packed batch
    num_new: int
    start_pos: int  # absolute position of the first new token (= cached prefix length)
    ctx_slots: torch.Tensor  # int64 [start_pos + num_new]: every slot it attends to


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """The decode items: one new token each, rows ``token_offset .. token_offset + B``."""

    token_offset: int
    ctx_slots: torch.Tensor  # int64 [B, max_len], padded with a valid slot
    ctx_mask: torch.Tensor | None  # bool [B, 1, 1, max_len], True where a key is visible
    ctx_lens: torch.Tensor | None = None  # int32 [B] (paged attention)
    num_splits: int | None = None  # pieces the Triton decode kernel cuts a context into


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Inputs of one forward pass over the packed tokens."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    write_slots: torch.Tensor  # int64 [T]
    prefill: tuple[PrefillSeq, ...]  # "gather" only (empty with paged attention)
    decode: DecodeGroup | None
    logit_rows: torch.Tensor  # int64 [R]: rows whose logits are wanted
    attention: str = "gather"  # "gather", or a paged_attention implementation: torch, triton
    prefill_plan: PrefillPlan | None = None  # paged attention: the packed prefill items
    fused: str = "off"  # "off", or a fused_ops implementation: torch, triton
    prefill_splits: int | None = None  # the Triton prefill kernel's key splits (None: its own)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rmsnorm_torch(x, self.weight, self.eps)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float32, with llama3 scaling if set."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Concat:
    """Linears run as one matmul: their weights (and biases) concatenated along the output
    axis, each linear's parameters made a view into the concatenation, so a later in-place
    load (``load_state_dict``) updates both. A linear whose parameter was replaced instead
    (``.to(dtype)``, ``load_state_dict(assign=True)``) no longer points into it: ``current``
    then says so and the owner concatenates again."""

    def __init__(self, linears: tuple[nn.Linear, ...]) -> None:
        self.linears = linears
        with torch.no_grad():
            self.weight = torch.cat([m.weight.data for m in linears])
            biases = [m.bias for m in linears]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                raise ValueError("fuse_projections: the linears must all have a bias or none")
            self.bias = None
            if biases[0] is not None:
                self.bias = torch.cat([cast(torch.Tensor, b).data for b in biases])
            row = 0
            for m in linears:
                rows = slice(row, row + m.out_features)
                m.weight.data = self.weight[rows]
                if self.bias is not None:
                    cast(torch.Tensor, m.bias).data = self.bias[rows]
                row += m.out_features
        # Where each linear's weight starts inside the concatenation (a cheap check per step).
        self._ptrs = tuple(m.weight.data_ptr() for m in linears)

    def current(self) -> bool:
        return all(
            m.weight.data_ptr() == ptr for m, ptr in zip(self.linears, self._ptrs, strict=True)
        )

    @staticmethod
    def of(held: _Concat | None, linears: tuple[nn.Linear, ...]) -> _Concat:
        """``held`` while it is current, else a new concatenation of ``linears``."""
        return held if held is not None and held.current() else _Concat(linears)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self._qkv: _Concat | None = None  # q/k/v as one matmul (the fused layers)

    def fuse_projections(self) -> None:
        """Concatenate q/k/v for the fused layers (again only if a parameter was replaced)."""
        self._qkv = _Concat.of(self._qkv, (self.q_proj, self.k_proj, self.v_proj))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """SDPA with grouped-query heads: query head h reads kv head h // (heads / kv_heads).
        q: [B, heads, n, D]; k, v: [B, kv_heads, L, D]."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1 and _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale, enable_gqa=True
            )
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        t = x.shape[0]
        hd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if batch.fused == "off":  # cos/sin [T, 1, D] in the weights' dtype
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        else:  # one matmul; cos/sin float32 [T, D / 2]; RoPE below, with the pool write
            qkv = self._qkv
            assert qkv is not None, "fused layers need fuse_projections() first"
            q, k, v = F.linear(x, qkv.weight, qkv.bias).split((hd, kvd, kvd), dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
        # Write first, then read: every item's context (new tokens included) is in the pool.
        if batch.fused == "off":
            pool.write(self.layer_idx, batch.write_slots, k, v)
        else:  # RoPE and the pool write in one pass
            k_cache, v_cache = pool.k[self.layer_idx], pool.v[self.layer_idx]
            slots = batch.write_slots
            fused_ops.rope_write_(batch.fused, q, k, v, cos, sin, k_cache, v_cache, slots)
        if batch.attention == "gather":
            out = self._gathered(q, batch, pool)
        else:
            out = self._paged(q, batch, pool)
        return self.o_proj(out.reshape(t, hd))

    def _paged(self, q: torch.Tensor, batch: PagedBatch, pool: KVPool) -> torch.Tensor:
        """Attention through ``paged_attention``: one packed prefill call, one decode call."""
        k_cache, v_cache = pool.k[self.layer_idx], pool.v[self.layer_idx]
        parts = []
        plan = batch.prefill_plan
        if plan is not None:
            qp = q[: plan.num_tokens]
            parts.append(
                paged_attention.prefill(
                    batch.attention,
                    qp,
                    k_cache,
                    v_cache,
                    plan,
                    self.scale,
                    num_splits=batch.prefill_splits,
                )
            )
        group = batch.decode
        if group is not None:
            assert group.ctx_lens is not None, "paged decode needs DecodeGroup.ctx_lens"
            rows = slice(group.token_offset, group.token_offset + group.ctx_slots.shape[0])
            parts.append(
                paged_attention.decode(
                    batch.attention,
                    q[rows],
                    k_cache,
                    v_cache,
                    group.ctx_slots,
                    group.ctx_lens,
                    self.scale,
                    num_splits=group.num_splits,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _gathered(self, q: torch.Tensor, batch: PagedBatch, pool: KVPool) -> torch.Tensor:
        """The original path: gather each request's K/V, SDPA per prefill item and once over
        the padded decode group."""
        out = torch.empty_like(q)
        for seq in batch.prefill:
            rows = slice(seq.token_offset, seq.token_offset + seq.num_new)
            ks, vs = pool.gather(self.layer_idx, seq.ctx_slots)  # [L, kvh, D]
            qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = ks.transpose(0, 1).unsqueeze(0)  # [1, kvh, L, D]
            vi = vs.transpose(0, 1).unsqueeze(0)
            if seq.start_pos == 0:
                oi = self._attend(qi, ki, vi, is_causal=True)
            else:
                # Query i (absolute position start_pos + i) sees keys 0 .. start_pos + i.
                key_pos = torch.arange(ks.shape[0], device=q.device)
                query_pos = seq.start_pos + torch.arange(seq.num_new, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                oi = self._attend(qi, ki, vi, attn_mask=mask)
            out[rows] = oi[0].transpose(0, 1)

        group = batch.decode
        if group is not None:
            bsz = group.ctx_slots.shape[0]
            rows = slice(group.token_offset, group.token_offset + bsz)
            ks, vs = pool.gather(self.layer_idx, group.ctx_slots)  # [B, L, kvh, D]
            qd = q[rows].unsqueeze(2)  # [B, H, 1, D]
            kd, vd = ks.transpose(1, 2), vs.transpose(1, 2)  # [B, kvh, L, D]
            od = self._attend(qd, kd, vd, attn_mask=group.ctx_mask)
            out[rows] = od.squeeze(2)
        return out


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self._gate_up: _Concat | None = None  # gate/up as one matmul (the fused layers)

    def fuse_projections(self) -> None:
        """Concatenate gate/up for the fused layers (again only if a parameter was replaced)."""
        self._gate_up = _Concat.of(self._gate_up, (self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        """gate and up as one matmul, silu(gate) * up in one pass (``fused_ops.silu_mul``)."""
        gate_up = self._gate_up
        assert gate_up is not None, "fused layers need fuse_projections() first"
        h = fused_ops.silu_mul(impl, F.linear(x, gate_up.weight, gate_up.bias))
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
        pool: KVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its adds fused into the norms (``batch.fused`` "torch"/"triton"):
        the stream so far is ``residual + delta`` (no delta before the first layer); returns
        (residual, delta) after this layer, the MLP's output not yet added."""
        impl = batch.fused
        norm = self.input_layernorm
        residual, h = fused_ops.add_rmsnorm(impl, residual, delta, norm.weight, norm.eps)
        attn = self.self_attn(h, cos, sin, batch, pool)
        norm = self.post_attention_layernorm
        residual, h = fused_ops.add_rmsnorm(impl, residual, attn, norm.weight, norm.eps)
        return residual, self.mlp.forward_fused(h, impl)


class LlamaBackbone(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; ``forward`` runs one packed, paged batch."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Derived from the config, kept in float32 whatever the weights' dtype (so it is
        # neither a parameter nor a buffer that .to(dtype) would round).
        self._inv_freq = rope_inv_freq(config)
        # Whether every layer's q/k/v and gate/up concatenations are current (fuse_projections);
        # what replaces parameters (.to() and the like, load_state_dict(assign=True)) clears it.
        self._fused = False

    def _apply(self, *args: Any, **kwargs: Any) -> Any:  # .to(), .cuda(), .half(), ...
        self._fused = False
        return super()._apply(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:  # new parameter objects: the concatenations no longer hold them
            self._fused = False
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin [T, 1, head_dim] for absolute ``positions`` (computed in float32)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(self, batch: PagedBatch, pool: KVPool) -> torch.Tensor:
        """Float32 logits [R, vocab] for ``batch.logit_rows``; writes the new tokens' K/V."""
        x = self.model.embed_tokens(batch.input_ids)
        if batch.fused != "off":
            return self._forward_fused(x, batch, pool)
        cos, sin = self.rope(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, pool)
        hidden = self.model.norm(x[batch.logit_rows])
        return self.lm_head(hidden).float()

    def fuse_projections(self) -> None:
        """Concatenate every layer's q/k/v and gate/up weights for the fused layers (the
        executor does it once when built, each layer checking its concatenation is still
        current; a fused forward does it again only after the model was moved or reloaded
        with new parameter objects, so it costs a step nothing otherwise). The parameters
        stay, as views: state dicts, and loading into them in place, are unchanged."""
        for layer in self.model.layers:
            fused_layer = cast(DecoderLayer, layer)
            fused_layer.self_attn.fuse_projections()
            fused_layer.mlp.fuse_projections()
        self._fused = True

    def _forward_fused(self, x: torch.Tensor, batch: PagedBatch, pool: KVPool) -> torch.Tensor:
        """``forward`` with the residual adds fused into the norms, q/k/v and gate/up each
        one matmul, RoPE with the pool write and SwiGLU each one pass."""
        if not self._fused:
            self.fuse_projections()
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        cos, sin = fused_ops.rope_tables(batch.positions, self._inv_freq)
        residual, delta = x, None
        for layer in self.model.layers:
            fused_layer = cast(DecoderLayer, layer)
            residual, delta = fused_layer.forward_fused(residual, delta, cos, sin, batch, pool)
        rows = batch.logit_rows
        norm = self.model.norm
        delta = None if delta is None else delta[rows]  # None only without layers
        _, hidden = fused_ops.add_rmsnorm(batch.fused, residual[rows], delta, norm.weight, norm.eps)
        return self.lm_head(hidden).float()


def init_random(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """Deterministic random weights (fan-in scaled, so logits are O(1) and greedy choices
    are well separated, which keeps equality tests robust to float rounding)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.zero_()
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return model


def build_tiny_model(
    seed: int = 0, *, device: str = "cpu", config: LlamaConfig | None = None
) -> LlamaForCausalLM:
    """The default random model (fixed seed -> identical weights on every machine)."""
    cfg = config or tiny_config()
    model = init_random(LlamaForCausalLM(cfg), seed)
    return model.to(device=device, dtype=cfg.dtype).eval()
