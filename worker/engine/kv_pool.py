"""The paged KV pool: per-layer K and V tensors indexed by KV slot.

One slot holds the key and value vectors of one token for every layer:

    k[layer][slot] : [num_kv_heads, head_dim]      v[layer][slot] : same

The radix cache and the scheduler only ever see int64 slot indices; this module owns the
storage they point into. Which slots are free is the allocator's business, not the pool's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVPoolConfig:
    """Shape and placement of a KV pool."""

    num_slots: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # One extra row past the last slot that no allocator hands out: padding rows of a
    # static-shape decode step (CUDA graphs) write and read it, never a real slot.
    scratch_slot: bool = False

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVPoolConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_slot(self) -> int:
        """K plus V bytes of one token across all layers."""
        return bytes_per_slot(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV slot takes: K and V, every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def slots_for_memory(free_bytes: int, fraction: float, slot_bytes: int) -> int:
    """How many slots fit in ``fraction`` of ``free_bytes`` (pure; the CUDA helper feeds it)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
    return max(0, int(free_bytes * fraction) // slot_bytes)


def cuda_slots_for_memory_fraction(
    fraction: float,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cuda",
) -> int:
    """Slots that fit in ``fraction`` of the device's currently free memory (after the model
    weights are loaded, so call it then). Raises ValueError on a non-CUDA device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device: memory-fraction sizing needs a CUDA device, got {device!r}")
    free_bytes, _total = torch.cuda.mem_get_info(dev)
    return slots_for_memory(
        free_bytes, fraction, bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype)
    )


class KVPool:
    """Per-layer K and V tensors of shape [num_slots, num_kv_heads, head_dim] on one device
    (one row more, ``scratch_slot``, when the config asks for it)."""

    def __init__(self, config: KVPoolConfig) -> None:
        self.config = config
        rows = config.num_slots + (1 if config.scratch_slot else 0)
        shape = (rows, config.num_kv_heads, config.head_dim)
        device = torch.device(config.device)
        # Inference tensors: the executor only ever touches them under torch.inference_mode.
        with torch.inference_mode():
            self.k = [
                torch.zeros(shape, dtype=config.dtype, device=device)
                for _ in range(config.num_layers)
            ]
            self.v = [
                torch.zeros(shape, dtype=config.dtype, device=device)
                for _ in range(config.num_layers)
            ]

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def scratch_slot(self) -> int | None:
        """The index of the scratch row (``num_slots``), or None when the pool has none."""
        return self.config.num_slots if self.config.scratch_slot else None

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Memory the pool occupies (the scratch row included)."""
        rows = self.config.num_slots + (1 if self.config.scratch_slot else 0)
        return rows * self.config.bytes_per_slot

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ([n, num_kv_heads, head_dim]) at ``slots`` (int64 [n]) of ``layer``."""
        self.k[layer].index_copy_(0, slots, k.to(self.config.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.config.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at ``slots`` (any int64 shape S) as tensors of shape S + [heads, head_dim]."""
        return self.k[layer][slots], self.v[layer][slots]
