"""CPython's C API from inside a numba kernel (llvmlite intrinsics): find_matches' fast path.

router.core.index_nb_walk's ``_find_dicts`` keeps the GIL and goes through the C API at both
ends: it reads a list query's ints as far as its walks go (``_list_u64``, ``_take_error``),
and writes its answer into the dicts it returns (``_dict_put``) -- no conversion of the
whole list, no ``tolist`` and ``zip`` of the answer. Objects are passed as their CPython
addresses (``id()``), alive and unchanged for the call. The plain path beside it
(``_find_arrays``: the query converted by numpy first, the answer built from the kernel's
answer rows) gives the same answers; ``NumbaPrefixIndex(..., capi=False)`` takes it, and the
tests run both.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__: list[str] = []


def _list_u64_typed(typingctx: Any, src: Any, i: Any) -> Any:
    """Item ``i`` of the Python list at address ``src`` as a uint64, through CPython's C
    API (PyList_GetItem, PyLong_AsUnsignedLongLong): all ones with a Python error set when
    the item is missing, not an int or out of range (see _take_error). Only in a kernel
    that holds the GIL (_jit_gil), with the list alive and unchanged for the call."""
    sig = types.uint64(types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        item = pyapi.list_getitem(builder.inttoptr(args[0], pyapi.pyobj), args[1])
        out = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(64), -1))
        with builder.if_then(cgutils.is_not_null(builder, item), likely=True):
            builder.store(pyapi.long_as_ulonglong(item), out)
        return builder.load(out)

    return sig, codegen


def _take_error_typed(typingctx: Any) -> Any:
    """Whether a Python error is set; clears it (the caller reports the failure)."""
    sig = types.boolean()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        has = cgutils.is_not_null(builder, pyapi.err_occurred())
        with builder.if_then(has):
            pyapi.err_clear()
        return has

    return sig, codegen


def _dict_put_typed(typingctx: Any, d: Any, key: Any, value: Any) -> Any:
    """``d[key] = value`` on the Python dict at address ``d``, both ints (PyDict_SetItem):
    0, or -1 with a Python error set (no memory). Only under the GIL (_jit_gil)."""
    sig = types.int32(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        status = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(32), -1))
        k = pyapi.long_from_longlong(args[1])
        with builder.if_then(cgutils.is_not_null(builder, k), likely=True):
            v = pyapi.long_from_longlong(args[2])
            with builder.if_then(cgutils.is_not_null(builder, v), likely=True):
                target = builder.inttoptr(args[0], pyapi.pyobj)
                builder.store(pyapi.dict_setitem(target, k, v), status)
                pyapi.decref(v)
            pyapi.decref(k)
        return builder.load(status)

    return sig, codegen


_list_u64: Any = intrinsic(_list_u64_typed)
_take_error: Any = intrinsic(_take_error_typed)
_dict_put: Any = intrinsic(_dict_put_typed)
