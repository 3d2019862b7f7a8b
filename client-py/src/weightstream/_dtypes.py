"""The wire's dtypes and torch's."""

from __future__ import annotations

import torch

from weightstream.v1 import weightstream_pb2 as pb

TO_TORCH = {
    pb.DTYPE_BOOL: torch.bool,
    pb.DTYPE_U8: torch.uint8,
    pb.DTYPE_I8: torch.int8,
    pb.DTYPE_F8_E5M2: torch.float8_e5m2,
    pb.DTYPE_F8_E4M3: torch.float8_e4m3fn,
    pb.DTYPE_I16: torch.int16,
    pb.DTYPE_U16: torch.uint16,
    pb.DTYPE_F16: torch.float16,
    pb.DTYPE_BF16: torch.bfloat16,
    pb.DTYPE_I32: torch.int32,
    pb.DTYPE_U32: torch.uint32,
    pb.DTYPE_F32: torch.float32,
    pb.DTYPE_F64: torch.float64,
    pb.DTYPE_I64: torch.int64,
    pb.DTYPE_U64: torch.uint64,
}
FROM_TORCH = {v: k for k, v in TO_TORCH.items()}


def to_wire(dtype: torch.dtype) -> int:
    try:
        return FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be streamed (no safetensors equivalent)") from None
