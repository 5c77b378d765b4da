"""TorchExecutor: the Executor protocol over a real Llama model and the paged KV pool.

It packs the step's prefill chunks and decode tokens into one batch (see model.py for the
layout; ``attention`` picks how a layer attends: "gather", the default, or "paged" /
"paged-torch" / "paged-triton", see ``paged_attention``), runs the model under
``torch.inference_mode``, samples one token per item that
asks for one, and records the wall time of the pass for ``step_cost_s``. It reads
``time.perf_counter`` on purpose: it measures real compute, it is not a sans-I/O core.

``cuda_graphs=True`` (CUDA, paged attention) runs every decode-only step of at most 128
requests as the replay of a CUDA graph captured per (batch, context) bucket
(``decode_graph``); ``static_decode=True`` runs that same padded static-shape path eagerly,
on any device (what the CPU tests compare with the regular path). With either, a step that is
one prefill item alone of at most 512 new tokens (a cache hit on an idle worker: a few new
tokens after a cached prefix) runs the same way, per (tokens, context) bucket
(``PrefillGraphRunner``; ``static_prefill=False`` turns that off; captured over the Triton
kernels only). Other steps with a prefill item, and larger decode batches, always run the
regular way.

``fused`` ("off", the default, "torch" or "triton"; see ``fused_ops``) runs each layer's
residual adds fused into its RMSNorms, RoPE over q and k with the KV pool write in one pass,
SwiGLU in one pass, and q/k/v and gate/up as one matmul each (``model.fuse_projections``,
done when the executor is built), on every path (regular, static and graph-captured).
"triton" needs CUDA (or TRITON_INTERPRET=1). ``factory.build_executor`` picks paged
attention, CUDA graphs and "triton" by default on CUDA (the fastest measured there).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from worker.engine import fused_ops, paged_attention
from worker.engine.decode_graph import (
    DEFAULT_BATCH_BUCKETS,
    CudaGraphCapturer,
    DecodeGraphRunner,
    PrefillGraphRunner,
    RunnerOptions,
)
from worker.engine.kv_pool import KVPool, KVPoolConfig
from worker.engine.model import DecodeGroup, LlamaForCausalLM, PagedBatch, PrefillSeq
from worker.engine.sampling import Sampler
from worker.engine.types import ForwardItem, TokenLogprobs


def _check_pool_fits(model: LlamaForCausalLM, kv_pool: KVPool) -> None:
    """ValueError unless the pool's (layers, kv_heads, head_dim, dtype) are the model's."""
    cfg = model.config
    pool_cfg = kv_pool.config
    pool_shape = (pool_cfg.num_layers, pool_cfg.num_kv_heads, pool_cfg.head_dim, pool_cfg.dtype)
    model_shape = (
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        next(model.parameters()).dtype,
    )
    if pool_shape != model_shape:
        raise ValueError(
            f"kv_pool: (layers, kv_heads, head_dim, dtype) = {pool_shape} does not match the "
            f"model's {model_shape}"
        )


class TorchExecutor:
    """Runs forward passes of ``model`` over ``kv_pool`` on ``device``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: KVPool,
        device: str | torch.device,
        *,
        seed: int = 0,
        attention: str = "gather",
        cuda_graphs: bool = False,
        static_decode: bool = False,
        graph_batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        fused: str = "off",
        static_prefill: bool = True,
    ) -> None:
        _check_pool_fits(model, kv_pool)
        cfg = model.config
        self.model = model
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        self.vocab_size: int = cfg.vocab_size
        self.max_context_tokens: int = cfg.max_position_embeddings
        self.eos_token_ids: tuple[int, ...] = cfg.eos_token_ids
        self.eos_token_id: int | None = cfg.eos_token_id
        self.num_kv_slots: int = kv_pool.num_slots
        self._sampler = Sampler(seed)
        self._logprobs: dict[str, TokenLogprobs] = {}
        self._last_cost_s = 0.0
        self.attention = attention
        # "gather", "torch" or "triton" (raises for an unknown option or Triton off CUDA).
        self.attention_impl = paged_attention.resolve(attention, self.device)
        self.fused = fused
        # "off", "torch" or "triton" (raises for an unknown option or Triton off CUDA).
        self.fused_impl = fused_ops.resolve(fused, self.device)
        if self.fused_impl != "off":  # q/k/v and gate/up concatenated now, not mid-capture
            model.fuse_projections()
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(
                f"cuda_graphs: CUDA graphs need a CUDA device, got {self.device.type!r} "
                "(static_decode=True runs the same padded decode path eagerly)"
            )
        self._sm_count = 132
        if self.device.type == "cuda":
            self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.cuda_graphs = cuda_graphs
        # The static-shape decode path (captured with cuda_graphs, eager with static_decode).
        self.decode_graphs: DecodeGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        if cuda_graphs or static_decode:
            self._make_graph_runners(static_prefill, graph_batch_buckets)

    def _make_graph_runners(
        self, static_prefill: bool, graph_batch_buckets: tuple[int, ...]
    ) -> None:
        """The static decode runner, and with ``static_prefill`` the lone-prefill one."""
        if self.attention_impl == "gather":
            raise ValueError(
                "cuda_graphs / static_decode run paged attention: give attention='paged', "
                "'paged-torch' or 'paged-triton', not 'gather'"
            )
        cuda_graphs = self.cuda_graphs
        # one memory pool for every graph: only one of them ever replays at a time
        capturer = CudaGraphCapturer(self.device) if cuda_graphs else None
        options = RunnerOptions(
            capture=cuda_graphs,
            sm_count=self._sm_count,
            capturer=capturer,
            fused=self.fused_impl,
        )
        model, kv_pool = self.model, self.kv_pool
        self.decode_graphs = DecodeGraphRunner(
            model,
            kv_pool,
            self.device,
            self.attention_impl,
            batch_buckets=graph_batch_buckets,
            **options,
        )
        # A lone short prefill (a cache hit on an idle worker) the same way; captured
        # only over the Triton kernels (the torch reference builds host-side indices).
        if static_prefill and (not cuda_graphs or self.attention_impl == "triton"):
            self.prefill_graphs = PrefillGraphRunner(
                model, kv_pool, self.device, self.attention_impl, **options
            )

    def capture_graphs(self, max_context: int | None = None) -> int:
        """Capture every CUDA graph bucket now -- decode (batch x context width) and lone
        prefill (new tokens x width), widths up to ``max_context`` (all: None) -- instead of
        on each bucket's first step, which then pays the capture. Returns how many graphs
        were captured (0 without cuda_graphs)."""
        done = 0
        for runner in (self.decode_graphs, self.prefill_graphs):
            if runner is not None:
                done += runner.capture_all(max_context)
        return done

    @staticmethod
    def pool_for(model: LlamaForCausalLM, num_slots: int, *, scratch_slot: bool) -> KVPool:
        """A fresh KV pool of ``num_slots`` shaped for ``model``, on its device and dtype
        (``scratch_slot``: the static decode path's padding row)."""
        param = next(model.parameters())
        cfg = model.config
        return KVPool(
            KVPoolConfig(
                num_slots=num_slots,
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                dtype=param.dtype,
                device=str(param.device),
                scratch_slot=scratch_slot,
            )
        )

    @classmethod
    def create(
        cls,
        model: LlamaForCausalLM,
        num_kv_slots: int,
        *,
        seed: int = 0,
        attention: str = "gather",
        cuda_graphs: bool = False,
        static_decode: bool = False,
        fused: str = "off",
        static_prefill: bool = True,
    ) -> TorchExecutor:
        """An executor with a fresh pool of ``num_kv_slots`` on the model's device/dtype
        (plus a scratch slot for the static decode path's padding rows when it is on)."""
        pool = cls.pool_for(model, num_kv_slots, scratch_slot=cuda_graphs or static_decode)
        return cls(
            model,
            pool,
            next(model.parameters()).device,
            seed=seed,
            attention=attention,
            cuda_graphs=cuda_graphs,
            static_decode=static_decode,
            fused=fused,
            static_prefill=static_prefill,
        )

    # -- Executor protocol -------------------------------------------------------------

    def forward(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> list[int]:
        """One token per item, prefill items first then decode (-1 where sample=False)."""
        start = time.perf_counter()
        items = [*prefill, *decode]
        logits = self._logits(prefill, decode)
        wanted = [i for i, item in enumerate(items) if item.sample]
        tokens = [-1] * len(items)
        if wanted:
            picked = self._sampler.sample(
                logits[wanted],
                [items[i].sampling for i in wanted],
                [items[i].num_generated for i in wanted],
                [items[i].output_ids for i in wanted],
            )
            for i, token in zip(wanted, picked, strict=True):
                tokens[i] = token
            asked = self._sampler.last_logprobs
            self._logprobs = {items[wanted[row]].request_id: lp for row, lp in asked.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._last_cost_s = time.perf_counter() - start
        return tokens

    def take_logprobs(self) -> dict[str, TokenLogprobs]:
        """The last forward's logprobs, by request id, of the items that asked."""
        out, self._logprobs = self._logprobs, {}
        return out

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float:
        """Measured wall time of the last ``forward`` (the arguments are not used)."""
        return self._last_cost_s

    # -- logits (used by forward, and by tests comparing numerics) ---------------------

    def forward_logits(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> torch.Tensor:
        """Float32 logits [len(prefill) + len(decode), vocab] at each item's last new token.
        Writes every new token's K/V into its slot."""
        logits = self._logits(prefill, decode)
        # The static paths' output is a buffer the next step overwrites.
        return logits.clone() if self.takes_static_path(prefill, decode) else logits

    def takes_static_path(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> bool:
        """Whether this step would run a static path (a graph replay with cuda_graphs): a
        decode-only step that fits a bucket, or one short prefill item alone."""
        return self._static_step(prefill, decode) or self._static_prefill(prefill, decode)

    def _static_step(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> bool:
        """Whether this step runs the static decode path (decode-only, fits a bucket)."""
        runner = self.decode_graphs
        return runner is not None and not prefill and 0 < len(decode) <= runner.max_batch

    def _static_prefill(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> bool:
        """Whether this step runs the static prefill path (one prefill item alone that fits
        a bucket)."""
        runner = self.prefill_graphs
        if runner is None or decode or len(prefill) != 1:
            return False
        item = prefill[0]
        n = len(item.token_ids)
        return runner.bucket_key(n, item.start_pos + n) is not None

    def _logits(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> torch.Tensor:
        if self._static_step(prefill, decode):
            return self._static_logits(decode)
        if self._static_prefill(prefill, decode):
            return self._static_prefill_logits(prefill[0])
        batch = self._build_batch(prefill, decode, all_positions=False)
        with torch.inference_mode():
            return self.model(batch, self.kv_pool)

    def _static_logits(self, decode: list[ForwardItem]) -> torch.Tensor:
        """A decode-only step through ``decode_graphs`` (same checks as the regular path)."""
        assert self.decode_graphs is not None
        checked = [self._check_item(item, "decode") for item in decode]
        token_ids = np.array([tokens[0] for tokens, _ in checked], dtype=np.int64)
        positions = np.array([item.start_pos for item in decode], dtype=np.int64)
        _check_writes(np.array([slots[-1] for _, slots in checked], dtype=np.int64))
        return self.decode_graphs.run(token_ids, positions, [slots for _, slots in checked])

    def _static_prefill_logits(self, item: ForwardItem) -> torch.Tensor:
        """A lone short prefill through ``prefill_graphs`` (same checks as the regular path)."""
        assert self.prefill_graphs is not None
        tokens, slots = self._check_item(item, "prefill")
        _check_writes(slots[item.start_pos :])
        return self.prefill_graphs.run(tokens, item.start_pos, slots)

    def prompt_logits(self, item: ForwardItem) -> torch.Tensor:
        """Float32 logits [len(item.token_ids), vocab] at every new position of one prefill."""
        batch = self._build_batch([item], [], all_positions=True)
        with torch.inference_mode():
            return self.model(batch, self.kv_pool)

    # -- batch packing -----------------------------------------------------------------

    def _check_item(self, item: ForwardItem, where: str) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.asarray(item.token_ids, dtype=np.int64).reshape(-1)
        slots = np.asarray(item.slots, dtype=np.int64).reshape(-1)
        n, end = len(tokens), item.start_pos + len(tokens)
        rid = item.request_id
        if n == 0:
            raise ValueError(f"{where}[{rid}].token_ids: empty; need >= 1 token")
        if where == "decode" and n != 1:
            raise ValueError(f"decode[{rid}].token_ids: {n} tokens; a decode item has 1")
        if item.start_pos < 0:
            raise ValueError(f"{where}[{rid}].start_pos: {item.start_pos} is negative")
        if end > self.max_context_tokens:
            raise ValueError(
                f"{where}[{rid}]: context {end} exceeds max_context_tokens "
                f"{self.max_context_tokens}"
            )
        if len(slots) < end:
            raise ValueError(
                f"{where}[{rid}].slots: {len(slots)} slots for a context of {end} tokens"
            )
        slots = slots[:end]
        if slots.min() < 0 or slots.max() >= self.kv_pool.num_slots:
            raise ValueError(f"{where}[{rid}].slots: out of range [0, {self.kv_pool.num_slots})")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(f"{where}[{rid}].token_ids: out of range [0, {self.vocab_size})")
        return tokens, slots

    def _build_batch(
        self, prefill: list[ForwardItem], decode: list[ForwardItem], *, all_positions: bool
    ) -> PagedBatch:
        if not prefill and not decode:
            raise ValueError("forward: no prefill and no decode items")
        dev = self.device
        paged = self.attention_impl != "gather"
        ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        writes: list[np.ndarray] = []
        seqs: list[PrefillSeq] = []
        ctx: list[np.ndarray] = []
        logit_rows: list[int] = []
        offset = 0
        for item in prefill:
            tokens, slots = self._check_item(item, "prefill")
            n = len(tokens)
            ids.append(tokens)
            positions.append(np.arange(item.start_pos, item.start_pos + n, dtype=np.int64))
            writes.append(slots[item.start_pos :])
            ctx.append(slots)
            if not paged:
                seqs.append(
                    PrefillSeq(
                        token_offset=offset,
                        num_new=n,
                        start_pos=item.start_pos,
                        ctx_slots=torch.tensor(slots, device=dev),
                    )
                )
            logit_rows.extend(range(offset, offset + n) if all_positions else [offset + n - 1])
            offset += n
        plan = None
        if paged and prefill:
            plan = paged_attention.plan_prefill(
                [len(t) for t in ids], [item.start_pos for item in prefill], ctx, dev
            )

        group = None
        if decode:
            group = self._decode_group(decode, offset, ids, positions, writes)
            logit_rows.extend(range(offset, offset + len(decode)))

        write_slots = np.concatenate(writes)
        _check_writes(write_slots)
        return PagedBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            write_slots=torch.tensor(write_slots, device=dev),
            prefill=tuple(seqs),
            decode=group,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            attention=self.attention_impl,
            prefill_plan=plan,
            fused=self.fused_impl,
        )

    def _decode_group(
        self,
        decode: list[ForwardItem],
        offset: int,
        ids: list[np.ndarray],
        positions: list[np.ndarray],
        writes: list[np.ndarray],
    ) -> DecodeGroup:
        """The decode rows' attention inputs (their rows start at ``offset``); appends each
        row's token, position and KV write slot to ``ids``, ``positions``, ``writes``."""
        dev = self.device
        checked = [self._check_item(item, "decode") for item in decode]
        lengths = np.array([len(s) for _, s in checked], dtype=np.int64)
        max_len = int(lengths.max())
        # Pad each row with its own first slot (a valid index); the mask hides it.
        table = np.empty((len(decode), max_len), dtype=np.int64)
        for row, (_, slots) in enumerate(checked):
            table[row, : len(slots)] = slots
            table[row, len(slots) :] = slots[0]
        for item, (tokens, slots) in zip(decode, checked, strict=True):
            ids.append(tokens)
            positions.append(np.array([item.start_pos], dtype=np.int64))
            writes.append(slots[item.start_pos :])
        if self.attention_impl != "gather":  # paged
            return DecodeGroup(
                token_offset=offset,
                ctx_slots=torch.tensor(table, device=dev),
                ctx_mask=None,
                ctx_lens=torch.tensor(lengths.astype(np.int32), device=dev),
                num_splits=paged_attention.decode_splits(
                    len(decode),
                    self.kv_pool.config.num_kv_heads,
                    max_len,
                    sm_count=self._sm_count,
                ),
            )
        mask = np.arange(max_len)[None, :] < lengths[:, None]
        return DecodeGroup(
            token_offset=offset,
            ctx_slots=torch.tensor(table, device=dev),
            ctx_mask=torch.tensor(mask, device=dev)[:, None, None, :],
        )


def _check_writes(write_slots: np.ndarray) -> None:
    """ValueError when two new tokens of one step would write the same KV slot."""
    if len(np.unique(write_slots)) != len(write_slots):
        raise ValueError("forward: two new tokens in one step write the same KV slot")
