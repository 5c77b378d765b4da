"""NumbaPrefixIndex (numba kernels) against PrefixIndex (dicts, the reference): the shared
agreement state machine (index_agreement.py) on generated histories, seeded long histories,
collisions, table growth and traced memory."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from index_agreement import IndexAgreement

from kvroute_proto.codec import PackedHashes, decode_stream_message, encode_stream_message
from kvroute_proto.events import BlockRemoved, BlockStored, EventBatch
from router.core.index import PrefixIndex
from router.core.index_api import IndexConfig
from router.core.index_nb import NumbaPrefixIndex, _as_keys, warm_up

ROOT = Path(__file__).resolve().parents[3]


class NumbaAgreement(IndexAgreement):
    make_other = NumbaPrefixIndex


class NumbaPlainAgreement(IndexAgreement):
    """The same on find_matches' plain path (no C API: router.core.index_capi)."""

    @staticmethod
    def make_other(config: IndexConfig) -> NumbaPrefixIndex:
        return NumbaPrefixIndex(config, capi=False)


NumbaAgreement.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
NumbaPlainAgreement.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNumbaAgreesWithDictIndex = NumbaAgreement.TestCase
TestNumbaPlainAgreesWithDictIndex = NumbaPlainAgreement.TestCase
CAPI = pytest.mark.parametrize("capi", [True, False], ids=["capi", "plain"])


def test_held_prediction_with_a_repeated_hash_releases() -> None:
    """A prompt whose sparse probes repeat a hash (a collision): held once, freed once
    (release raised KeyError before), on both indexes."""
    for make in (PrefixIndex, NumbaPrefixIndex):
        index = make(IndexConfig(predict_stride=1))
        handle = index.predict(3, [5, 5, 6], 1.0, hold=True)
        index.release_predicted(handle, 2.0)
        assert index.predicted(3) == {5, 6}
        assert index.expire(2.0) == 2 and index.predicted(3) == set()


def test_a_repeated_hash_held_twice_is_freed_by_two_releases() -> None:
    """Two holds of a prompt whose probes repeat a hash count two (the dict index counted
    the second three: its counts were written while still being read), so two releases free
    it and it expires; found by the agreement machine."""
    for make in (PrefixIndex, NumbaPrefixIndex):
        index = make(IndexConfig(predict_stride=2))
        handles = [index.predict(0, [0, 0, 0, 0], 1.5, hold=True) for _ in range(2)]
        for handle in handles:
            index.release_predicted(handle, 1.5)
        assert index.expire(1.0) == 0 and index.predicted(0) == {0}
        assert index.expire(1.5) == 1 and index.predicted(0) == set()
        assert index.num_predicted == 0


def _pair(capi: bool = True, **kw: int) -> tuple[PrefixIndex, NumbaPrefixIndex]:
    config = IndexConfig(**kw)
    return PrefixIndex(config), NumbaPrefixIndex(config, capi=capi)


def _assert_same(ref: PrefixIndex, nb: NumbaPrefixIndex, slots: range | list[int]) -> None:
    nb.check_invariants()
    assert nb.size() == ref.size() and nb.num_entries == ref.num_entries
    assert nb.num_evicted == ref.num_evicted and dict(nb.errors) == dict(ref.errors)
    for s in slots:
        assert nb.snapshot(s) == ref.snapshot(s), s
        assert nb.predicted(s) == ref.predicted(s), s


def test_eviction_order_and_inherited_stamps() -> None:
    """A prefix matched after another chain was stored outlives that chain's leaf once its
    own tail is evicted (it keeps the later of its own stamp and its child's)."""
    a = list(range(100, 110))
    b = list(range(200, 204))
    ref, nb = _pair(max_blocks=16)
    for index in (ref, nb):
        index.store(0, BlockStored(tuple(a), None, ()))
        index.store(1, BlockStored(tuple(b), None, ()))
        index.find_matches(a[:3])  # stamps a[2] after b's leaf
        index.store(2, BlockStored(tuple(range(300, 309)), None, ()))  # 23 > 16: evict 8
    _assert_same(ref, nb, range(3))
    # a's tail (7 blocks, inheriting its leaf's stamp) goes, then b's leaf, not a[2]
    assert nb.snapshot(0) == set(a[:3]) and nb.snapshot(1) == set(b[:3])


@CAPI
def test_long_random_histories_agree(capi: bool) -> None:
    """Seeded histories longer than the state machine's: branching chains (a shared head
    stored once, suffixes stored with their parent), partial finds that touch, removals of
    suffixes, worker removal, predictions with holds -- with a size cap small enough to
    evict often, over 70 workers (two bitset words)."""
    for seed in range(12):
        rng = random.Random(seed)
        ref, nb = _pair(
            capi, max_blocks=rng.choice([30, 60, 200]), predict_stride=rng.choice([1, 4])
        )
        heads = [[rng.getrandbits(64) for _ in range(rng.randint(1, 6))] for _ in range(5)]
        chains: list[list[int]] = []
        handles: list[tuple[object, object]] = []
        now = 0.0
        for _ in range(300):
            op = rng.random()
            w = rng.choice([0, 1, 2, 3, 69])
            if op < 0.35:
                head = rng.choice(heads)
                tail = [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
                chains.append(head + tail)
                for index in (ref, nb):
                    index.store(w, BlockStored(tuple(head), None, ()))
                    index.store(w, BlockStored(tuple(tail), head[-1], ()))
            elif op < 0.6 and chains:
                c = rng.choice(chains)
                q = c[: rng.randint(1, len(c))] + [rng.getrandbits(64)] * rng.randint(0, 2)
                touch = rng.random() < 0.8
                assert ref.find_matches(q, touch) == nb.find_matches(q, touch)
                assert ref.last_confirmed == nb.last_confirmed
            elif op < 0.72 and chains:
                c = rng.choice(chains)
                victims = tuple(c[rng.randint(0, len(c) - 1) :])
                ref.remove(w, victims)
                nb.remove(w, victims)
            elif op < 0.75:
                assert ref.remove_worker(w) == nb.remove_worker(w)
            elif op < 0.9 and chains:
                c = rng.choice(chains)
                start, hold = rng.randint(0, len(c)), rng.random() < 0.5
                h1 = ref.predict(w, c, now + 1.0, start, hold)
                h2 = nb.predict(w, c, now + 1.0, start, hold)
                assert list(h1) == list(h2)
                if hold and h1:
                    handles.append((h1, h2))
            elif op < 0.95 and handles:
                h1, h2 = handles.pop(rng.randrange(len(handles)))
                ref.release_predicted(h1, now + 1.0)  # type: ignore[arg-type]
                nb.release_predicted(h2, now + 1.0)  # type: ignore[arg-type]
            else:
                now += rng.choice([0.3, 1.0])
                assert ref.expire(now) == nb.expire(now)
            assert ref.size() == nb.size() and ref.num_evicted == nb.num_evicted
        _assert_same(ref, nb, [0, 1, 2, 3, 69])
        for c in chains:
            assert ref.find_matches(c, False) == nb.find_matches(c, False)


def _same_home(home: int, count: int) -> list[int]:
    """``count`` distinct hashes whose home row is ``home`` in any table of up to 2**32
    rows (home = ((h * ODD) >> 32) & (rows - 1))."""
    inv = pow(0x9E3779B97F4A7C15, -1, 1 << 64)
    return [((home << 32) + j + 1) * inv % (1 << 64) for j in range(count)]


@CAPI
def test_crowded_and_wrapping_probe_runs_agree(capi: bool) -> None:
    """Keys sharing home rows, at the table's end too (probe runs wrap to row 0): stored,
    removed from the middle of runs (rows shift back), found, stored again."""
    crowd = _same_home(1023, 12) + _same_home(0, 5) + _same_home(5, 20) + _same_home(6, 6)
    ref, nb = _pair(capi)
    for w, part in enumerate((crowd[:10], crowd, crowd[5:30], crowd[::-1])):
        for index in (ref, nb):
            index.store(w, BlockStored(tuple(part), None, ()))
    _assert_same(ref, nb, range(4))
    for index in (ref, nb):
        index.remove(1, crowd[3:17])
        index.remove(3, crowd[::3])
        index.remove(0, crowd[:4])
        index.store(0, BlockStored(tuple(crowd[::2]), None, ()))
    _assert_same(ref, nb, range(4))
    for q in (crowd, crowd[::-1], crowd[5:], crowd[::2]):
        assert nb.find_matches(q) == ref.find_matches(q)
        # a uint64 array taken as it is: strided and reversed views too
        array = np.array(q, dtype=np.uint64)
        for view in (array, array[::2], array[::-1], array[1:]):
            assert nb.find_matches(view) == ref.find_matches(view.tolist())
    for index in (ref, nb):
        index.predict(7, crowd[::-1], 1.0, hold=True)
        index.predict(8, crowd, 2.0)
        index.remove_worker(7)
    _assert_same(ref, nb, [7, 8])
    assert ref.expire(1.5) == nb.expire(1.5) and ref.expire(3.0) == nb.expire(3.0)
    _assert_same(ref, nb, [7, 8])


def test_tables_grow_and_shrink_back() -> None:
    """Thousands of chains stored then removed: same answers throughout, and the table
    returns to its initial size (memory comes back after removals)."""
    rng = random.Random(7)
    ref, nb = _pair()
    empty_bytes = nb.approx_bytes()
    chains = [[rng.getrandbits(64) for _ in range(50)] for _ in range(400)]
    for i, c in enumerate(chains):
        for index in (ref, nb):
            index.store(i % 5, BlockStored(tuple(c), None, ()))
    _assert_same(ref, nb, range(5))
    assert nb.approx_bytes() > 10 * empty_bytes
    for c in chains[::7]:
        assert nb.find_matches(c) == ref.find_matches(c)
    for i, c in enumerate(chains):
        for index in (ref, nb):
            index.remove(i % 5, c)
    _assert_same(ref, nb, range(5))
    assert nb.size() == 0 and nb.approx_bytes() == empty_bytes


def test_tables_grown_in_place_keep_every_row_findable() -> None:
    """Growth re-places rows in the enlarged table itself: probe runs that wrap past the old
    table's end, runs that would wrap past the new one's (their rows are placed last), rows
    nobody holds (dropped on the way), growth by more than a doubling in one store, and a
    table someone else holds a reference to (grown into a new table instead)."""
    rng = random.Random(11)
    ref, nb = _pair()
    # homes 1023 / 2047 / 4095 in tables of 1024 / 2048 / 4096 rows: runs at the end of
    # each table; homes 0 and 1: the rows wrapped runs run into
    crowd = _same_home(1023, 9) + _same_home(2047, 9) + _same_home(4095, 9)
    crowd += _same_home(0, 4) + _same_home(1, 4)
    dead = [rng.getrandbits(64) for _ in range(150)]
    for index in (ref, nb):
        index.store(0, BlockStored(tuple(crowd), None, ()))
        index.store(1, BlockStored(tuple(dead), None, ()))
        index.remove(1, dead)  # dead rows in the table when it grows
    _assert_same(ref, nb, range(3))
    chains = [crowd]
    sizes = {len(nb._tab)}
    for i in range(120):
        c = [rng.getrandbits(64) for _ in range(rng.randrange(1, 40))]
        chains.append(c)
        for index in (ref, nb):
            index.store(i % 3, BlockStored(tuple(c), None, ()))
        if len(nb._tab) not in sizes:
            sizes.add(len(nb._tab))
            _assert_same(ref, nb, range(3))
            for q in chains:
                assert nb.find_matches(q, False) == ref.find_matches(q, False)
    assert len(sizes) >= 3  # grown at least twice
    long = [rng.getrandbits(64) for _ in range(20_000)]  # more than doubles the table
    before = len(nb._tab)
    held = nb._tab  # a reference held elsewhere: the table is not resized under it
    copy = held.copy()
    for index in (ref, nb):
        index.store(2, BlockStored(tuple(long), None, ()))
    assert len(nb._tab) >= 8 * before and np.array_equal(held, copy)
    del held
    more = [rng.getrandbits(64) for _ in range(60_000)]
    for index in (ref, nb):
        index.store(1, BlockStored(tuple(more), None, ()))
    _assert_same(ref, nb, range(3))
    for q in [*chains, long, more, long[::-1]]:
        assert nb.find_matches(q, False) == ref.find_matches(q, False)


@CAPI
def test_array_hashes_answer_as_lists(capi: bool) -> None:
    """uint64 arrays (what block_hashes returns) are taken as they are, 0 included."""
    nb = NumbaPrefixIndex(IndexConfig(predict_stride=2), capi=capi)
    chain = [0, 2**64 - 1, 5, 2**63, 9]
    nb.store(3, BlockStored(tuple(chain[:3]), None, ()))
    nb.store(4, BlockStored(tuple(chain), None, ()))
    arr = np.array(chain, dtype=np.uint64)
    assert nb.find_matches(arr) == nb.find_matches(chain) == {3: 3, 4: 5}
    handle = nb.predict(5, arr, 1.0, hold=True)
    assert list(handle) == [2**64 - 1, 2**63] and handle
    nb.release_predicted(handle, 2.0)
    assert nb.predicted(5) == {2**64 - 1, 2**63}
    assert nb.find_matches(arr[:4], touch=False) == {3: 3, 4: 4, 5: 4}
    assert nb.snapshot(4) == set(chain)


def test_kernels_compile_without_a_writable_cache() -> None:
    """Where numba finds no place to cache (a read-only install, no home directory), the
    kernels are compiled in the process instead of failing at import."""
    code = (
        "import numba.core.caching as c\n"
        "c.CacheImpl._locator_classes = []\n"  # as if no locator found a writable place
        "import router.core.index_nb as m\n"
        "import kvroute_proto.jit as j\n"
        "assert not j.CACHED\n"
        "index = m.NumbaPrefixIndex()\n"
        "from kvroute_proto.events import BlockStored\n"
        "index.store(0, BlockStored((1, 2), None, ()))\n"
        "assert index.find_matches([1, 2, 3]) == {0: 2}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=600)


def test_traced_memory_returns_after_removals_and_remove_worker() -> None:
    """test_index_memory.py's rounds on the numba index, the index made while tracing: after
    each round of storing ~10k blocks and removing them (or their workers), the traced
    memory is back to what the empty index held."""
    rng = random.Random(3)
    chains = [[rng.getrandbits(64) for _ in range(50)] for _ in range(200)]
    warm_up()  # the kernels, loaded or compiled once per process, are not the index's
    tracemalloc.start()
    try:
        index = NumbaPrefixIndex()
        gc.collect()
        baseline = tracemalloc.get_traced_memory()[0]
        for rnd in range(4):
            for i, c in enumerate(chains):
                index.store(i % 4, BlockStored(tuple(c), None, ()))
            index.predict(3, [h + 1 for c in chains[:40] for h in c], deadline=float(rnd))
            gc.collect()
            assert tracemalloc.get_traced_memory()[0] - baseline > 300_000
            if rnd % 2:
                for w in range(4):
                    index.remove_worker(w)
            else:
                for i, c in enumerate(chains):
                    index.remove(i % 4, c)
            index.expire(float(rnd))
            index.predict(3, [1, 2, 3, 4], deadline=float(rnd))  # shrinks the predicted table
            index.expire(float(rnd))
            assert index.size() == 0 and index.num_predicted == 0
            gc.collect()
            assert tracemalloc.get_traced_memory()[0] - baseline < 20_000, f"round {rnd}"
    finally:
        tracemalloc.stop()


def test_decoded_events_hashes_go_to_the_kernels_unconverted() -> None:
    """Events decoded from wire bytes carry their hashes' uint64 words (PackedHashes):
    the index hands that array to its kernels as it is, with the same answers."""
    chain = tuple(range(1, 9))
    batch = EventBatch("w", 1, 1, 1, (BlockStored(chain, None, chain), BlockRemoved(chain[4:])))
    decoded = decode_stream_message(encode_stream_message(batch))
    assert isinstance(decoded, EventBatch)
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored) and isinstance(stored.block_hashes, PackedHashes)
    assert _as_keys(stored.block_hashes) is stored.block_hashes.array
    ref, nb = _pair()
    for ev in decoded.events:
        ref.apply(3, ev)
        nb.apply(3, ev)
    assert nb.find_matches(list(chain)) == ref.find_matches(list(chain)) == {3: 4}
    _assert_same(ref, nb, [3])


def test_dead_rows_come_back_as_new_blocks() -> None:
    """A block all its holders removed stays in the numba table as a dead row; stored again,
    it is a new block, as in the dict index: no parent unless the event gives one, no stamp
    unless it is the event's last -- which the size cap's eviction order (leaves, stamps)
    shows, with one eviction and with two."""
    for cap in (6, 5):
        ref, nb = _pair(max_blocks=cap)
        for index in (ref, nb):
            index.store(0, BlockStored((1,), None, ()))
            index.store(0, BlockStored((2, 3), 1, ()))  # 2's parent: 1
            index.store(0, BlockStored((9,), None, ()))  # 9 stamped
            index.remove(0, (2, 3, 9))  # dead rows in the numba table
            index.store(1, BlockStored((2,), None, ()))  # 2 again: a root now
            index.store(1, BlockStored((9, 10), None, ()))  # 9 again: not stamped
            index.remove(1, (10,))  # 9 a leaf, never stamped since it came back
            index.store(2, BlockStored((20, 21, 22, 23), None, ()))  # past the cap
        assert ref.num_evicted == nb.num_evicted == 7 - (cap - cap // 16)
        _assert_same(ref, nb, [0, 1, 2])


def test_dead_rows_do_not_pile_up() -> None:
    """Stores and removals that leave dead rows rebuild the table (dropping them) instead
    of growing it: its rows stay bounded by the live blocks."""
    rng = random.Random(5)
    ref, nb = _pair()
    for _ in range(400):
        chain = tuple(rng.getrandbits(64) for _ in range(50))
        for index in (ref, nb):
            index.store(rng.randrange(3), BlockStored(chain, None, ()))
            index.remove(0, chain)
            index.remove(1, chain)
            index.remove(2, chain)
    _assert_same(ref, nb, [0, 1, 2])
    assert nb.size() == 0 and nb._tab.shape[0] <= 1024


@CAPI
def test_list_queries_are_read_only_as_far_as_the_walks_go(capi: bool) -> None:
    """A list query's ints are read by the kernel as the walks reach them (no conversion
    of the whole list first): the answers are the array query's and the dict index's; an
    item it reads that is no uint64 int raises as numpy's conversion does, with nothing
    changed; items past where both walks stop are never read, as in the dict index."""
    from router.core.index_nb_table import _M_TICK

    ref, nb = _pair(capi, predict_stride=4)
    chain = list(range(1, 41))
    for index in (ref, nb):
        index.store(0, BlockStored(tuple(chain[:30]), None, ()))
        index.store(1, BlockStored(tuple(chain[:10]), None, ()))
        index.predict(2, chain, 5.0)  # slot 2: predicted along all 40 (10 probes)
    arr = np.array(chain, dtype=np.uint64)
    assert nb.find_matches(chain) == nb.find_matches(arr) == ref.find_matches(chain)
    assert nb.find_matches(chain) == {0: 30, 1: 10, 2: 40}
    # numpy ints in a list: numpy's conversion takes them
    mixed: list[object] = [*chain[:5], np.uint64(6), *chain[6:]]
    assert nb.find_matches(mixed) == {0: 30, 1: 10, 2: 40}  # type: ignore[arg-type]
    tick = int(nb._meta[_M_TICK])
    for bad, error in (
        ([*chain[:3], -1], OverflowError),
        ([*chain[:3], 2**64], OverflowError),
        ([1, "x"], ValueError),
        ([1, None], TypeError),
        # read by the predicted walk only (the confirmed one stops at 30), after it found
        # the confirmed depths it would stamp
        ([*chain[:39], -1], OverflowError),
    ):
        with pytest.raises(error):
            nb.find_matches(bad)  # type: ignore[arg-type]
    assert int(nb._meta[_M_TICK]) == tick  # no stamp from a query that raised
    # past both walks' ends (a miss at 31 with slot 2's predictions expired): never read
    assert ref.expire(6.0) == nb.expire(6.0) == 10
    tail: list[object] = [*chain[:30], 999, *([7] * 20), "x", None, -1]
    assert nb.find_matches(tail) == ref.find_matches(tail) == {0: 30, 1: 10}  # type: ignore[arg-type]
    assert int(nb._meta[_M_TICK]) == tick + 1  # touched once: the query that answered
    # a list longer than the scratch rows grows them
    long = [*chain[:30], *range(10_000, 15_000)]
    assert nb.find_matches(long) == ref.find_matches(long) == {0: 30, 1: 10}


@CAPI
def test_answers_written_by_the_kernel_own_their_ints(capi: bool) -> None:
    """find_matches' dicts are filled by the kernel (CPython's C API): every int it makes
    belongs to its dict, so 10,000 answers dropped leave no traced memory behind, and an
    answer's value is held by nothing but its dict (depths past 256: no cached ints)."""
    nb = NumbaPrefixIndex(IndexConfig(predict_stride=4), capi=capi)
    chain = list(range(1, 400))
    for w in range(20):
        nb.store(w, BlockStored(tuple(chain[: 300 + w]), None, ()))
    nb.predict(30, chain, 1e9)  # a second dict: confirmed and the predicted-longer answer
    arr = np.array(chain, dtype=np.uint64)
    answer = nb.find_matches(chain)
    assert answer == {**{w: 300 + w for w in range(20)}, 30: 396} == nb.find_matches(arr)
    assert nb.last_confirmed == {w: 300 + w for w in range(20)}
    value = answer.pop(30)
    assert sys.getrefcount(value) <= 2  # the name and getrefcount's argument
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(5_000):
            nb.find_matches(chain)
            nb.find_matches(arr)
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - baseline < 20_000
    finally:
        tracemalloc.stop()


@CAPI
def test_match_depth_reads_one_worker(capi: bool) -> None:
    """match_depth: one slot's find_matches answer -- confirmed, continued by predicted
    probes, past the tables' words -- for lists and arrays, writable or not."""
    ref, nb = _pair(capi, max_blocks=100, predict_stride=2)
    chain = [11, 12, 13, 14, 15, 16]
    for index in (ref, nb):
        index.store(0, BlockStored(tuple(chain[:4]), None, ()))
        index.store(1, BlockStored(tuple(chain[:2]), None, ()))
        index.predict(1, chain, 5.0, start=2)  # probes 14 and 16: 1 holds all six
        index.predict(70, chain[:4], 5.0)  # slot 70: predicted alone, a second word
    arr = np.array(chain, dtype=np.uint64)
    readonly = arr.copy()
    readonly.flags.writeable = False
    for index in (ref, nb):
        answer = index.find_matches(chain, touch=False)
        assert answer == {0: 4, 1: 6, 70: 4}
        for w in (0, 1, 2, 63, 64, 70, 200):
            assert index.match_depth(w, chain) == answer.get(w, 0)
    for q in (arr, readonly, arr[::2]):
        assert nb.match_depth(1, q) == ref.match_depth(1, q.tolist())
    assert nb.match_depth(0, []) == ref.match_depth(0, []) == 0
    for index in (ref, nb):
        with pytest.raises(ValueError, match="slot must be >= 0"):
            index.match_depth(-1, chain)
