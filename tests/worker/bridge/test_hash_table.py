"""The held maps' compiled table (decision 0046) against a dict: runs in and out, single
keys, growth from a small table, negative (SGLang) and unsigned (vLLM) 64-bit keys, keys it
keeps in its side dict (bytes, ints past 64 bits), clear; and steady churn that never
grows it."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from worker.bridge.hash_table import U64, HashCodes

GOLDEN = 0x9E3779B97F4A7C15

EDGES = [0, 1, -1, 2**63 - 1, 2**63, -(2**63), U64 - 1, U64, -(2**63) - 1, 2**100]
keys = st.one_of(
    st.integers(0, 40),  # a small pool: repeats, in runs and across them
    st.integers(-40, -1),
    st.sampled_from(EDGES),
    st.integers(-(2**63), U64 - 1),
    st.binary(max_size=3),  # b"12" must not be taken for 12
    st.sampled_from([b"12", b"0", 12]),
)


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = HashCodes(8)  # grows while the tests fill it
        self.model: dict[object, int] = {}
        self.next_code = 1

    def _codes(self, n: int) -> int:
        base = self.next_code
        self.next_code += n
        return base

    @rule(run=st.lists(keys, max_size=12), as_array=st.booleans())
    def put_run(self, run: list[object], as_array: bool) -> None:
        arg: list[object] | np.ndarray = run
        if as_array and run and all(type(k) is int for k in run):
            if all(0 <= k < U64 for k in run):  # type: ignore[operator]
                arg = np.array(run, dtype=np.uint64)
            elif all(-(2**63) <= k < 2**63 for k in run):  # type: ignore[operator]
                arg = np.array(run, dtype=np.int64)
        base = self._codes(len(run))
        fresh = len(set(run)) == len(run) and not any(k in self.model for k in run)
        assert self.table.put_run(arg, base) == fresh
        if fresh:
            self.model.update((k, base + i) for i, k in enumerate(run))

    @rule(start=st.integers(-(2**63), U64 - 1), n=st.integers(1, 200), stride=st.integers(1, 2**40))
    def put_many(self, start: int, n: int, stride: int) -> None:
        """A long strided run: growth, and long probe runs."""
        run = [k for k in range(start, start + n * stride, stride) if k < U64]
        base = self._codes(len(run))
        fresh = not any(k in self.model for k in run)
        assert self.table.put_run(run, base) == fresh
        if fresh:
            self.model.update((k, base + i) for i, k in enumerate(run))

    @rule(data=st.data(), extra=st.lists(keys, max_size=4))
    def pop_run(self, data: st.DataObject, extra: list[object]) -> None:
        held = list(self.model)
        run = data.draw(st.lists(st.sampled_from(held), max_size=30)) if held else []
        run += extra
        got = self.table.pop_run(run).tolist()
        assert got == [self.model.pop(k, 0) for k in run]

    @rule(key=keys)
    def put(self, key: object) -> None:
        code = self._codes(1)
        fresh = key not in self.model
        assert self.table.put(key, code) == fresh  # type: ignore[arg-type]
        if fresh:
            self.model[key] = code

    @rule(data=st.data(), other=keys)
    def pop(self, data: st.DataObject, other: object) -> None:
        key = data.draw(st.sampled_from(list(self.model))) if self.model else other
        assert self.table.pop(key) == self.model.pop(key, None)  # type: ignore[arg-type]

    @rule(key=keys)
    def get(self, key: object) -> None:
        assert self.table.get(key) == self.model.get(key)  # type: ignore[arg-type]
        assert (key in self.table) == (key in self.model)

    @rule()
    def clear(self) -> None:
        self.table.clear()
        self.model.clear()

    @invariant()
    def same(self) -> None:
        assert len(self.table) == len(self.model)
        items = self.table.items()
        assert len(items) == len(self.model) and dict(items) == self.model
        for k, code in self.model.items():
            assert self.table.get(k) == code  # type: ignore[arg-type]


TestTable = TableMachine.TestCase
TestTable.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def _home(key: int, capacity: int) -> int:
    return ((key % U64) * GOLDEN % U64) >> (64 - (capacity.bit_length() - 1))


def test_removal_shifts_back_across_the_table_end() -> None:
    """Keys whose home is the last slot wrap to the first ones; removing one moves the
    others back, and every other key is still found."""
    table = HashCodes(8)
    last = [k for k in range(10_000) if _home(k, 8) == 7][:3]
    first = [k for k in range(10_000) if _home(k, 8) == 0][:1]
    assert table.put_run([*last, *first], 1)
    for gone in (last[0], first[0], last[1]):
        assert table.pop(gone) is not None
        for k in [*last, *first]:
            assert (table.get(k) is not None) == (k in table)
        assert table.get(gone) is None
    assert dict(table.items()) == {last[2]: 3}


def test_negative_and_unsigned_keys_are_distinct() -> None:
    """-1 and 2**64 - 1 are one value mod 2**64 but two keys, in runs as one by one."""
    table = HashCodes(8)
    assert table.put_run([-1, -(2**63)], 1)  # an int64 run
    assert table.put_run([U64 - 1, 2**63], 3)  # a uint64 run
    assert table.put(-2, 5) and table.put(U64 - 2, 6)
    assert dict(table.items()) == {-1: 1, -(2**63): 2, U64 - 1: 3, 2**63: 4, -2: 5, U64 - 2: 6}
    assert table.pop_run([U64 - 1, -1, -1]).tolist() == [3, 1, 0]
    assert table.get(-(2**63)) == 2 and table.get(2**63) == 4


def test_steady_churn_never_grows_the_table() -> None:
    """As many keys removed as entered (a run stored, then the oldest removed), for many
    times the table's size: its capacity stays what the live count first needed."""
    rng = np.random.default_rng(1)
    table = HashCodes(8)
    live = [rng.integers(0, 2**63, 64, dtype=np.int64) for _ in range(65)]
    for i, run in enumerate(live):
        assert table.put_run(run, 1 + 64 * i)
    assert (table.pop_run(live.pop(0)) != 0).all()
    capacity = len(table._vals)
    for i in range(65, 64 * 40):
        run = rng.integers(-(2**63), 2**63 - 1, 64, dtype=np.int64)
        assert table.put_run(run, 1 + 64 * i)
        live.append(run)
        assert (table.pop_run(live.pop(0)) != 0).all()
        assert len(table) == 64 * 64
    assert len(table._vals) == capacity
    assert all(table.get(int(k)) is not None for run in live for k in run[:4])
