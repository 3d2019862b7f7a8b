"""Sizes and rates as people write and read them: ``size_text`` for messages, ``parse_size``
and ``parse_rate`` for settings and command lines. Units as the daemon reads them
(``daemon/src/config.rs``): KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB powers of
1024."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def size_text(n: int, *, whole: bool = False) -> str:
    """``n`` bytes for a message: GiB or MiB with two decimals, else bytes; ``whole``: in the
    largest of GiB, MiB, KiB that divides ``n`` (a setting's value as written), else bytes."""
    if whole:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift and n % (1 << shift) == 0:
                return f"{n >> shift} {unit}"
        return f"{n} bytes"
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def parse_size(what: str, value) -> int:
    """Bytes from an int or a string like ``8GiB``, ``512 MiB``, ``1.5GB``; ``ValueError``
    naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: {value!r} is not a size (bytes, or a number with B, KiB, MiB, GiB, "
                "TiB, KB, MB, GB or TB)"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ValueError(f"{what}: {value!r} is negative")
    return n


def parse_rate(what: str, value) -> int:
    """Bytes per second from an int or a string like ``25GB/s``, ``512 MiB/s`` or ``25GB``
    (``parse_size``'s forms, ``/s`` optional)."""
    if isinstance(value, str):
        value = value.strip().removesuffix("/s")
    return parse_size(what, value)
