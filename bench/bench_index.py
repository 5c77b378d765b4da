"""Router index benchmarks: event ingest, matching, removal, hashing, and route latency.

Keys written with ``--json OUT`` (rates are per second of wall time, single thread):

Comparable section -- 2,000 sequences of 2,000 tokens that share a 512-token prefix (fixed
seed), block size 16 (125 blocks each); sequence i is stored on worker i % 16, each worker's
first sequence whole and the later ones as their suffix after the shared prefix; one stored
event per sequence, handed to the index as encoded wire bytes (decoding is timed:
``kvroute_proto.codec.decode_stream_lazy``, then applied as RouterCore applies it: a plain
batch from its scanned layout by the numba index, ``apply_wire``; otherwise the events):

* ``ingest_blocks_s``: stored blocks per second (decode + apply).
* ``find_full_q_s``: find_matches of every stored sequence's block hashes, queries/s.
* ``find_partial_q_s``: probes sharing the prefix plus 64 tokens, then diverging, queries/s.
* ``remove_blocks_s``: removing every sequence's suffix blocks (one removed event per
  sequence, as wire bytes, decoding timed), blocks/s.
  The router service decodes exactly so: its event stream hands each message's raw bytes
  to ``decode_stream_lazy`` (``router.service.worker_conn``, no gRPC deserializer) and
  ``RouterCore.on_stream_message`` applies the result (the bench leaves out the core's
  per-worker sequencing and bookkeeping, for every path alike).
  With ``--backend numba`` the decoding is the router's compiled scan
  (``codec.enable_compiled_decode``, which RouterCore turns on with that index).
* ``ingest_events_blocks_s`` / ``remove_events_blocks_s``: the same decoded into event
  objects (``decode_stream_message``) applied one by one: the service's path before
  batches were applied from their layout.
* ``hash_seq_s``: ``block_hashes`` of a 2,000-token sequence, sequences/s (with the numba
  backend the compiled chain, ``kvroute_proto.hashing.enable_compiled``, as the router uses
  with that index; with ``dict`` the numpy form).
* ``numba_warm_up_s`` (``--backend numba``): the kernels' compile or cache load at the
  process's first numba index (not part of any timed figure).
* ``find_full_array_q_s`` / ``find_partial_array_q_s`` (``--backend numba`` only): the same
  finds with the hashes as uint64 arrays (what ``block_hashes`` returns; the numba index
  takes them without converting), queries/s.

At scale -- 64 workers, 1M indexed blocks (64 system prompts of 4,096 tokens, each held by 8
workers, plus 1M other blocks in 128-block chains held by one worker each):

* ``route_p50_us`` / ``route_p99_us``: ``RouterCore.route`` of an 8,192-token prompt (a
  system prompt + 4,096 new tokens): hashing, matching, scoring 64 workers, and entering
  the prompt's blocks as predicted (sparse: 128 entries; they expire after the TTL on a clock
  that advances 10 ms per request, so predictions stay at steady state). Measured after
  ``gc.freeze()``, as a long-running router service should do after startup.
* ``route_cpu_p50_us`` / ``route_cpu_p99_us``: the same in thread CPU time (what the router
  spends itself; wall-clock p99 on a shared machine also measures preemption).
* ``bytes_per_entry``: traced memory (tracemalloc) of the index per indexed (block, worker)
  pair at 1M blocks, keys included; ``bytes_per_block`` is the same per block.

Text prompts -- the same index, with system prompts that are the token ids of texts, and a
byte-level BPE of 32,000 ids trained on English-like text first (``bench.bpe``, ~5 s):

* ``route_text_p50_us`` / ``route_text_p99_us``: what the router's front end does for an
  8,192-token text prompt (a system text + a new part of the same distribution), with that
  BPE behind the router's chunk cache (``router.service.validation.tokenize_prompt``: chunks
  seen before come from the cache; new ones are tokenized only while a worker's cache may
  still match, ``RouterCore.may_match_past``; the rest goes to the worker as text), then
  ``RouterCore.route`` of the ids with the whole prompt's estimated length.
  ``route_text_cpu_*``: the same in thread CPU time; ``route_text_tokenize_p50_us``: the
  tokenizing alone; ``route_text_split_fraction``: prompts whose tail was left to the worker;
  ``route_text_worker_tail_tokenize_p50_us``: what tokenizing that tail costs the worker;
  ``route_text_whole_*``: the same prompts through a front end that tokenizes them whole
  (``kvroute router --tokenize-whole``); ``route_text_uncached_tokenize_p50_us``: the bare
  tokenizer; ``route_text_estimate_error_pct``: mean error of the length estimate. For 50
  prompts the head's ids and the tail's own ids are checked against the whole text's (the
  run fails if they differ). The 64 system texts are shared by the prompts, the new parts
  are all different. ``--no-text`` skips the section.

``--route-metrics`` runs every second route together with what the router's metrics add to
it (``router.service.metrics.RouterMetrics.on_route``: the decision's counters and the
latency histogram, plus the two clock reads around route) and reports those as
``route_hooked_*`` beside ``route_*`` of the others: an A/B alternating request by request
on the same index, clock and box; ``--route-only`` skips the comparable
section and the memory trace (the A/B runs in BENCHMARKS.md).

Usage::

    python -m bench.bench_index [--quick] [--route-only | --comparable-only] [--no-text]
        [--route-metrics] [--backend numba|dict] [--json OUT]
    python -m bench.bench_index --rss-entries 10000000 [--rss-holders K] [--backend ...]

``--backend`` picks the index of the comparable, memory and route sections (the text route
section always runs the router's default): numba (router.core.index_nb, the router's default,
``RouterConfig.index_backend``) or dict (router.core.index, the pure-Python reference).
``--no-capi`` runs the numba index's find_matches on its plain path instead of through
CPython's C API (router.core.index_capi), for an A/B of the two.
bench/peers/dynamo_index.py runs the comparable section on Dynamo's Rust RadixTree.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from prometheus_client import CollectorRegistry

from bench.bpe import english_like_text, train_bpe
from edge.limits import RequestLimits
from edge.tokenizer import HFTokenizer
from kvroute_proto.codec import (
    WireBatch,
    decode_stream_lazy,
    decode_stream_message,
    enable_compiled_decode,
    encode_stream_message,
)
from kvroute_proto.events import DEFAULT_PARTITION, BlockRemoved, BlockStored, EventBatch
from kvroute_proto.hashing import block_hashes, enable_compiled
from router.core.index_api import IndexConfig, PrefixIndexAPI
from router.core.index_factory import make_index
from router.core.replicas import ReplicaConfig
from router.core.router_core import RouterConfig, RouterCore, RouteRequest
from router.service.metrics import RouterMetrics
from router.service.token_cache import with_chunk_cache
from router.service.validation import tokenize_prompt

VOCAB = 32_000

Feed: TypeAlias = Callable[[int, bytes], None]  # decode one stream message and apply it


BACKENDS = ("dict", "numba")
"""Index implementations the benchmarks can run (``--backend``; numba imported only when
asked for)."""


def _index(backend: str, max_blocks: int | None = None) -> PrefixIndexAPI:
    config = IndexConfig(backend=backend)
    if max_blocks is not None:
        config = dataclasses.replace(config, max_blocks=max_blocks)
    return make_index(config)


@dataclass(frozen=True, slots=True)
class ComparableConfig:
    num_seqs: int = 2000
    seq_tokens: int = 2000
    prefix_tokens: int = 512
    block_size: int = 16
    num_workers: int = 16
    probe_shared_extra: int = 64
    repeats: int = 3  # best of
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    num_blocks: int = 1_000_000
    num_workers: int = 64
    num_system_prompts: int = 64
    system_tokens: int = 4096
    holders_per_prompt: int = 8
    chain_blocks: int = 128
    prompt_tokens: int = 8192
    block_size: int = 16
    num_routes: int = 3000
    seed: int = 1


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def bench_comparable(cfg: ComparableConfig, backend: str = "dict") -> dict[str, float]:
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    prefix = rng.integers(0, VOCAB, cfg.prefix_tokens, dtype=np.uint32)
    seqs = [
        np.concatenate([prefix, rng.integers(0, VOCAB, cfg.seq_tokens - cfg.prefix_tokens)]).astype(
            np.uint32
        )
        for _ in range(cfg.num_seqs)
    ]
    hashes = [block_hashes(s, bs).tolist() for s in seqs]
    prefix_blocks = cfg.prefix_tokens // bs
    stored_msgs: list[tuple[int, bytes]] = []
    removed_msgs: list[tuple[int, bytes]] = []
    num_stored = 0
    num_removed = 0
    seen: set[int] = set()
    for i, (s, h) in enumerate(zip(seqs, hashes, strict=True)):
        w = i % cfg.num_workers
        start = 0 if w not in seen else prefix_blocks
        seen.add(w)
        ev = BlockStored(
            tuple(h[start:]),
            h[start - 1] if start else None,
            tuple(s[start * bs : len(h) * bs].tolist()),
        )
        num_stored += len(h) - start
        batch = EventBatch(f"w{w}", 1, i + 1, bs, (ev,))
        stored_msgs.append((w, encode_stream_message(batch)))
        suffix = tuple(h[prefix_blocks:])
        num_removed += len(suffix)
        batch = EventBatch(f"w{w}", 1, 10_000 + i, bs, (BlockRemoved(suffix),))
        removed_msgs.append((w, encode_stream_message(batch)))
    extra = (cfg.prefix_tokens + cfg.probe_shared_extra) // bs
    probes = []
    for h, s in zip(hashes, seqs, strict=True):
        tail = rng.integers(0, VOCAB, cfg.seq_tokens - extra * bs).astype(np.uint32)
        probe = np.concatenate([s[: extra * bs], tail])
        probes.append(block_hashes(probe, bs).tolist())
        assert probes[-1][:extra] == h[:extra]

    results: dict[str, float] = {}

    def make() -> PrefixIndexAPI:
        return _index(backend)

    index = make()
    if backend == "numba":  # as the router does with that index (RouterCore)
        enable_compiled_decode()

    wire_apply = index.prefers_wire  # as RouterCore decides (no verify_hashes)

    def wire(w: int, data: bytes) -> None:
        """The router service's path: codec.decode_stream_lazy, then RouterCore applies a
        plain batch (codec.WireBatch) from its scanned layout (NumbaPrefixIndex.apply_wire)
        and any other batch's decoded events one by one."""
        msg = decode_stream_lazy(data)
        if wire_apply and type(msg) is WireBatch:
            index.apply_wire(w, msg.layout)
        else:
            for ev in msg.events:
                index.apply(w, ev)

    def events(w: int, data: bytes) -> None:
        """The path before batches were applied from their layout: decode_stream_message
        builds the event objects, each applied one by one."""
        for ev in decode_stream_message(data).events:
            index.apply(w, ev)

    def ingest(feed: Feed = wire) -> float:
        nonlocal index
        index = make()
        gc.collect()
        t0 = time.perf_counter()
        for w, data in stored_msgs:
            feed(w, data)
        return time.perf_counter() - t0

    def remove(feed: Feed = wire) -> float:
        ingest(feed)
        gc.collect()
        t0 = time.perf_counter()
        for w, data in removed_msgs:
            feed(w, data)
        elapsed = time.perf_counter() - t0
        assert index.size() == prefix_blocks, index.size()
        return elapsed

    def find(queries: list[list[int]] | list[np.ndarray]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for q in queries:
                index.find_matches(q)  # type: ignore[arg-type]  # arrays: numba only
            return time.perf_counter() - t0

        return run

    results["ingest_blocks_s"] = num_stored / _best(ingest, cfg.repeats)
    assert index.num_entries == num_stored
    full = index.find_matches(hashes[5])
    assert full[5 % cfg.num_workers] == len(hashes[5]) and len(full) == cfg.num_workers
    expect = dict.fromkeys(range(cfg.num_workers), prefix_blocks) | {5 % cfg.num_workers: extra}
    assert index.find_matches(probes[5]) == expect
    results["find_full_q_s"] = len(hashes) / _best(find(hashes), cfg.repeats)
    results["find_partial_q_s"] = len(probes) / _best(find(probes), cfg.repeats)
    if backend == "numba":  # it also takes block_hashes' uint64 arrays as they are
        full_arrays = [np.array(h, dtype=np.uint64) for h in hashes]
        probe_arrays = [np.array(p, dtype=np.uint64) for p in probes]
        assert index.find_matches(probe_arrays[5]) == expect  # type: ignore[arg-type]
        results["find_full_array_q_s"] = len(hashes) / _best(find(full_arrays), cfg.repeats)
        results["find_partial_array_q_s"] = len(probes) / _best(find(probe_arrays), cfg.repeats)
    results["remove_blocks_s"] = num_removed / _best(remove, cfg.repeats)
    results["ingest_events_blocks_s"] = num_stored / _best(lambda: ingest(events), cfg.repeats)
    results["remove_events_blocks_s"] = num_removed / _best(lambda: remove(events), cfg.repeats)

    seq = seqs[0]
    n = 2000 if cfg.num_seqs >= 100 else 200
    if backend == "numba":  # as the router does with that index (RouterCore)
        enable_compiled()

    def hash_run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            block_hashes(seq, bs)
        return time.perf_counter() - t0

    results["hash_seq_s"] = n / _best(hash_run, cfg.repeats)
    results["comparable_blocks_stored"] = num_stored
    return results


def _fill(index: PrefixIndexAPI, cfg: ScaleConfig, system_hashes: list[list[int]]) -> None:
    """Index the system prompts on their holders and random chains up to num_blocks."""
    rng = np.random.default_rng(cfg.seed)
    for p, h in enumerate(system_hashes):
        for k in range(cfg.holders_per_prompt):
            w = (p * cfg.holders_per_prompt + k) % cfg.num_workers
            index.store(w, BlockStored(tuple(h), None, ()))
    c = 0
    while index.size() < cfg.num_blocks:
        n = min(cfg.chain_blocks, cfg.num_blocks - index.size())
        chain = tuple(rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False).tolist())
        index.store(c % cfg.num_workers, BlockStored(chain, None, ()))
        c += 1


def _system_prompts(
    cfg: ScaleConfig, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[list[int]]]:
    """The scale section's system prompts and their block hashes (RouteRequest's default
    partition seeds the hashes route() computes: the index stores the same)."""
    systems = [
        rng.integers(0, VOCAB, cfg.system_tokens, dtype=np.uint32)
        for _ in range(cfg.num_system_prompts)
    ]
    seed = DEFAULT_PARTITION.seed
    return systems, [block_hashes(s, cfg.block_size, seed).tolist() for s in systems]


def bench_scale(
    cfg: ScaleConfig,
    metrics: RouterMetrics | None = None,
    memory: bool = True,
    backend: str = "dict",
    replicas: int = 1,
) -> dict[str, float]:
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    systems, system_hashes = _system_prompts(cfg, rng)
    results: dict[str, float] = {}

    if memory:
        results.update(_bench_memory(cfg, system_hashes, backend))

    now = [0.0]
    config = RouterConfig(
        block_size=bs,
        predicted_ttl_s=5.0,
        index=IndexConfig(max_blocks=2 * cfg.num_blocks, backend=backend),
        # > 1: replicas without sync, the cost's affinity term on
        replica=ReplicaConfig(count=replicas),
    )
    core = RouterCore(config, clock=lambda: now[0], rng=random.Random(cfg.seed))
    for w in range(cfg.num_workers):
        core.add_worker(f"w{w}", f"10.0.{w // 256}.{w % 256}:50051", block_size=bs)
    _fill(core.index, cfg, system_hashes)
    new_tokens = cfg.prompt_tokens - cfg.system_tokens
    prompts = [
        np.concatenate([systems[i % len(systems)], rng.integers(0, VOCAB, new_tokens)]).astype(
            np.uint32
        )
        for i in range(cfg.num_routes)
    ]
    latencies = np.empty(cfg.num_routes)
    cpu = np.empty(cfg.num_routes)
    matched = 0
    gc.collect()
    # What a long-running router does after startup (router service): without it, every
    # ~90 requests a full collection walks the ~10^5 long-lived objects of the process
    # (numpy, grpc, ...) and costs milliseconds -- p99 then measures the collector.
    gc.freeze()
    try:
        for i, prompt in enumerate(prompts):
            req = RouteRequest(f"r{i}", prompt)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            if metrics is None or i % 2 == 0:
                d = core.route(req)
            else:  # what Frontend adds around route() when the router serves /metrics
                r0 = time.perf_counter()
                d = core.route(req)
                metrics.on_route(d, time.perf_counter() - r0)
            latencies[i] = time.perf_counter_ns() - t0
            cpu[i] = time.thread_time_ns() - c0
            core.on_first_token(req.request_id)
            core.on_finished(req.request_id)
            matched += d.matched_tokens
            now[0] += 0.01
    finally:
        gc.unfreeze()
    skip = min(100, cfg.num_routes // 10)
    warm = np.arange(cfg.num_routes) >= skip
    if metrics is None:
        results.update(_route_percentiles("route", latencies[warm], cpu[warm]))
    else:  # alternate requests ran with the hook: the same index, clock and box state
        on = warm & (np.arange(cfg.num_routes) % 2 == 1)
        off = warm & ~on
        results.update(_route_percentiles("route", latencies[off], cpu[off]))
        results.update(_route_percentiles("route_hooked", latencies[on], cpu[on]))
    results["route_mean_matched_tokens"] = matched / cfg.num_routes
    assert matched == cfg.num_routes * cfg.system_tokens, "every prompt matches its system prompt"
    results["route_index_blocks"] = core.index.size()
    return results


def _route_percentiles(prefix: str, wall_ns: np.ndarray, cpu_ns: np.ndarray) -> dict[str, float]:
    """p50/p99 in µs of wall time and of thread CPU time (what the router itself spends,
    without preemption by other processes on a shared machine)."""
    return {
        f"{prefix}_p50_us": float(np.percentile(wall_ns, 50)) / 1000,
        f"{prefix}_p99_us": float(np.percentile(wall_ns, 99)) / 1000,
        f"{prefix}_cpu_p50_us": float(np.percentile(cpu_ns, 50)) / 1000,
        f"{prefix}_cpu_p99_us": float(np.percentile(cpu_ns, 99)) / 1000,
    }


@dataclass(frozen=True, slots=True)
class TextConfig:
    """The text route section: a byte-level BPE trained here (bench.bpe) on seeded
    English-like text, prompts of the same distribution (another seed)."""

    vocab_size: int = 32_000
    train_words: int = 600_000
    rare_words: int = 60_000  # made-up words: a 32k vocabulary needs a long tail to learn
    num_routes: int = 1000
    seed: int = 7


def _text_prompts(
    tok: HFTokenizer, words: list[str], num: int, target_tokens: int, start: int
) -> tuple[list[str], int]:
    """``num`` texts of about ``target_tokens`` tokens, consecutive word windows of
    ``words`` from ``start`` (wrapping); and the word index after the last."""
    sample = " ".join(words[:4000])
    per_word = len(tok.encode(sample)) / 4000
    n = max(1, round(target_tokens / per_word))
    texts = []
    for _ in range(num):
        if start + n > len(words):
            start = 0
        texts.append(" ".join(words[start : start + n]))
        start += n
    return texts, start


def bench_route_text(
    cfg: ScaleConfig, text: TextConfig, metrics: RouterMetrics | None = None
) -> dict[str, float]:
    """``route_text_*``: what the router's front end does for a text prompt of
    ``cfg.prompt_tokens`` tokens -- tokenize it with a real BPE (edge.tokenizer,
    as ``kvroute router --model`` does), then hash, match and score it (``RouterCore.route``)
    -- on the 64-worker, 1M-block index of the token-id section, whose system prompts are
    now the token ids of system-prompt texts."""
    tok = HFTokenizer(
        train_bpe(
            text.vocab_size,
            seed=0,
            num_words=text.train_words,
            num_rare=text.rare_words,
        )
    )
    cached = with_chunk_cache(tok)  # what the router's front end tokenizes with
    words = english_like_text(
        text.num_routes * cfg.prompt_tokens // 2 + 50_000, text.seed, num_rare=text.rare_words
    ).split(" ")
    systems, pos = _text_prompts(tok, words, cfg.num_system_prompts, cfg.system_tokens, 0)
    # each system text ends a sentence and each new part starts a word: the prompt's ids
    # begin with the system text's ids (a pre-tokeniser boundary)
    new_parts, _ = _text_prompts(
        tok, words, text.num_routes, cfg.prompt_tokens - cfg.system_tokens, pos
    )
    bs = cfg.block_size
    seed = DEFAULT_PARTITION.seed
    system_hashes = [
        block_hashes(np.asarray(tok.encode(s), dtype=np.uint32), bs, seed).tolist() for s in systems
    ]
    now = [0.0]
    core = RouterCore(
        RouterConfig(
            block_size=bs,
            index=IndexConfig(max_blocks=2 * cfg.num_blocks, backend="numba"),
            predicted_ttl_s=5.0,
        ),
        clock=lambda: now[0],
        rng=random.Random(cfg.seed),
    )
    for w in range(cfg.num_workers):
        core.add_worker(f"w{w}", f"10.0.{w // 256}.{w % 256}:50051", block_size=bs)
    _fill(core.index, cfg, system_hashes)
    prompts = [f"{systems[i % len(systems)]} {new_parts[i]}" for i in range(text.num_routes)]
    limit = RequestLimits().max_prompt_tokens
    partition = DEFAULT_PARTITION

    skip = min(100, text.num_routes // 10)
    checked = range(skip, min(skip + 50, text.num_routes))  # exactness checked on these
    heads: dict[int, list[int]] = {}

    def run(tokenizer: Any, split: bool, routes: list[str], tag: str) -> dict[str, np.ndarray]:
        """Tokenize as the front end does (router.service.validation.tokenize_prompt), route,
        finish; per request: wall and CPU time in all, the tokenizing alone, the tail."""
        n = len(routes)
        out = {k: np.empty(n) for k in ("total", "cpu", "tokenize", "matched", "estimated")}
        tails: list[str] = []
        gc.collect()
        gc.freeze()
        try:
            for i, prompt in enumerate(routes):
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                ids, tail = tokenize_prompt(tokenizer, prompt, core, partition, limit, split=split)
                estimated = len(ids) + tokenizer.estimate_tokens(tail) if tail else None
                t1 = time.perf_counter_ns()
                req = RouteRequest(
                    f"{tag}{i}",
                    np.asarray(ids, dtype=np.uint32),
                    partition,
                    prompt_tokens=estimated,
                )
                if metrics is None:
                    d = core.route(req)
                else:
                    r0 = time.perf_counter()
                    d = core.route(req)
                    metrics.on_route(d, time.perf_counter() - r0)
                out["total"][i] = time.perf_counter_ns() - t0
                out["cpu"][i] = time.thread_time_ns() - c0
                out["tokenize"][i] = t1 - t0
                out["matched"][i] = d.matched_tokens
                out["estimated"][i] = d.prompt_tokens
                tails.append(tail)
                if split and i in checked:
                    heads[i] = ids.tolist()
                core.on_first_token(req.request_id)
                core.on_finished(req.request_id)
                now[0] += 0.01
        finally:
            gc.unfreeze()
        out["tails"] = np.asarray(tails, dtype=object)
        return out

    head = run(cached, True, prompts, "h")
    # the same prompts' new parts through a second router front end that tokenizes whole
    # (split_prompts=False): what the route cost before the tail was left to the workers
    now[0] += 60.0  # the first pass's predictions lapse: both passes see the same index
    whole_cache = with_chunk_cache(tok)
    for system in systems:
        whole_cache.encode(system)
    whole = run(whole_cache, False, prompts[skip:], "w")
    # exactness, and what the workers pay: each prompt's head ids and the tail's own ids
    # (no specials, as a worker encodes prompt_text_suffix) are the whole text's ids
    exact = np.empty(len(prompts) - skip)
    tail_us = []
    num_tokens: list[int] = []
    for i, prompt in enumerate(prompts[skip:]):
        t0 = time.perf_counter_ns()
        full = tok.encode(prompt)
        exact[i] = time.perf_counter_ns() - t0
        tail = head["tails"][skip + i]
        if tail:
            t0 = time.perf_counter_ns()
            rest = tok.encode(tail, add_special_tokens=False)
            tail_us.append(time.perf_counter_ns() - t0)
        else:
            rest = []
        if skip + i in heads and heads[skip + i] + rest != full:
            raise AssertionError(f"prompt {skip + i}: the head's and the tail's ids differ")
        num_tokens.append(len(full))
    est_err = np.abs(head["estimated"][skip:] - num_tokens) / np.asarray(num_tokens)
    us = 1 / 1000

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) * us

    h = {k: v[skip:] for k, v in head.items()}
    return {
        "route_text_p50_us": pct(h["total"], 50),
        "route_text_p99_us": pct(h["total"], 99),
        "route_text_cpu_p50_us": pct(h["cpu"], 50),
        "route_text_cpu_p99_us": pct(h["cpu"], 99),
        "route_text_tokenize_p50_us": pct(h["tokenize"], 50),
        "route_text_split_fraction": float(np.mean([bool(t) for t in h["tails"]])),
        "route_text_worker_tail_tokenize_p50_us": pct(np.asarray(tail_us), 50) if tail_us else 0.0,
        "route_text_whole_p50_us": pct(whole["total"], 50),
        "route_text_whole_p99_us": pct(whole["total"], 99),
        "route_text_uncached_tokenize_p50_us": pct(exact, 50),
        "route_text_mean_prompt_tokens": float(np.mean(num_tokens)),
        "route_text_estimate_error_pct": float(np.mean(est_err)) * 100,
        "route_text_mean_matched_tokens": float(np.mean(h["matched"])),
        "route_text_whole_mean_matched_tokens": float(np.mean(whole["matched"])),
    }


def _bench_memory(
    cfg: ScaleConfig, system_hashes: list[list[int]], backend: str = "dict"
) -> dict[str, float]:
    """Traced memory of a fresh index filled from empty (its key ints created while tracing)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = _index(backend)
        _fill(index, cfg, system_hashes)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    results = {
        "bytes_per_entry": used / index.num_entries,
        "bytes_per_block": used / index.size(),
        "scale_blocks": index.size(),
        "scale_entries": index.num_entries,
    }
    del index
    gc.collect()
    return results


def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def bench_memory_rss(
    entries: int, holders: int = 4, backend: str = "dict", workers: int = 64
) -> dict[str, float]:
    """``rss_bytes_per_entry``: growth of the process's RSS per (block, worker) entry after
    indexing ``entries`` entries -- random 128-block chains, each stored on ``holders``
    workers of ``workers`` -- on a fresh index; ``rss_index_mb`` the growth in MiB."""
    rng = np.random.default_rng(3)
    gc.collect()
    index = _index(backend, max_blocks=entries + 1)  # no eviction
    base = _rss_bytes()
    c = 0
    while index.num_entries < entries:
        n = min(128, -(-(entries - index.num_entries) // holders))
        chain = tuple(rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False).tolist())
        event = BlockStored(chain, None, ())
        for k in range(holders):
            index.store((c + k) % workers, event)
        c += 1
    gc.collect()
    grown = _rss_bytes() - base
    return {
        "rss_entries": index.num_entries,
        "rss_blocks": index.size(),
        "rss_index_mb": grown / 2**20,
        "rss_bytes_per_entry": grown / index.num_entries,
    }


GOALS = {
    "ingest_blocks_s": (">=", 1.38e6),
    "find_full_q_s": (">=", 36e3),
    "find_partial_q_s": (">=", 30e3),
    "remove_blocks_s": (">=", 1.5e6),
    "hash_seq_s": (">=", 80e3),
    "route_p50_us": ("<=", 100),
    "route_p99_us": ("<=", 300),
    "route_text_p50_us": ("<=", 1000),
    "route_text_p99_us": ("<=", 2000),
    "bytes_per_entry": ("<=", 150),
    "rss_bytes_per_entry": ("<=", 100),
}


def _table(results: dict[str, float]) -> str:
    lines = [f"{'metric':<28}{'value':>16}  goal"]
    for key, value in results.items():
        goal = GOALS.get(key)
        mark = ""
        if goal is not None:
            op, target = goal
            ok = value >= target if op == ">=" else value <= target
            mark = f"{op} {target:,.0f} {'ok' if ok else 'MISSED'}"
        shown = f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
        lines.append(f"{key:<28}{shown:>16}  {mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_index",
        description="Router index benchmarks (ingest, match, remove, hash, route, memory).",
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--route-only",
        action="store_true",
        help="only the route section (no comparable section, no memory trace)",
    )
    parser.add_argument(
        "--no-text",
        action="store_true",
        help="skip the text route section (it trains a 32k BPE first, a few seconds)",
    )
    parser.add_argument(
        "--route-metrics",
        action="store_true",
        help="time each route with the router's metrics hook (RouterMetrics.on_route)",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="numba",
        help="index implementation of the comparable, memory and route sections "
        "(numba: router.core.index_nb, the router's default; dict: router.core.index, the "
        "reference) (default: numba)",
    )
    parser.add_argument(
        "--no-capi",
        action="store_true",
        help="numba: find_matches on its plain path, not through CPython's C API "
        "(router.core.index_capi), every section",
    )
    parser.add_argument(
        "--comparable-only",
        action="store_true",
        help="only the comparable section (what bench/peers/dynamo_index.py runs for Dynamo)",
    )
    parser.add_argument(
        "--route-workers",
        type=int,
        default=64,
        metavar="N",
        help="workers of the route sections' fleet (default: 64)",
    )
    parser.add_argument(
        "--route-replicas",
        type=int,
        default=1,
        metavar="R",
        help="the route section's router is one of R replicas without sync (R > 1: the "
        "cost's affinity term is on) (default: 1)",
    )
    parser.add_argument(
        "--rss-entries",
        type=int,
        metavar="N",
        help="only the RSS section: index N (block, worker) entries and report the "
        "process's RSS growth per entry",
    )
    parser.add_argument(
        "--rss-holders",
        type=int,
        default=4,
        metavar="K",
        help="RSS section: workers holding each block (default: 4)",
    )
    args = parser.parse_args(argv)
    if args.rss_entries:
        results = bench_memory_rss(args.rss_entries, args.rss_holders, args.backend)
        print(_table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**results, "meta": {"backend": args.backend}}, f, indent=2)
        return 0
    if args.quick:
        comparable = ComparableConfig(num_seqs=64, repeats=1)
        scale = ScaleConfig(num_blocks=20_000, num_system_prompts=4, num_routes=60)
        text = TextConfig(vocab_size=1000, train_words=20_000, rare_words=2000, num_routes=30)
    else:
        comparable, scale, text = ComparableConfig(), ScaleConfig(), TextConfig()
    if args.route_workers != scale.num_workers:
        scale = dataclasses.replace(scale, num_workers=args.route_workers)
    if args.no_capi:  # every numba index of this process (RouterCore's included)
        from router.core import index_nb

        index_nb.CAPI_DEFAULT = False
    results = {}
    if args.backend == "numba":  # compiling, or loading from numba's cache: not timed below
        from router.core.index_nb import warm_up

        t0 = time.perf_counter()
        results["numba_warm_up_s"] = time.perf_counter() - t0 if warm_up() else 0.0
    if not args.route_only:
        results.update(bench_comparable(comparable, args.backend))
    metrics = RouterMetrics(CollectorRegistry()) if args.route_metrics else None
    if not args.comparable_only:
        results.update(
            bench_scale(scale, metrics, not args.route_only, args.backend, args.route_replicas)
        )
    if not args.no_text and not args.comparable_only:
        results.update(bench_route_text(scale, text, metrics))
    meta = {
        "quick": args.quick,
        "route_metrics": args.route_metrics,
        "backend": args.backend,
        "capi": not args.no_capi,
        "route_workers": args.route_workers,
        "route_replicas": args.route_replicas,
        "loadavg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "meta": meta}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
