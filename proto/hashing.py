"""Block hashing: the one function both sides use to name a block of KV.

Pure and synchronous; imports neither asyncio, grpc nor a clock.

Definition (B = block size, tokens t_0 .. t_{n-1}, each an unsigned 32-bit id):

    seed   = partition_seed(cache_salt, extra_key)         # xxh3-64 of the partition
    S_0    = seed
    S_k+1  = S_k * A + mix_token(t_k)          (mod 2**64)
    hash of block i = fmix64(S_{(i+1)B})

``fmix64`` is a bijection, so a block's hash determines the chain state after it: the next
block's hash is a function of (parent hash, the block's B tokens) alone -- see
:func:`chain_block_hash`. That is the "chained" property the event contract relies on (the
router can verify a stored block from its parent hash and token ids). Block i covers absolute
positions [iB, (i+1)B); a partial trailing block has no hash.

Why this shape: the recurrence is affine in S, so the state at every block boundary has a
closed form, S_m = A**(m-1) * (A*seed + sum_{k<m} mix_token(t_k) * A**-k), which numpy
computes for a whole prompt with one multiply and one cumulative sum -- no Python loop over
blocks. Hashing an 8,192-token prompt at B=16 takes ~30 microseconds on a 2-core box.

Collisions: this is a fast 64-bit hash, not a cryptographic one; arithmetic mod 2**64 admits
crafted collisions (e.g. Thue-Morse sequences of 2**11 blocks). A collision can only
*misroute* a request: the router would believe a worker holds a prefix it does not. Workers
never trust a hash: their radix tree compares the real token ids, so a worker's output can
never be corrupted by a collision -- at worst it prefills tokens the router hoped were cached.
Keying the multiplier or the token mix would not help: the Thue-Morse difference vanishes
mod 2**64 for *every* odd multiplier and every token mix.

Keyed mode (``--hash-key`` / ``KVROUTE_HASH_KEY`` on router and workers,
:func:`set_hash_key`): with a deployment secret K the chain step is a keyed cryptographic
hash instead of the affine recurrence::

    S_0 = seed;   S_(i+1) = BLAKE2b-64(key=K, S_i as 8 bytes LE || block i's ids as u32 LE)
    hash of block i = fmix64(S_(i+1))

Nobody without K can compute a block's hash, let alone craft two prompts whose hashes collide,
so nobody outside can steer routing with colliding prompts. The chained property and every
caller stay as they are (a block's hash still determines the state after it: ``unfmix64``);
only the cost grows, one BLAKE2b call per block (decision 0006). The key is process-wide, set
once at start-up before any hashing; a router refuses workers whose
:func:`hash_key_fingerprint` differs from its own.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import NewType, cast

import numpy as np
import xxhash

from kvroute_proto.hash_constants import _A, _F1, _F2, _MASK, _TOKEN_MUL, _TOKEN_XOR

BlockHash = NewType("BlockHash", int)
"""A block's 64-bit chained hash (unsigned)."""

MAX_TOKEN_ID = 2**32 - 1

# The inverses mod 2**64 of the chain multiplier and of the fmix64 constants.
_A_INV = pow(_A, -1, 1 << 64)
_F1_INV = pow(_F1, -1, 1 << 64)
_F2_INV = pow(_F2, -1, 1 << 64)

_U64 = np.uint64

_HASH_KEY: bytes | None = None  # the deployment's block-hashing key (None: unkeyed)
_KEYED_BASE: hashlib.blake2b | None = None  # BLAKE2b keyed once; copied per block (cheaper)


def set_hash_key(key: bytes | str | None) -> None:
    """Key (or, with None, unkey) every block hash this process computes from now on.
    Set once at start-up: hashes made under another key never match."""
    global _HASH_KEY, _KEYED_BASE
    if isinstance(key, str):
        key = key.encode()
    if key is not None and not 1 <= len(key) <= 64:
        raise ValueError(f"the hash key must be 1..64 bytes, got {len(key)}")
    _HASH_KEY = key
    _KEYED_BASE = None if key is None else hashlib.blake2b(key=key, digest_size=8)


def hash_key_fingerprint() -> str:
    """The fingerprint of the process's current key (see :func:`key_fingerprint`)."""
    return key_fingerprint(_HASH_KEY)


def key_fingerprint(key: bytes | str | None) -> str:
    """A public name of a block-hashing key ("" when None): equal keys, equal
    fingerprints; the key cannot be recovered from it."""
    if isinstance(key, str):
        key = key.encode()
    if not key:
        return ""
    digest = hashlib.blake2b(b"kvroute/hash-key-fingerprint", key=key, digest_size=8)
    return f"hk1:{digest.hexdigest()}"


def _keyed_states(
    tokens: np.ndarray, block_size: int, seed: int, base: hashlib.blake2b
) -> np.ndarray:
    """S_1 .. S_m of the keyed chain (uint64), for ``tokens`` of m full blocks."""
    data = memoryview(tokens.astype("<u4", copy=False).tobytes())
    step = 4 * block_size
    state = (seed & _MASK).to_bytes(8, "little")
    fresh = base.copy  # the keyed initial state, without re-keying per block
    out = []
    for start in range(0, len(data), step):
        h = fresh()
        h.update(state)
        h.update(data[start : start + step])
        state = h.digest()
        out.append(state)
    return np.frombuffer(b"".join(out), dtype="<u8").astype(_U64)


class _Powers:
    """Grow-only tables of A**k and mix_token-scaled A**-k, shared by every call."""

    def __init__(self) -> None:
        self.size = 0
        self.pow = np.empty(0, dtype=_U64)  # A**k
        self.inv = np.empty(0, dtype=_U64)  # A**-k
        self.mul_inv = np.empty(0, dtype=_U64)  # _TOKEN_MUL * A**-k
        self._block_pow: dict[int, np.ndarray] = {}  # B -> A**(iB + B - 1), contiguous
        self._block_mul_inv: dict[int, np.ndarray] = {}  # B -> mul_inv as (B, blocks)
        self._grow(8192)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self.size)
        k = np.arange(size, dtype=_U64)
        self.pow = _pow_u64(_A, k)
        self.inv = _pow_u64(_A_INV, k)
        with np.errstate(over="ignore"):
            self.mul_inv = self.inv * _U64(_TOKEN_MUL)
        self._block_pow = {}
        self._block_mul_inv = {}
        self.size = size

    def block_pow(self, block_size: int) -> np.ndarray:
        """A**(e) at every block end e = iB + B - 1, as one contiguous array."""
        table = self._block_pow.get(block_size)
        if table is None:
            table = np.ascontiguousarray(self.pow[block_size - 1 :: block_size])
            if len(self._block_pow) < 64:
                self._block_pow[block_size] = table
        return table

    def block_mul_inv(self, block_size: int) -> np.ndarray:
        """``mul_inv`` laid out by position within the block: row j holds the factors of
        the j-th token of every block (shape (B, size // B), C order), so that a prompt's
        per-block sums are B contiguous rows added together."""
        table = self._block_mul_inv.get(block_size)
        if table is None:
            blocks = self.size // block_size
            flat = self.mul_inv[: blocks * block_size]
            table = np.ascontiguousarray(flat.reshape(blocks, block_size).T)
            if len(self._block_mul_inv) < 64:
                self._block_mul_inv[block_size] = table
        return table

    def ensure(self, n: int) -> None:
        if n > self.size:
            self._grow(n)


def _pow_u64(base: int, exps: np.ndarray) -> np.ndarray:
    """base**exps mod 2**64, elementwise, by square-and-multiply over the exponent bits."""
    result = np.ones(exps.shape, dtype=_U64)
    b = _U64(base)
    e = exps.copy()
    with np.errstate(over="ignore"):
        while e.any():
            odd = (e & _U64(1)).astype(bool)
            result[odd] *= b
            b = b * b
            e >>= _U64(1)
    return result


_POWERS = _Powers()


_S33 = _U64(33)
_UF1 = _U64(_F1)
_UF2 = _U64(_F2)


def _fmix64_array(s: np.ndarray) -> np.ndarray:
    t = s >> _S33
    s ^= t
    s *= _UF1
    np.right_shift(s, _S33, out=t)
    s ^= t
    s *= _UF2
    np.right_shift(s, _S33, out=t)
    s ^= t
    return s


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser: a bijection on 64-bit integers."""
    x &= _MASK
    x ^= x >> 33
    x = (x * _F1) & _MASK
    x ^= x >> 33
    x = (x * _F2) & _MASK
    x ^= x >> 33
    return x


def _unxorshift33(x: int) -> int:
    # x ^ (x >> 33) is its own inverse for a 64-bit word because 2 * 33 > 64.
    return x ^ (x >> 33)


def unfmix64(h: int) -> int:
    """Inverse of :func:`fmix64`: recovers the chain state from a block hash."""
    h = _unxorshift33(h & _MASK)
    h = (h * _F2_INV) & _MASK
    h = _unxorshift33(h)
    h = (h * _F1_INV) & _MASK
    return _unxorshift33(h)


def _mix_token(t: int) -> int:
    return ((t ^ _TOKEN_XOR) * _TOKEN_MUL) & _MASK


@functools.lru_cache(maxsize=4096)
def partition_seed(cache_salt: str = "", extra_key: str = "") -> int:
    """The chain seed for a partition: different (salt, extra_key) never share a block."""
    data = b"kvroute/v1\x00" + cache_salt.encode() + b"\x00" + extra_key.encode()
    return xxhash.xxh3_64_intdigest(data)


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate token ids (0 <= t < 2**32) and return them as a uint64 array.

    Raises ValueError naming the first bad position; TypeError for non-integer input.
    """
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    else:
        try:
            arr = np.asarray(token_ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"token_ids must be a sequence of ints: {exc}") from None
        if arr.ndim != 1:
            raise ValueError("token_ids must be a flat sequence of ints")
    if arr.size and arr.dtype != np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
            raise ValueError(f"token_ids[{bad}]={int(arr[bad])} is outside [0, {MAX_TOKEN_ID}]")
    return arr.astype(_U64, copy=False)


_COMPILED: Callable[[np.ndarray, int, int], np.ndarray] | None = None  # enable_compiled()


def enable_compiled() -> bool:
    """Hash unkeyed prompts with the compiled chain (``kvroute_proto.hashing_nb``, numba)
    from now on in this process: the same hashes, faster at every length (short prompts
    most: the numpy form's cost is mostly fixed per call). The router
    calls it (its index compiles numba kernels anyway); False, and nothing changes, where
    numba cannot be imported."""
    global _COMPILED
    if _COMPILED is None:
        try:
            from kvroute_proto import hashing_nb
        except ImportError:
            return False
        hashing_nb.warm_up()
        _COMPILED = hashing_nb.chain_hashes
    return True


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int = 0,
    *,
    validate: bool = True,
) -> np.ndarray:
    """Hashes of every full block of ``token_ids`` (uint64 array, one per block).

    ``seed`` is :func:`partition_seed` of the request's partition. A partial trailing
    block is not hashed. Pass ``validate=False`` only for arrays already checked.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if validate and not (isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32):
        tokens = as_token_array(token_ids)  # uint32 arrays are valid as they are
    else:
        tokens = cast(np.ndarray, token_ids)  # the caller vouches for it (validate=False)
    num_blocks = len(tokens) // block_size
    if num_blocks == 0:
        return np.empty(0, dtype=_U64)
    n = num_blocks * block_size
    if _KEYED_BASE is not None:
        return _fmix64_array(_keyed_states(tokens[:n], block_size, seed, _KEYED_BASE))
    if _COMPILED is not None:
        return _COMPILED(tokens, block_size, seed)
    return _closed_form(tokens, block_size, num_blocks, seed)


def _closed_form(tokens: np.ndarray, block_size: int, num_blocks: int, seed: int) -> np.ndarray:
    """The chain's hashes of ``num_blocks`` full blocks in numpy (no compiler needed)."""
    n = num_blocks * block_size
    _POWERS.ensure(n)
    # Array arithmetic wraps mod 2**64 without warnings (only numpy scalar ops warn): no
    # np.errstate needed, and entering one costs as much as a 2,000-element multiply.
    # v_k = mix_token(t_k) * A**-k; S at the end of block i is A**(e) * (A*seed + cumsum_e),
    # and cumsum_e is the running sum of the per-block sums of v. v is laid out (B, blocks)
    # -- row j the j-th token of every block -- so that the block sums are B contiguous
    # rows added (a cumulative sum over all n tokens, or a sum along rows of B, is several
    # times slower in numpy). The xor widens uint32 ids to uint64 in the same pass, writing
    # the transposed layout; mul_inv (laid out alike) folds _TOKEN_MUL in.
    v = np.empty((block_size, num_blocks), dtype=_U64)
    by_block = tokens[:n].reshape(num_blocks, block_size).T
    np.bitwise_xor(by_block, _U64(_TOKEN_XOR), out=v, dtype=_U64, casting="unsafe")
    v *= _POWERS.block_mul_inv(block_size)[:, :num_blocks]
    ends = np.add.reduce(v, axis=0)
    np.cumsum(ends, out=ends)
    ends += _U64((_A * (seed & _MASK)) & _MASK)
    ends *= _POWERS.block_pow(block_size)[:num_blocks]
    return _fmix64_array(ends)


def block_hash_list(
    token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int = 0
) -> list[BlockHash]:
    """:func:`block_hashes` as a list of Python ints."""
    return block_hashes(token_ids, block_size, seed).tolist()


def chain_block_hash(parent_hash: int | None, block_tokens: Sequence[int], seed: int = 0) -> int:
    """Hash of one block from its parent's hash (None for the first block) and its tokens.

    A slow, scalar reference for :func:`block_hashes`: the router uses it to verify a
    stored block against its parent, the tests use it as the specification.
    """
    state = (seed & _MASK) if parent_hash is None else unfmix64(parent_hash)
    for t in block_tokens:
        if not 0 <= int(t) <= MAX_TOKEN_ID:
            raise ValueError(f"token id {t} is outside [0, {MAX_TOKEN_ID}]")
        if _HASH_KEY is None:
            state = (state * _A + _mix_token(int(t))) & _MASK
    if _HASH_KEY is not None:
        data = state.to_bytes(8, "little") + b"".join(
            int(t).to_bytes(4, "little") for t in block_tokens
        )
        digest = hashlib.blake2b(data, key=_HASH_KEY, digest_size=8).digest()
        state = int.from_bytes(digest, "little")
    return fmix64(state)
