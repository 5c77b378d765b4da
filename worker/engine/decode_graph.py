"""Decode steps with static shapes, replayed as CUDA graphs (one per bucket).

A decode-only step of n requests runs in a bucket (B, W): B the smallest batch bucket >= n
(``DEFAULT_BATCH_BUCKETS``), W the smallest context bucket >= its longest context (powers of
two from ``min_context_bucket`` up to the model's context length). Each bucket owns
preallocated buffers -- token ids [B], positions [B] and the slot table [B, W], views of one
int64 device tensor that one host-to-device copy fills -- and a forward that reads only
them: row b writes its new K/V at ``table[b, positions[b]]`` and attends to the first
``positions[b] + 1`` slots of its row through the paged decode attention (the Triton kernel
on CUDA reads K/V by slot index; nothing is gathered into a tensor whose shape follows the
step). Rows n .. B-1 are padding: token 0 at position 0 whose one slot is the pool's scratch
slot, so they write and read that slot only, never a real one. The logits come out of the
bucket's static output [B, vocab]; its first n rows are the step's.

With ``capture`` (CUDA only) the first step in a bucket warms the forward up on a side
stream (compiling the Triton kernels), then captures it into a ``torch.cuda.CUDAGraph``
(all buckets share one memory pool: only one graph ever replays at a time); every step in
the bucket is then one copy of the inputs and one replay. Without capture (the CPU, and the
eager side of the GPU tests) the same forward runs eagerly over the same buffers, which is
what the CPU tests compare with the regular decode path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Required, TypedDict, Unpack

import numpy as np
import torch

from worker.engine import paged_attention
from worker.engine.kv_pool import KVPool
from worker.engine.model import DecodeGroup, LlamaForCausalLM, PagedBatch
from worker.engine.paged_attention import PREFILL_BLOCK_M, PrefillPlan

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# New-token buckets of a lone prefill step run static (PrefillGraphRunner).
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
DEFAULT_MIN_CONTEXT_BUCKET = 256
# Eager passes on a side stream before a capture (Triton compiles, cuBLAS sets up).
WARMUP_PASSES = 2


def context_buckets(max_context: int, floor: int = DEFAULT_MIN_CONTEXT_BUCKET) -> tuple[int, ...]:
    """Slot-table widths: floor, 2 * floor, ... below ``max_context``, then ``max_context``."""
    if max_context < 1 or floor < 1:
        raise ValueError(
            f"context_buckets: need max_context, floor >= 1, got {max_context}, {floor}"
        )
    widths = []
    width = floor
    while width < max_context:
        widths.append(width)
        width *= 2
    widths.append(max_context)
    return tuple(widths)


def bucket_of(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (None when n is above the largest)."""
    return next((b for b in buckets if b >= n), None)


class Graph(Protocol):
    def replay(self) -> None: ...


class Capturer(Protocol):
    """Turns a forward that reads only static buffers into a replayable graph."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """(graph, its static output): each ``graph.replay()`` recomputes ``forward`` from
        the buffers' current contents into that output."""
        ...


class CudaGraphCapturer:
    """Captures into ``torch.cuda.CUDAGraph``s sharing one memory pool (only one of them
    ever replays at a time), after warm-up passes on a side stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        return graph, out


@dataclass(eq=False, slots=True)
class Bucket:
    """One (batch, width) bucket: its input buffers, static output and graph."""

    batch: int
    width: int
    num_splits: int
    host: torch.Tensor  # int64 [2B + B*W]: ids, positions, table; pinned on CUDA
    device_buf: torch.Tensor  # the same on the device (``host`` itself off CUDA)
    input_ids: torch.Tensor  # int64 [B] (a view of device_buf)
    positions: torch.Tensor  # int64 [B]
    table: torch.Tensor  # int64 [B, W]
    rows: torch.Tensor  # int64 [B]: 0 .. B-1, the rows whose logits come out
    logits: torch.Tensor | None = None  # float32 [B, vocab]: the last pass's output
    graph: Graph | None = None  # a torch.cuda.CUDAGraph once captured
    steps: int = 0


class RunnerOptions(TypedDict, total=False):
    """The keyword options both graph runners take. ``capture``: replay graphs made by
    ``capturer`` (default: CUDA graphs, which need a CUDA device), else run every step
    eagerly; ``sm_count``: the device's SMs (the kernels' split sizing); ``fused``: the
    model's fused-ops implementation (``PagedBatch.fused``)."""

    capture: Required[bool]
    sm_count: int
    min_context_bucket: int
    capturer: Capturer | None
    fused: str


class _StaticRunner:
    """What the static decode and prefill runners share: the model, pool and device, the
    attention and fused-ops implementations, the context buckets, the scratch slot, the
    capturer and the last input copy."""

    what = "static"
    _buckets: dict[tuple[int, int], Any]  # the buckets made so far, by key

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        device: torch.device,
        impl: str,
        *,
        capture: bool,
        sm_count: int = 132,
        min_context_bucket: int = DEFAULT_MIN_CONTEXT_BUCKET,
        capturer: Capturer | None = None,
        fused: str = "off",
    ) -> None:
        if pool.scratch_slot is None:
            raise ValueError(
                f"kv_pool: {self.what} needs a pool with a scratch slot for its padding rows "
                "(KVPoolConfig(scratch_slot=True); TorchExecutor.create makes one)"
            )
        if impl not in ("torch", "triton"):
            raise ValueError(
                f"{self.what} runs paged attention ('torch' or 'triton'), got {impl!r}"
            )
        if capture and capturer is None and device.type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, got {device.type!r}")
        self.model = model
        self.pool = pool
        self.device = device
        self.impl = impl
        self.fused = fused
        self.capture = capture
        self.sm_count = sm_count
        self.context_buckets = context_buckets(
            model.config.max_position_embeddings, min_context_bucket
        )
        self.scratch_slot: int = pool.scratch_slot
        self._capturer = capturer
        if capture and capturer is None:
            self._capturer = CudaGraphCapturer(device)
        self._copied: torch.cuda.Event | None = None  # the last host-to-device input copy

    def _new_bucket(self, size: int, width: int) -> Any:
        raise NotImplementedError

    def _capture(self, bucket: Any) -> None:
        raise NotImplementedError

    def _forward(self, bucket: Any) -> torch.Tensor:
        raise NotImplementedError

    def keys(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """Every bucket a step can land in, context widths up to ``max_width`` (all: None)."""
        raise NotImplementedError

    def widths(self, max_width: int | None) -> tuple[int, ...]:
        """The context buckets up to ``max_width`` (all of them: None)."""
        if max_width is None:
            return self.context_buckets
        return tuple(w for w in self.context_buckets if w <= max_width)

    def capture_all(self, max_width: int | None = None) -> int:
        """Capture every bucket of ``keys(max_width)`` not captured yet, now rather than on
        its first step (a capture costs that step a few forward passes); returns how many
        were captured. Nothing to do without ``capture``."""
        if not self.capture:
            return 0
        done = 0
        with torch.inference_mode():
            for key in self.keys(max_width):
                bucket = self._bucket(key)
                if bucket.graph is None:
                    self._capture(bucket)
                    done += 1
        return done

    def _bucket(self, key: tuple[int, int]) -> Any:
        """Bucket ``key``, made (buffers, not yet a graph) when first asked for."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new_bucket(*key)
        return bucket

    def _step(self, key: tuple[int, int], load: Callable[[Any], None]) -> Any:
        """One step in bucket ``key`` (made on first use; captured first when capturing):
        ``load(bucket)`` writes the step's inputs, then the graph replays (or the forward
        runs eagerly). Returns the bucket, its ``logits`` the step's."""
        bucket = self._bucket(key)
        with torch.inference_mode():
            if self.capture and bucket.graph is None:
                self._capture(bucket)
            load(bucket)
            if bucket.graph is not None:
                bucket.graph.replay()
            else:
                bucket.logits = self._forward(bucket)
        bucket.steps += 1
        assert bucket.logits is not None
        return bucket

    def _host(self, bucket: Any) -> np.ndarray:
        """The bucket's host buffer to write, once the previous copy has read it."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned buffer
        return bucket.host.numpy()

    def _upload(self, bucket: Any) -> None:
        """Copy the bucket's host buffer to the device (nothing to copy off CUDA)."""
        if bucket.host is not bucket.device_buf:
            bucket.device_buf.copy_(bucket.host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @staticmethod
    def _sizes(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
        buckets = tuple(sorted(set(sizes)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"{name}: need sizes >= 1, got {tuple(sizes)}")
        return buckets


class DecodeGraphRunner(_StaticRunner):
    """Runs decode-only steps of ``model`` over ``pool`` in static-shape buckets."""

    what = "static decode"

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        device: torch.device,
        impl: str,
        *,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        **options: Unpack[RunnerOptions],
    ) -> None:
        """``batch_buckets``: the batch sizes a step is padded up to; ``options``: see
        RunnerOptions."""
        super().__init__(model, pool, device, impl, **options)
        self.batch_buckets = self._sizes("batch_buckets", batch_buckets)
        self._buckets = {}

    def keys(self, max_width: int | None = None) -> list[tuple[int, int]]:
        return [(b, w) for w in self.widths(max_width) for b in self.batch_buckets]

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def buckets(self) -> dict[tuple[int, int], Bucket]:
        """The buckets made so far, by (batch, width)."""
        return self._buckets

    @property
    def num_graphs(self) -> int:
        return sum(b.graph is not None for b in self._buckets.values())

    def bucket_key(self, n: int, max_len: int) -> tuple[int, int] | None:
        """(batch, width) for n rows whose longest context is ``max_len``; None when n is
        above the largest batch bucket (the executor runs that step the regular way)."""
        batch = bucket_of(n, self.batch_buckets)
        width = bucket_of(max_len, self.context_buckets)
        if batch is None or width is None or n < 1:
            return None
        return batch, width

    # -- one step ------------------------------------------------------------------------

    def run(
        self, token_ids: np.ndarray, positions: np.ndarray, slots: Sequence[np.ndarray]
    ) -> torch.Tensor:
        """Float32 logits [n, vocab] of n decode rows: row r is token ``token_ids[r]`` at
        ``positions[r]`` over the context ``slots[r]`` (``positions[r] + 1`` slots, the last
        one its write slot; the caller validated them). A view of the bucket's static
        output: valid until the next step in that bucket."""
        n = len(token_ids)
        key = self.bucket_key(n, int(positions.max()) + 1)
        if key is None:
            raise ValueError(f"static decode: {n} rows do not fit a bucket of {self.batch_buckets}")
        bucket = self._step(key, lambda b: self._load(b, token_ids, positions, slots))
        return bucket.logits[:n]

    def _new_bucket(self, batch: int, width: int) -> Bucket:
        size = 2 * batch + batch * width
        cuda = self.device.type == "cuda"
        with torch.inference_mode():
            host = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
            host[2 * batch :] = self.scratch_slot  # every table entry a valid slot from the start
            dev = host.to(self.device) if cuda else host
            kv_heads = self.pool.config.num_kv_heads
            return Bucket(
                batch=batch,
                width=width,
                num_splits=paged_attention.decode_splits(
                    batch, kv_heads, width, sm_count=self.sm_count
                ),
                host=host,
                device_buf=dev,
                input_ids=dev[:batch],
                positions=dev[batch : 2 * batch],
                table=dev[2 * batch :].view(batch, width),
                rows=torch.arange(batch, dtype=torch.int64, device=self.device),
            )

    def _load(
        self,
        bucket: Bucket,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: Sequence[np.ndarray],
    ) -> None:
        """Write the step into the bucket's host buffer and copy it to the device. Rows past
        n become padding; table entries past a row's context keep old (valid) slots, which
        the attention never reads (its length masks them)."""
        host = self._host(bucket)
        batch, n = bucket.batch, len(token_ids)
        host[:n] = token_ids
        host[n:batch] = 0
        host[batch : batch + n] = positions
        host[batch + n : 2 * batch] = 0
        table = host[2 * batch :].reshape(batch, bucket.width)
        for row, ctx in enumerate(slots):
            table[row, : len(ctx)] = ctx
        table[n:, 0] = self.scratch_slot
        self._upload(bucket)

    def _forward(self, bucket: Bucket) -> torch.Tensor:
        """The step's forward, reading only the bucket's buffers (what a graph captures)."""
        lens = (bucket.positions + 1).to(torch.int32)
        write_slots = torch.gather(bucket.table, 1, bucket.positions[:, None]).view(-1)
        batch = PagedBatch(
            input_ids=bucket.input_ids,
            positions=bucket.positions,
            write_slots=write_slots,
            prefill=(),
            decode=DecodeGroup(
                token_offset=0,
                ctx_slots=bucket.table,
                ctx_mask=None,
                ctx_lens=lens,
                num_splits=bucket.num_splits,
            ),
            logit_rows=bucket.rows,
            attention=self.impl,
            fused=self.fused,
        )
        return self.model(batch, self.pool)

    def _capture(self, bucket: Bucket) -> None:
        """Capture the bucket's forward with every row padding (so the warm-up passes write
        the scratch slot only); the step's own inputs are loaded after."""
        assert self._capturer is not None
        empty = np.empty(0, dtype=np.int64)
        self._load(bucket, empty, empty, [])
        bucket.graph, bucket.logits = self._capturer.capture(lambda: self._forward(bucket))


# ---- a lone short prefill --------------------------------------------------------------


@dataclass(eq=False, slots=True)
class PrefillBucket:
    """One (tokens, width) bucket of a lone prefill: input buffers, static output, graph.

    ``host`` / ``device_buf`` (int64): token ids [T], positions [T], write slots [T], the
    item's slot table [W], then [0, n, start, start + n, n - 1] (the plan's cu_q, start_pos,
    ctx_lens, and the row whose logits come out)."""

    tokens: int
    width: int
    num_splits: int
    host: torch.Tensor
    device_buf: torch.Tensor
    block_item: torch.Tensor  # int32 [T / BLOCK_M]: all 0 (one item)
    block_row: torch.Tensor  # int32: 0, BLOCK_M, ...
    logits: torch.Tensor | None = None  # float32 [1, vocab]
    graph: Graph | None = None
    steps: int = 0


class PrefillGraphRunner(_StaticRunner):
    """Runs a step that is one prefill item alone (no decode rows) of at most the largest
    token bucket, in static-shape buckets (T new tokens, W context), as graph replays.

    Such a step is what a cache hit on an idle worker costs -- a few new tokens after a
    long cached prefix -- and run eagerly it is bound by the host's kernel launches (about
    six Python-side launches per layer), not by the GPU. Rows n .. T-1 are padding: token 0
    at position 0, writing the pool's scratch slot; the attention kernel reads the item's
    true length from the device buffers, so they attend to nothing real and no real row
    reads them. The paged prefill kernel's launch is fixed per bucket (T / 64 query blocks,
    key splits sized for W)."""

    what = "static prefill"

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        device: torch.device,
        impl: str,
        *,
        token_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        **options: Unpack[RunnerOptions],
    ) -> None:
        """As DecodeGraphRunner; CUDA graphs need the Triton kernels (the torch reference
        builds host-side index tensors per call, which a capture cannot hold)."""
        if options.get("capture") and impl != "triton" and device.type == "cuda":
            raise ValueError("static prefill: CUDA graph capture needs the Triton prefill kernel")
        super().__init__(model, pool, device, impl, **options)
        self.token_buckets = self._sizes("token_buckets", token_buckets)
        self._buckets = {}

    @property
    def buckets(self) -> dict[tuple[int, int], PrefillBucket]:
        return self._buckets

    def keys(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """(tokens, width) pairs a step can land in: a width above the token bucket below
        (a context is at least its new tokens)."""
        out = []
        below = 0
        for t in self.token_buckets:
            out += [(t, w) for w in self.widths(max_width) if w > below]
            below = t
        return out

    def bucket_key(self, num_new: int, context: int) -> tuple[int, int] | None:
        """(tokens, width) for ``num_new`` new tokens ending a context of ``context``; None
        when either is above its largest bucket (the step runs the regular way)."""
        tokens = bucket_of(num_new, self.token_buckets)
        width = bucket_of(context, self.context_buckets)
        if tokens is None or width is None or num_new < 1:
            return None
        return tokens, width

    def run(self, token_ids: np.ndarray, start_pos: int, slots: np.ndarray) -> torch.Tensor:
        """Float32 logits [1, vocab] at the last of ``token_ids`` (the new tokens at
        ``start_pos`` ..), over the context ``slots`` (``start_pos + n`` slots; the caller
        validated them). A view of the bucket's static output."""
        n = len(token_ids)
        key = self.bucket_key(n, start_pos + n)
        if key is None:
            raise ValueError(f"static prefill: {n} new tokens at {start_pos} fit no bucket")
        bucket = self._step(key, lambda b: self._load(b, token_ids, start_pos, slots))
        return bucket.logits

    def _new_bucket(self, tokens: int, width: int) -> PrefillBucket:
        cuda = self.device.type == "cuda"
        blocks = -(-tokens // PREFILL_BLOCK_M)
        heads = self.model.config.num_attention_heads
        with torch.inference_mode():
            host = torch.zeros(3 * tokens + width + 5, dtype=torch.int64, pin_memory=cuda)
            host[2 * tokens : 3 * tokens + width] = self.scratch_slot
            dev = host.to(self.device) if cuda else host
            rows = torch.arange(0, blocks * PREFILL_BLOCK_M, PREFILL_BLOCK_M, dtype=torch.int32)
            return PrefillBucket(
                tokens=tokens,
                width=width,
                num_splits=paged_attention.prefill_splits(
                    blocks, heads, width, sm_count=self.sm_count
                ),
                host=host,
                device_buf=dev,
                block_item=torch.zeros(blocks, dtype=torch.int32, device=self.device),
                block_row=rows.to(self.device),
            )

    def _load(
        self, bucket: PrefillBucket, token_ids: np.ndarray, start_pos: int, slots: np.ndarray
    ) -> None:
        host = self._host(bucket)
        t, w, n = bucket.tokens, bucket.width, len(token_ids)
        host[:n] = token_ids
        host[n:t] = 0
        host[t : t + n] = np.arange(start_pos, start_pos + n)
        host[t + n : 2 * t] = 0
        host[2 * t : 2 * t + n] = slots[start_pos : start_pos + n]
        host[2 * t + n : 3 * t] = self.scratch_slot
        context = start_pos + n
        table = host[3 * t : 3 * t + w]
        table[:context] = slots[:context]
        table[context:] = slots[0] if context else self.scratch_slot
        host[3 * t + w :] = (0, n, start_pos, context, max(n - 1, 0))
        self._upload(bucket)

    def _forward(self, bucket: PrefillBucket) -> torch.Tensor:
        """The step's forward, reading only the bucket's buffers (what a graph captures)."""
        t, w = bucket.tokens, bucket.width
        buf = bucket.device_buf
        meta = buf[3 * t + w :]
        meta32 = meta[:4].to(torch.int32)
        plan = PrefillPlan(
            cu_q=meta32[0:2],
            start_pos=meta32[2:3],
            ctx_lens=meta32[3:4],
            slot_table=buf[3 * t : 3 * t + w].view(1, w),
            block_item=bucket.block_item,
            block_row=bucket.block_row,
            num_new=(t,),  # the bucket's rows (the true count is cu_q's, on the device)
            starts=(max(w - t, 0),),  # so the plan's context is the bucket's width
            block_m=PREFILL_BLOCK_M,
        )
        batch = PagedBatch(
            input_ids=buf[:t],
            positions=buf[t : 2 * t],
            write_slots=buf[2 * t : 3 * t],
            prefill=(),
            decode=None,
            logit_rows=meta[4:5],
            attention=self.impl,
            prefill_plan=plan,
            fused=self.fused,
            prefill_splits=bucket.num_splits,
        )
        return self.model(batch, self.pool)

    def _capture(self, bucket: PrefillBucket) -> None:
        """Capture with every row padding except one token at position 0 on the scratch
        slot (the warm-up passes write the scratch slot only); the step's inputs after."""
        assert self._capturer is not None
        scratch = np.full(1, self.scratch_slot, dtype=np.int64)
        self._load(bucket, np.zeros(1, dtype=np.int64), 0, scratch)
        bucket.graph, bucket.logits = self._capturer.capture(lambda: self._forward(bucket))
