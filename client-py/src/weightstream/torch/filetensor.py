"""``FileTensor``: a tensor of a safetensors file, named by its path and key, with its shape and
dtype but no data, until something reads it.

``load_file`` gives a dict of them where ``safetensors.torch.load_file`` gives tensors: a loader
that only casts them, assigns them to a module (``load_state_dict(..., assign=True)``), moves
them within the CPU or reads their shape and dtype allocates nothing, so the daemon can load
the same file (``Client.load_model``) and a layer attach its weights by the model's id without
the trainer ever holding them. A cast is recorded (``read`` casts what it reads, as the loader's
own ``.to(dtype)`` would have); a move to ``meta`` gives an empty ``meta`` tensor. Any other
operation reads the tensor from the file (``read``) and runs on that, so code that does read
one still computes what it would have with the loaded tensor; ``READ`` counts those bytes.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch.utils._pytree import tree_map

_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}

#: safetensors' dtype names.
DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class Stats:
    """Bytes read from files by operations on ``FileTensor``s (``read``), in this process."""

    read_bytes = 0
    reads = 0


READ = Stats()


class FileTensor(torch.Tensor):
    """Tensor ``key`` of the safetensors file ``path`` (stored as ``stored``), seen as ``dtype``
    on the CPU, without data."""

    path: str
    key: str
    stored: torch.dtype

    @staticmethod
    def __new__(cls, path: str, key: str, shape, stored: torch.dtype, dtype=None):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype or stored, device=torch.device("cpu")
        )
        t.path, t.key, t.stored = path, key, stored
        return t

    def like(self, dtype: torch.dtype) -> FileTensor:
        return FileTensor(self.path, self.key, self.shape, self.stored, dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(args) == 1 and isinstance(args[0], FileTensor):
            this = args[0]
            if func in _ALIASES:
                return this.like(this.dtype)
            if func is _aten.is_pinned.default:
                return False
            if func is _aten._to_copy.default:
                device = torch.device(kwargs.get("device") or "cpu")
                dtype = kwargs.get("dtype") or this.dtype
                if device.type == "meta":
                    return torch.empty(this.shape, dtype=dtype, device="meta")
                plain = kwargs.get("memory_format") in (None, torch.preserve_format)
                if device.type == "cpu" and plain and not kwargs.get("pin_memory"):
                    return this.like(dtype)
        args, kwargs = tree_map(_read, (args, kwargs))
        return func(*args, **kwargs)

    def read(self) -> torch.Tensor:
        """The tensor, read from the file and cast as recorded."""
        with safe_open(self.path, framework="pt", device="cpu") as f:
            t = f.get_tensor(self.key)
        READ.read_bytes += t.nbytes
        READ.reads += 1
        return t.to(self.dtype)

    def __repr__(self):
        return (
            f"FileTensor({self.key!r} of {self.path!r}, shape={list(self.shape)}, "
            f"dtype={self.dtype}, stored as {self.stored})"
        )

    def __reduce_ex__(self, protocol):
        return (_read_again, (self.path, self.key, self.dtype))


def _read_again(path, key, dtype):
    with safe_open(path, framework="pt", device="cpu") as f:
        return f.get_tensor(key).to(dtype)


def _read(a):
    return a.read() if isinstance(a, FileTensor) else a


def is_file_tensor(t) -> bool:
    return isinstance(t, FileTensor)


def load_file(path, device="cpu") -> dict[str, torch.Tensor] | None:
    """``safetensors.torch.load_file(path)`` as ``FileTensor``s; None where a tensor's dtype is
    not one torch has (the caller reads the file as usual)."""
    path = str(path)
    out = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():
            piece = f.get_slice(key)
            dtype = DTYPES.get(piece.get_dtype())
            if dtype is None:
                return None
            out[key] = FileTensor(path, key, piece.get_shape(), dtype)
    return out
