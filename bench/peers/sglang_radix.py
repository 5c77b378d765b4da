"""SGLang's own RadixCache (sglang 0.5.23) on bench_radix_cache's op traces, as JSON.

Runs with the python of the venv that bench/peers/install_sglang.sh makes (the project never
imports SGLang)::

    .peers/sglang-radix/bin/python -W ignore bench/peers/sglang_radix.py [--quick] [--rounds N]

prints one JSON line: the medians of N rounds under the keys of bench_radix_cache, plus
``freed_per_call`` (tokens each tree eviction call freed). With ``--serve`` (how
``bench_radix_cache --peer-python`` drives it) it first prints ``{"trace_digest", "version"}``,
then runs one round per line read from stdin and answers each with one JSON line.

The traces come from bench/radix_trace.py (numpy only), so both sides replay the same
tokens in the same order. Each case is SGLang's own code path, as its scheduler drives it:

* worker step: ``match_prefix``; the matched slots read off the path
  (``path_device_indices``, what its ``prefix_device_indices`` does); ``alloc`` the miss from
  its ``TokenToKVPoolAllocator`` (CPU); ``insert``; free the duplicates ``insert`` reports.
* events: the same at page_size 16 with ``enable_kv_cache_events``, drained by
  ``kv_events.take()`` every step.
* eviction: ``evict(EvictParams(num_tokens=k))``, which frees through the allocator as ours
  does; locks by ``inc_lock_ref`` of the node a ``match_prefix`` returns.

Token keys are built as ``RadixKey(array("q"))`` before the clock starts (the form its
scheduler hands the tree), as our side hands over int64 arrays it already has. SGLang stamps
recency with ``time.monotonic()``; ours with a counter. Neither side is tuned here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import types
from array import array
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO))

from bench.radix_trace import (  # noqa: E402  (the repository root was just put on the path)
    QUICK,
    Side,
    TraceSpec,
    TreeTrace,
    flat_leaf,
    make_trace,
    make_tree_trace,
    metric_keys,
    split_queries,
    timed,
    trace_digest,
)

# ---------------------------------------------------------------- import-time stubs
#
# SGLang's radix cache module pulls in, through sglang.srt.configs, multimodal helpers that
# import torchvision at module level. Its PyPI wheels want a CUDA torch, so the peer venv has
# none; these stubs let those imports succeed. Nothing on the radix cache's code paths calls
# into them: any call would only return a placeholder class.

_STUBBED_PACKAGES = frozenset({"torchvision"})


class _Placeholder(type):
    """A class whose every attribute is another placeholder; calling it returns itself, or,
    used as a decorator, the decorated function unchanged."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {})
        setattr(self, name, value)
        return value


class _StubImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the stubbed packages (and any submodule) with _StubModule."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in _STUBBED_PACKAGES:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        # transformers parses the version of any torchvision it finds.
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]


def _import_sglang() -> dict[str, Any]:
    """Import what the benchmark uses, with the stubs in place and import-time chatter sent
    to stderr (stdout carries only the JSON lines)."""
    if not any(isinstance(f, _StubImporter) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubImporter())
    with contextlib.redirect_stdout(sys.stderr):
        import sglang
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    return {
        "version": sglang.__version__,
        "torch": torch,
        "TokenToKVPoolAllocator": TokenToKVPoolAllocator,
        "EvictParams": EvictParams,
        "InsertParams": InsertParams,
        "MatchPrefixParams": MatchPrefixParams,
        "CacheInitParams": CacheInitParams,
        "RadixCache": RadixCache,
        "RadixKey": RadixKey,
    }


SG = _import_sglang()
torch = SG["torch"]
# On a CPU box torch's allocator tensors stand in for GPU ones; its intra-op thread pool only
# adds contention on a shared machine (100x swings in torch.cat were seen with 2 threads).
# One thread, as our numpy side runs.
torch.set_num_threads(1)
EvictParams = SG["EvictParams"]
InsertParams = SG["InsertParams"]
MatchPrefixParams = SG["MatchPrefixParams"]
RadixKey = SG["RadixKey"]


def make_cache(pool_slots: int, page_size: int = 1, events: bool = False) -> tuple[Any, Any]:
    """SGLang's RadixCache (LRU) over its own CPU token allocator of ``pool_slots`` slots.
    The KV pool itself (kvcache) is never touched by the tree, so none is made."""
    alloc = SG["TokenToKVPoolAllocator"](
        size=pool_slots, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    params = SG["CacheInitParams"](
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        eviction_policy="lru",
        enable_kv_cache_events=events,
    )
    return SG["RadixCache"](params), alloc


def take_events(cache: Any) -> list[Any]:
    """Drain the tree's queued KV events: ``kv_events.take()`` (0.5.23) or
    ``take_events()`` (0.5.18, before the queue became an object of its own)."""
    queue = getattr(cache, "kv_events", None)
    return list(queue.take() if queue is not None else cache.take_events())


def radix_key(tokens: Any) -> Any:
    ids = array("q")
    ids.frombytes(tokens.tobytes())
    return RadixKey(token_ids=ids)


def matched(cache: Any, result: Any) -> tuple[int, Any]:
    """A match_prefix result's hit length and the matched slots: 0.5.23 reports the length
    (``device_prefix_len``) and reads the slots off the path; 0.5.18 returns them
    (``device_indices``)."""
    if hasattr(result, "device_prefix_len"):
        hit = result.device_prefix_len
        return hit, cache.path_device_indices(result.last_device_node)[:hit]
    return len(result.device_indices), result.device_indices


def worker_step(cache: Any, alloc: Any, key: Any) -> None:
    """The step bench_radix_cache.worker_step does, in SGLang's API."""
    hit, prefix = matched(cache, cache.match_prefix(MatchPrefixParams(key=key)))
    new = alloc.alloc(len(key) - hit)
    if new is None:
        raise RuntimeError("benchmark pool too small")
    slots = torch.cat((prefix, new))
    prefix_len = cache.insert(InsertParams(key=key, value=slots)).prefix_len
    if prefix_len > hit:
        alloc.free(slots[hit:prefix_len])


def build_tree(tree: TreeTrace, keys: list[Any]) -> Any:
    cache, alloc = make_cache(tree.pool_slots)
    for key in keys:
        worker_step(cache, alloc, key)
    for i in tree.locked:
        cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=keys[i])).last_device_node)
    return cache


class SGLangSide(Side):
    """The peer of bench_radix_cache.OurSide: one round of every case per call."""

    def __init__(self, spec: TraceSpec) -> None:
        self.spec = spec
        trace = make_trace(spec)
        self.pool_slots = trace.size
        self.keys = [radix_key(row) for row in trace]
        self.queries = [radix_key(q) for q in split_queries(trace, spec)]
        self.tree = make_tree_trace(spec)
        self.tree_keys = [radix_key(seq) for seq in self.tree.seqs]
        self._flat: dict[int, tuple[Any, Any]] = {}
        self._next_leaf: dict[int, int] = {}
        self.freed_per_call: dict[str, float] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        """Pay one-time costs before any clock runs: the first KV event loads (and on a
        fresh box compiles) SGLang's native hash extension."""
        cache, alloc = make_cache(self.pool_slots, page_size=16, events=True)
        for key in self.keys[:2]:
            worker_step(cache, alloc, key)
        cache.kv_events.take()
        cache.match_prefix(MatchPrefixParams(key=self.queries[0]))
        cache.evict(EvictParams(num_tokens=16))

    def _insert_match(self) -> dict[str, float]:
        keys, queries = self.keys, self.queries
        cache, alloc = make_cache(self.pool_slots)

        def insert_all() -> None:
            for key in keys:
                worker_step(cache, alloc, key)

        def match_all() -> None:
            for key in keys:
                cache.match_prefix(MatchPrefixParams(key=key))

        def split_all() -> None:
            for q in queries:
                cache.match_prefix(MatchPrefixParams(key=q))

        result = {
            "insert_seq_s": len(keys) / timed(insert_all),
            "match_full_q_s": len(keys) / timed(match_all),
            "match_split_q_s": len(queries) / timed(split_all),
        }
        matched = cache.match_prefix(MatchPrefixParams(key=queries[-1])).device_prefix_len
        assert matched == self.spec.split_at
        return result

    def _insert_events(self) -> float:
        keys = self.keys
        cache, alloc = make_cache(self.pool_slots, page_size=16, events=True)
        events: list = []

        def insert_all() -> None:
            for key in keys:
                worker_step(cache, alloc, key)
                events.extend(cache.kv_events.take())

        rate = len(keys) / timed(insert_all)
        assert events, "no KV events recorded"
        return rate

    def _evict_flat(self, num_leaves: int, calls: int) -> float:
        if num_leaves not in self._flat:
            self._flat[num_leaves] = make_cache(3 * (num_leaves + calls))
            self._next_leaf[num_leaves] = 0
            self._add_leaves(num_leaves, num_leaves)
        cache, _ = self._flat[num_leaves]
        params = EvictParams(num_tokens=1)

        def evict_some() -> None:
            for _ in range(calls):
                cache.evict(params)

        seconds = timed(evict_some)
        assert len(cache.evictable_leaves) == num_leaves - calls
        self._add_leaves(num_leaves, calls)
        return seconds / calls * 1e6

    def _add_leaves(self, num_leaves: int, n: int) -> None:
        cache, alloc = self._flat[num_leaves]
        first = self._next_leaf[num_leaves]
        for i in range(first, first + n):
            slots = alloc.alloc(3)
            assert slots is not None
            cache.insert(InsertParams(key=radix_key(flat_leaf(i)), value=slots))
        self._next_leaf[num_leaves] = first + n

    def _evict_tree(self, k: int) -> float:
        cache = build_tree(self.tree, self.tree_keys)
        calls = self.spec.tree_evict_calls
        params = EvictParams(num_tokens=k)
        freed: list[int] = []

        def evict_some() -> None:
            for _ in range(calls):
                freed.append(cache.evict(params).num_tokens_evicted)

        seconds = timed(evict_some)
        assert min(freed) >= k, "the tree ran out of evictable tokens"
        self.freed_per_call[f"k{k}"] = sum(freed) / calls
        return seconds / calls * 1e6


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang_radix", description="SGLang RadixCache on bench_radix_cache's traces."
    )
    parser.add_argument("--quick", action="store_true", help="the smoke-run traces")
    parser.add_argument("--rounds", type=int, help="rounds (default: the spec's)")
    parser.add_argument(
        "--serve", action="store_true", help="one round per stdin line, one JSON line each"
    )
    args = parser.parse_args(argv)
    spec = QUICK if args.quick else TraceSpec()
    if args.rounds is not None:
        spec = dataclasses.replace(spec, rounds=args.rounds)
    side = SGLangSide(spec)
    if args.serve:
        _emit({"trace_digest": trace_digest(spec), "version": SG["version"]})
        for _ in sys.stdin:
            result: dict[str, Any] = dict(side.round())
            result["freed_per_call"] = side.freed_per_call
            _emit(result)
        return 0
    rounds = [side.round() for _ in range(spec.rounds)]
    out: dict[str, Any] = {
        key: statistics.median(r[key] for r in rounds) for key in metric_keys(spec)
    }
    out["freed_per_call"] = side.freed_per_call
    _emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
