"""How kvroute's numba kernels are compiled: ``jit`` (cached on disk, without the GIL),
``jit_gil`` (cached, keeping the GIL: a kernel that touches Python objects) and
``jit_inline`` (a body inlined into each kernel that calls it).

numba caches a compiled kernel next to its source file, in NUMBA_CACHE_DIR or in the user's
cache directory, whichever it finds writable; where none is (a read-only install run by a
user without a home: set NUMBA_CACHE_DIR), the kernels are compiled in each process at its
first use instead, and :data:`CACHED` turns False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba

__all__ = ["CACHED", "jit", "jit_gil", "jit_inline"]

F = TypeVar("F", bound=Callable[..., Any])

CACHED = True
"""Whether the kernels compiled so far are cached on disk (False once one could not be)."""


def _compile(fn: F, nogil: bool) -> F:
    global CACHED
    try:
        return cast(F, numba.njit(cache=True, nogil=nogil)(fn))
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        CACHED = False
        return cast(F, numba.njit(nogil=nogil)(fn))


def jit(fn: F) -> F:
    """numba.njit, cached on disk where numba finds a writable place; releases the GIL."""
    return _compile(fn, nogil=True)


def jit_gil(fn: F) -> F:
    """:func:`jit` for a kernel that keeps the GIL (it reads or makes Python objects)."""
    return _compile(fn, nogil=False)


def jit_inline(fn: F) -> F:
    """A kernel body inlined into each kernel calling it (numba IR level; not cached on its
    own: it is compiled into its callers, which are)."""
    return cast(F, numba.njit(inline="always")(fn))
