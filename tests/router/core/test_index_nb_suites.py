"""The dict index's own tests, run on the numba index: every unit test of test_index.py with
PrefixIndex replaced by NumbaPrefixIndex, and test_index_state.py's state machine (the index
against a tiny reference model) driving a NumbaPrefixIndex."""

from __future__ import annotations

from functools import partial

import pytest
import test_index
from hypothesis import settings
from test_index_state import STRIDE, IndexMachine

from router.core.index_api import IndexConfig
from router.core.index_nb import NumbaPrefixIndex

UNIT_TESTS = sorted(name for name in dir(test_index) if name.startswith("test_"))


@pytest.mark.parametrize("capi", [True, False], ids=["capi", "plain"])
@pytest.mark.parametrize("name", UNIT_TESTS)
def test_dict_index_unit_test_on_numba(
    name: str, capi: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On both of find_matches' paths (router.core.index_capi)."""
    monkeypatch.setattr(test_index, "PrefixIndex", partial(NumbaPrefixIndex, capi=capi))
    getattr(test_index, name)()


def test_the_unit_tests_are_collected() -> None:
    assert len(UNIT_TESTS) >= 20


class NumbaIndexMachine(IndexMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = NumbaPrefixIndex(IndexConfig(predict_stride=STRIDE))  # type: ignore[assignment]


NumbaIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestNumbaIndexMachine = NumbaIndexMachine.TestCase
