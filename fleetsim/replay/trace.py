"""Mooncake-format traces: parse, validate, write, and expand hash ids into token ids.

Pure and synchronous; imports neither asyncio, grpc nor a clock.

Format (one JSON object a line; blank lines are skipped)::

    {"timestamp": 1250, "input_length": 1100, "output_length": 12, "hash_ids": [7, 8, 9]}

``timestamp`` is milliseconds since the start of the trace. Each hash id stands for one block
of ``block_size`` tokens (512 for Mooncake); equal ids mean equal token content, so requests
whose ``hash_ids`` share their first k ids share a k*block_size-token prefix. A request needs
exactly ceil(input_length / block_size) ids: its last block is cut to ``input_length``.

Expansion: :class:`TokenExpander` turns hash id ``h`` into ``block_size`` pseudo-random token
ids drawn by ``numpy.random.default_rng([seed, h])`` -- the same id always yields the same
tokens, independent of order and of which other ids exist. Blocks are cached (bounded LRU)
because traces repeat ids heavily.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_TRACE_BLOCK_SIZE = 512
DEFAULT_VOCAB_SIZE = 128_000
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(ValueError):
    """A malformed trace line. The message names the line number and the field."""

    def __init__(self, line_no: int, field: str | None, message: str) -> None:
        where = f"line {line_no}" + (f", field {field!r}" if field else "")
        super().__init__(f"trace {where}: {message}")
        self.line_no = line_no
        self.field = field


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line_no: int = 0

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def to_json(self) -> str:
        """The record as one Mooncake JSON line (no newline)."""
        ts: float | int = self.timestamp_ms
        if float(ts).is_integer():
            ts = int(ts)
        return json.dumps(
            {
                "timestamp": ts,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


def _int_field(obj: dict, name: str, line_no: int, minimum: int) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(line_no, name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(line_no, name, f"must be >= {minimum}, got {value}")
    return value


def parse_record(
    line: str, line_no: int, block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> TraceRecord:
    """Parse and validate one trace line (1-based ``line_no`` for error messages)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(line_no, None, f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(line_no, None, f"must be a JSON object, got {type(obj).__name__}")
    for name in _FIELDS:
        if name not in obj:
            raise TraceFormatError(line_no, name, "is missing")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise TraceFormatError(line_no, "timestamp", f"must be a number of ms, got {ts!r}")
    if ts < 0:
        raise TraceFormatError(line_no, "timestamp", f"must be >= 0, got {ts}")
    input_length = _int_field(obj, "input_length", line_no, 1)
    output_length = _int_field(obj, "output_length", line_no, 1)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceFormatError(line_no, "hash_ids", f"must be a list, got {hash_ids!r:.40}")
    for i, h in enumerate(hash_ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceFormatError(
                line_no, "hash_ids", f"[{i}]={h!r} is not a non-negative integer"
            )
    needed = -(-input_length // block_size)
    if len(hash_ids) != needed:
        raise TraceFormatError(
            line_no,
            "hash_ids",
            f"input_length {input_length} at block size {block_size} needs {needed} ids, "
            f"got {len(hash_ids)} (wrong --trace-block-size?)",
        )
    return TraceRecord(float(ts), input_length, output_length, tuple(hash_ids), line_no)


def iter_records(
    lines: Iterable[str], block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> Iterator[TraceRecord]:
    """Parse lines lazily; blank lines are skipped but still counted for line numbers."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            yield parse_record(line, line_no, block_size)


def read_trace(
    path: str | Path,
    block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    limit: int | None = None,
) -> list[TraceRecord]:
    """Read a trace file, sorted by timestamp (stable), keeping the first ``limit`` lines."""
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for record in iter_records(f, block_size):
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise TraceFormatError(0, None, f"{path} holds no requests")
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Write records as Mooncake JSONL; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record.to_json() + "\n")
            n += 1
    return n


class TokenExpander:
    """Deterministic hash id -> token block expansion with a bounded LRU of blocks.

    ``seed`` changes every block's content; tokens are drawn uniformly from
    ``[0, vocab_size)``.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        seed: int = 0,
        max_cached_blocks: int = 65_536,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 1 < vocab_size <= 2**31:
            raise ValueError(f"vocab_size must be in (1, 2**31], got {vocab_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_cached_blocks = max(1, max_cached_blocks)
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_size`` token ids of one hash id (read-only int32 array)."""
        cached = self._blocks.get(hash_id)
        if cached is not None:
            self._blocks.move_to_end(hash_id)
            self.num_hits += 1
            return cached
        self.num_misses += 1
        rng = np.random.default_rng([self.seed, hash_id])
        tokens = rng.integers(0, self.vocab_size, size=self.block_size, dtype=np.int32)
        tokens.flags.writeable = False
        self._blocks[hash_id] = tokens
        if len(self._blocks) > self.max_cached_blocks:
            self._blocks.popitem(last=False)
        return tokens

    def expand(self, hash_ids: Sequence[int], input_length: int) -> np.ndarray:
        """Token ids (int64) of a prompt: the blocks of ``hash_ids`` cut to ``input_length``."""
        if not 0 < input_length <= len(hash_ids) * self.block_size:
            raise ValueError(
                f"input_length {input_length} must be in [1, {len(hash_ids) * self.block_size}]"
                f" for {len(hash_ids)} ids of {self.block_size} tokens"
            )
        needed = -(-input_length // self.block_size)
        out = np.empty(needed * self.block_size, dtype=np.int64)
        bs = self.block_size
        for i, h in enumerate(hash_ids[:needed]):
            out[i * bs : (i + 1) * bs] = self.block(h)
        return out[:input_length]

    def expand_record(self, record: TraceRecord) -> np.ndarray:
        return self.expand(record.hash_ids, record.input_length)
