"""The bridge's event path per stored block, in one process and with no sockets.

    python -m bench.bench_bridge_translate [--batches 600] [--repeats 3] [--json OUT]

The batches of :mod:`bench.bench_bridge_events` (an engine step: ``--chains-per-batch``
new chains of ``--blocks-per-chain`` 16-token blocks, as many blocks removed once
``--keep-chains`` chains are held), run through the bridge's three stages one after the
other: decode the engine's msgpack (:func:`worker.bridge.engine_wire.decode_frames`),
translate (:meth:`worker.bridge.translate.EventTranslator.feed`), and encode our batches as
the bridge sends them (``KvStreamMessage`` bytes). Reported: microseconds per stored block
for each stage (best of ``--repeats``), the whole loop with the garbage collector on as the
bridge runs it (``gc.freeze()`` after start-up, as ``kvroute bridge`` does), the
collector's share of that and its longest pause, and the longest engine step's batch
(``longest_frame_ms``: a dict of the held maps rebuilding its table shows there), and the
longest once the cache is full, as many blocks removed as stored (``longest_full_frame_ms``:
a table that grows while the cache fills shows only in the first). Times are the process's
CPU time, so that other jobs on the host do not count.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from typing import Any

from bench.bench_bridge_events import TOPIC, Engine
from bench.procs import report
from kvroute_proto import codec
from worker.bridge.engine_wire import EngineBatch, decode_frames
from worker.bridge.service.cli import enable_compiled_event_path
from worker.bridge.translate import EventTranslator, TranslatorConfig


def _frames(args: argparse.Namespace) -> list[list[bytes]]:
    engine = Engine(None, args.chains_per_batch, args.blocks_per_chain, args.keep_chains)  # type: ignore[arg-type]
    engine.make(args.batches)
    made = enumerate(engine.made)
    return [[TOPIC, seq.to_bytes(8, "big"), payload] for seq, (_, payload) in made]


def _stages(frames: list[list[bytes]]) -> tuple[float, float, float]:
    """Seconds to decode, translate and encode every frame (collector off)."""
    t0 = time.process_time()
    batches = [decode_frames(f) for f in frames]
    t1 = time.process_time()
    translator = EventTranslator(TranslatorConfig("bench", 16), random.Random(1))
    ours = []
    for b in batches:
        assert isinstance(b, EngineBatch)
        translator.feed(b)
        ours.extend(translator.take_batches())
    t2 = time.process_time()
    for batch in ours:
        codec.stream_message_to_pb(batch).SerializeToString()
    t3 = time.process_time()
    return t1 - t0, t2 - t1, t3 - t2


def _whole(frames: list[list[bytes]], full_from: int) -> tuple[float, float, float, float, float]:
    """CPU seconds for the three stages frame by frame with the collector on, the
    collector's share of them, its longest pause, the longest frame (an engine step's
    batch, the collector's pauses in it included) and the longest from frame
    ``full_from`` on."""
    pauses: list[float] = []
    began = [0.0]

    def timed(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.process_time()
        else:
            pauses.append(time.process_time() - began[0])

    translator = EventTranslator(TranslatorConfig("bench", 16), random.Random(1))
    gc.callbacks.append(timed)
    gc.enable()
    t0 = time.process_time()
    longest = [0.0, 0.0]
    for i, f in enumerate(frames):
        began_frame = time.process_time()
        b = decode_frames(f)
        assert isinstance(b, EngineBatch)
        translator.feed(b)
        for batch in translator.take_batches():
            codec.stream_message_to_pb(batch).SerializeToString()
        took = time.process_time() - began_frame
        longest[0] = max(longest[0], took)
        if i >= full_from:
            longest[1] = max(longest[1], took)
    elapsed = time.process_time() - t0
    gc.disable()
    gc.callbacks.remove(timed)
    return elapsed, sum(pauses), max(pauses, default=0.0), longest[0], longest[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--chains-per-batch", type=int, default=16)
    parser.add_argument("--blocks-per-chain", type=int, default=64)
    parser.add_argument("--keep-chains", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    frames = _frames(args)
    enable_compiled_event_path()  # as kvroute bridge does at start
    stored = args.batches * args.chains_per_batch * args.blocks_per_chain
    gc.collect()
    gc.freeze()  # as kvroute bridge does after start-up
    gc.disable()
    best = [min(s) for s in zip(*(_stages(frames) for _ in range(args.repeats)), strict=True)]
    full_from = -(-args.keep_chains // args.chains_per_batch)  # the first batch removing
    whole = min((_whole(frames, full_from) for _ in range(args.repeats)), key=lambda w: w[0])
    us = 1e6 / stored
    result: dict[str, Any] = {
        "bench": "bridge_translate",
        "stored_blocks": stored,
        "decode_us_per_block": round(best[0] * us, 3),
        "translate_us_per_block": round(best[1] * us, 3),
        "encode_us_per_block": round(best[2] * us, 3),
        "stages_us_per_block": round(sum(best) * us, 3),
        "whole_gc_on_us_per_block": round(whole[0] * us, 3),
        "gc_us_per_block": round(whole[1] * us, 3),
        "gc_longest_pause_ms": round(whole[2] * 1e3, 2),
        "longest_frame_ms": round(whole[3] * 1e3, 2),
        "longest_full_frame_ms": round(whole[4] * 1e3, 2),
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
