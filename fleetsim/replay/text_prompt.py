"""Trace hash ids -> text prompts whose byte-tokenizer ids are exactly the intended ones.

Pure and synchronous; imports neither asyncio, grpc nor a clock.

An HTTP front end (ours, sglang-router, vllm-router) takes text, and the peers' cache-aware
trees work on that text (sglang-router's is character-level). The sim workers tokenize with
the byte tokenizer (one UTF-8 byte = one token), so a prompt of ASCII characters has exactly
one token per character. :class:`TextExpander` turns hash id ``h`` into ``block_size``
printable ASCII characters drawn by ``numpy.random.default_rng([seed, h])``:

- the same id always gives the same characters, whatever other ids exist and in any order;
- requests whose ``hash_ids`` share their first k ids share a k*block_size-character (and
  so k*block_size-token) prefix, and their texts diverge right where their ids do;
- a prompt of ``input_length`` tokens is exactly ``input_length`` characters long.

Only '!'..'~' (33..126) are used: no whitespace, which some servers strip or split on, and
nothing a JSON encoder escapes differently on different fronts except '"' and '\\', which
every JSON codec round-trips exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fleetsim.replay.trace import TraceRecord

FIRST_CHAR = 33  # '!'
LAST_CHAR = 126  # '~'


class TextExpander:
    """Deterministic hash id -> ASCII text block, with a bounded LRU of blocks."""

    def __init__(self, block_size: int, seed: int = 0, max_cached_blocks: int = 65_536) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.block_size = block_size
        self.seed = seed
        self.max_cached_blocks = max(1, max_cached_blocks)
        self._blocks: OrderedDict[int, str] = OrderedDict()

    def block(self, hash_id: int) -> str:
        """The ``block_size`` characters of one hash id."""
        cached = self._blocks.get(hash_id)
        if cached is not None:
            self._blocks.move_to_end(hash_id)
            return cached
        rng = np.random.default_rng([self.seed, hash_id])
        codes = rng.integers(FIRST_CHAR, LAST_CHAR + 1, size=self.block_size, dtype=np.uint8)
        text = codes.tobytes().decode("ascii")
        self._blocks[hash_id] = text
        if len(self._blocks) > self.max_cached_blocks:
            self._blocks.popitem(last=False)
        return text

    def expand(self, hash_ids: Sequence[int], input_length: int) -> str:
        """The prompt text: the blocks of ``hash_ids`` cut to ``input_length`` characters."""
        if not 0 < input_length <= len(hash_ids) * self.block_size:
            raise ValueError(
                f"input_length {input_length} must be in [1, {len(hash_ids) * self.block_size}]"
                f" for {len(hash_ids)} ids of {self.block_size} characters"
            )
        needed = -(-input_length // self.block_size)
        return "".join(self.block(h) for h in hash_ids[:needed])[:input_length]

    def expand_record(self, record: TraceRecord) -> str:
        return self.expand(record.hash_ids, record.input_length)
