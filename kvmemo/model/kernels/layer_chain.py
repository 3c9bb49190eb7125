"""The decode step's layer loop in C (layer_chain.c): its structs as ctypes structures and the
loaded function.

Invariant: `chain_function()` returns the loaded function or None (no C compiler,
KVMEMO_CPU_KERNEL=0), never raises; the structures mirror layer_chain.c's field for field.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import cast

from kvmemo.model.kernels.quant_int8 import OptionsStruct
from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("layer_chain.c")

_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class ChainLayer(ctypes.Structure):
    """layer_chain.c's chain_layer: one layer's weights, norms and pages."""

    _fields_ = [
        ("qkv", _p), ("o_proj", _p), ("gate_up", _p), ("down", _p),
        ("qkv_options", OptionsStruct),
        ("mlp_norm", _p), ("post_o_norm", _p), ("post_mlp_norm", _p),
        ("eps", ctypes.c_float), ("gelu", _i32), ("rope", _i32), ("group", _i32),
        ("k_pages", _p), ("v_pages", _p),
    ]


class ChainModel(ctypes.Structure):
    """layer_chain.c's chain_model: the kernels, the shapes and the layers."""

    _fields_ = [
        ("linear", _p), ("mlp_block", _p), ("attend", _p),
        ("num_layers", _i64), ("hidden", _i64), ("q_size", _i64), ("kv_size", _i64),
        ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("block_size", _i64), ("num_blocks", _i64),
        ("kv_dtype", _i32), ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(ChainLayer)),
    ]


class ChainGroup(ctypes.Structure):
    """layer_chain.c's chain_group: a layer group's attention arguments for one step."""

    _fields_ = [
        ("slots", _p), ("block_tables", _p), ("kv_lens", _p), ("kv_starts", _p),
        ("table_stride", _i64),
    ]


@cache
def chain_function() -> Callable[..., int] | None:
    """kvmemo_layer_chain(model, B, hidden, out, cos[], sin[], groups[], failed_layer*)."""
    library = load_library(SOURCE, "decode steps call the layers' kernels one by one")
    if library is None:
        return None
    fn = library.kvmemo_layer_chain
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ChainModel), _i64, _p, _p, _p, _p, ctypes.POINTER(ChainGroup),
                   ctypes.POINTER(_i64)]
    return fn


def function_address(function: Callable[..., int]) -> int:
    """The address of a loaded C function (a ctypes function of a CDLL), for C to call."""
    address = ctypes.cast(cast(ctypes.c_void_p, function), _p).value
    if not address:
        raise ValueError(f"{function!r} has no address")
    return address
