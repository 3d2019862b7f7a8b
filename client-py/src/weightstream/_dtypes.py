"""The wire's dtypes and torch's."""

from __future__ import annotations

import torch

from weightstream import _native as wire

TO_TORCH = {
    wire.DTYPE_BOOL: torch.bool,
    wire.DTYPE_U8: torch.uint8,
    wire.DTYPE_I8: torch.int8,
    wire.DTYPE_F8_E5M2: torch.float8_e5m2,
    wire.DTYPE_F8_E4M3: torch.float8_e4m3fn,
    wire.DTYPE_I16: torch.int16,
    wire.DTYPE_U16: torch.uint16,
    wire.DTYPE_F16: torch.float16,
    wire.DTYPE_BF16: torch.bfloat16,
    wire.DTYPE_I32: torch.int32,
    wire.DTYPE_U32: torch.uint32,
    wire.DTYPE_F32: torch.float32,
    wire.DTYPE_F64: torch.float64,
    wire.DTYPE_I64: torch.int64,
    wire.DTYPE_U64: torch.uint64,
}
FROM_TORCH = {v: k for k, v in TO_TORCH.items()}


def to_wire(dtype: torch.dtype) -> int:
    try:
        return FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be streamed (no safetensors equivalent)") from None
