"""Block hashing: the vectorised function equals the scalar chain, and values are pinned."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto.events import Partition
from kvroute_proto.hashing import (
    MAX_TOKEN_ID,
    block_hash_list,
    block_hashes,
    chain_block_hash,
    fmix64,
    partition_seed,
    unfmix64,
)


def _chain(tokens, block_size, seed):
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = chain_block_hash(parent, tokens[i * block_size : (i + 1) * block_size], seed)
        out.append(parent)
    return out


@given(
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=200),
    block_size=st.integers(1, 17),
    salt=st.text(max_size=5),
    extra=st.text(max_size=5),
)
@settings(max_examples=200, deadline=None)
def test_vectorised_equals_scalar_chain(tokens, block_size, salt, extra):
    seed = partition_seed(salt, extra)
    assert block_hash_list(tokens, block_size, seed) == _chain(tokens, block_size, seed)


def test_block_hash_depends_on_whole_prefix_not_just_the_block():
    a = block_hash_list([1, 2, 3, 4], 2)
    b = block_hash_list([9, 2, 3, 4], 2)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same block tokens [3, 4], different parent


def test_partial_trailing_block_is_not_hashed():
    assert len(block_hash_list(list(range(35)), 16)) == 2
    assert block_hash_list(list(range(15)), 16) == []
    assert block_hash_list(list(range(35)), 16) == block_hash_list(list(range(32)), 16)


def test_partitions_never_share_a_block():
    tokens = list(range(64))
    plain = set(block_hash_list(tokens, 16, Partition().seed))
    salted = set(block_hash_list(tokens, 16, Partition(cache_salt="tenant-a").seed))
    lora = set(block_hash_list(tokens, 16, Partition(extra_key="lora-1").seed))
    assert plain.isdisjoint(salted) and plain.isdisjoint(lora) and salted.isdisjoint(lora)
    # the separator keeps ("ab", "") and ("a", "b") apart
    assert partition_seed("ab", "") != partition_seed("a", "b")


def test_hash_values_are_pinned():
    # The wire contract: changing these values breaks every mixed-version fleet.
    assert block_hash_list(list(range(32)), 16) == [16567821655952622803, 6727394636065978536]
    assert block_hash_list([7] * 4, 2, partition_seed("t", "l")) == [
        chain_block_hash(None, [7, 7], partition_seed("t", "l")),
        chain_block_hash(
            chain_block_hash(None, [7, 7], partition_seed("t", "l")),
            [7, 7],
            partition_seed("t", "l"),
        ),
    ]


@pytest.mark.parametrize("x", [0, 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0])
def test_fmix64_is_a_bijection(x):
    assert unfmix64(fmix64(x)) == x


def test_input_types_agree():
    tokens = [5, 7, 11, 13] * 8
    expected = block_hash_list(tokens, 4, 3)
    for arr in (
        np.array(tokens, np.int64),
        np.array(tokens, np.uint32),
        np.array(tokens, np.int32),
    ):
        assert block_hashes(arr, 4, 3).tolist() == expected


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([1, -1, 3], ValueError),
        ([1, 2**32], ValueError),
        (["a", "b"], TypeError),
        (np.array([1.5, 2.0]), TypeError),
    ],
)
def test_bad_tokens_raise_clear_errors(tokens, error):
    with pytest.raises(error, match="token"):
        block_hashes(tokens, 1)


def test_bad_token_error_names_the_position():
    with pytest.raises(ValueError, match=r"token_ids\[2\]=-5"):
        block_hashes([1, 2, -5], 1)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def test_long_prompts_grow_the_power_tables():
    tokens = np.arange(40_000, dtype=np.int64) % 1000
    hashes = block_hash_list(tokens, 512, 7)
    assert hashes == _chain(tokens.tolist(), 512, 7)


@given(
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=300),
    block_size=st.integers(1, 40),
    dtype=st.sampled_from([np.uint32, np.uint64, np.int64]),
)
@settings(max_examples=100, deadline=None)
def test_unvalidated_arrays_of_each_dtype_equal_the_scalar_chain(tokens, block_size, dtype):
    # the router hands route() prompts as uint32 arrays with validate=False
    arr = np.asarray(tokens, dtype=dtype)
    got = block_hashes(arr, block_size, 11, validate=False).tolist()
    assert got == _chain(tokens, block_size, 11)


def test_block_tables_cached_before_a_growth_are_rebuilt():
    short = np.arange(64, dtype=np.uint32)
    assert block_hash_list(short, 16, 3) == _chain(short.tolist(), 16, 3)  # caches B=16
    long = (np.arange(70_000, dtype=np.int64) * 7919) % 50_000
    assert block_hash_list(long, 16, 3) == _chain(long.tolist(), 16, 3)  # grows the tables


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=700),
    st.sampled_from([1, 4, 16, 64]),
    st.integers(0, 2**64 - 1),
    st.sampled_from([np.uint32, np.uint64]),
)
def test_the_compiled_chain_gives_the_numpy_forms_hashes(tokens, block_size, seed, dtype):
    """kvroute_proto.hashing_nb (what the router enables) against the numpy closed form and
    the scalar chain, for both token dtypes callers pass."""
    from kvroute_proto import hashing, hashing_nb

    arr = np.asarray(tokens, dtype=dtype)
    ids = np.asarray(tokens, dtype=np.uint32)
    expected = hashing._closed_form(ids, block_size, len(tokens) // block_size, seed)
    got = hashing_nb.chain_hashes(arr, block_size, seed)
    assert got.dtype == np.uint64 and got.tolist() == expected.tolist()
    if len(tokens) >= block_size:
        first = chain_block_hash(None, tokens[:block_size], seed)
        assert int(got[0]) == first


def test_enable_compiled_switches_every_unkeyed_prompt(monkeypatch):
    from kvroute_proto import hashing

    tokens = np.arange(4096, dtype=np.uint32)
    before = hashing.block_hashes(tokens, 16, 7).tolist()
    monkeypatch.setattr(hashing, "_COMPILED", None)
    assert hashing.enable_compiled()
    assert hashing._COMPILED is not None
    calls = []
    compiled = hashing._COMPILED
    monkeypatch.setattr(hashing, "_COMPILED", lambda *a: calls.append(a) or compiled(*a))
    assert hashing.block_hashes(tokens, 16, 7).tolist() == before
    assert len(calls) == 1
    short = hashing._closed_form(tokens, 16, 4, 7).tolist()
    assert hashing.block_hashes(tokens[:64], 16, 7).tolist() == short  # short ones too
    assert len(calls) == 2
