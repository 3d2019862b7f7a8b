"""Turns what the user names (a file, a sharded index, a directory) into the safetensors files
of one model, and opens them to pass to the daemon, which never opens a path a client names.
The rules and messages are client-rs's ``sources.rs`` (the daemon's, before issue 17)."""

from __future__ import annotations

import json
import os
import stat

from weightstream._handoff import MAX_FDS
from weightstream.errors import RequestRejected

#: Index files are JSON with a ``weight_map``; a huge one is not an index.
MAX_INDEX_BYTES = 64 << 20

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symbolic link",
}


def _refuse(message: str, code: str = "INVALID_ARGUMENT") -> RequestRejected:
    return RequestRejected(code, f"paths: {message}")


def _os_error(path: str, e: OSError) -> RequestRejected:
    if isinstance(e, FileNotFoundError):
        return _refuse(f"{path}: not found", "NOT_FOUND")
    return _refuse(f"{path}: {e.strerror} (os error {e.errno})")


def open_sources(paths: list[str]) -> list[tuple[str, int]]:
    """``(path, fd)`` of each resolved file, opened read-only; at most 253 files. The caller
    closes the fds."""
    files = resolve_sources(paths)
    if len(files) > MAX_FDS:
        raise _refuse(
            f"{len(files)} files, more than the {MAX_FDS} one load can pass (the kernel's limit "
            "of file descriptors per message): make the model of fewer, larger shards"
        )
    opened: list[tuple[str, int]] = []
    try:
        for path in files:
            opened.append((path, _open(path)))
    except BaseException:
        for _, fd in opened:
            os.close(fd)
        raise
    return opened


def _open(path: str) -> int:
    """Opens without following a final link and without blocking (a FIFO would), then checks
    for a regular file. Links (a Hugging Face cache's snapshot links) are resolved first, as
    the daemon's resolution followed them."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(os.path.realpath(path), flags)
    except OSError as e:
        raise _os_error(path, e) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "a file of an unknown kind")
        raise _refuse(f"{path}: {kind}, not a regular file: only regular files can be loaded")
    return fd


def resolve_sources(paths: list[str]) -> list[str]:
    """The safetensors files named by ``paths``, in a stable order, each once."""
    if not paths:
        raise RequestRejected("INVALID_ARGUMENT", "paths: no file given")
    files: list[str] = []
    for path in paths:
        if not os.path.isabs(path):
            raise _refuse(f"{path}: the daemon needs an absolute path")
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except OSError as e:
            raise _os_error(path, e) from None
        name = os.path.basename(path)
        if is_dir:
            files += _directory(path)
        elif name.endswith(".safetensors.index.json"):
            files += _index(path)
        elif name.endswith(".safetensors"):
            files.append(path)
        else:
            raise _refuse(
                f"{path}: not a .safetensors file, a *.safetensors.index.json or a directory"
            )
    return list(dict.fromkeys(files))


def _directory(path: str) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError as e:
        raise _os_error(path, e) from None
    files = sorted(
        os.path.join(path, n)
        for n in names
        if os.path.splitext(n)[1] == ".safetensors" and os.path.isfile(os.path.join(path, n))
    )
    if not files:
        raise _refuse(f"{path}: directory holds no .safetensors file")
    return files


def _index(path: str) -> list[str]:
    def bad(reason: str) -> RequestRejected:
        return _refuse(f"{path}: invalid index: {reason}")

    try:
        size = os.stat(path).st_size
        if size > MAX_INDEX_BYTES:
            raise bad(f"{size} bytes, more than the limit of {MAX_INDEX_BYTES}")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _os_error(path, e) from None
    try:
        index = json.loads(data)
    except ValueError as e:
        raise bad(str(e)) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise bad('no "weight_map" object')
    directory = os.path.dirname(path)
    shards = set()
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise bad(f'weight_map["{tensor}"] is not a string')
        if "/" in file or file == "..":
            raise bad(f'weight_map["{tensor}"] = "{file}" leaves the index\'s directory')
        shards.add(os.path.join(directory, file))
    if not shards:
        raise bad("empty weight_map")
    shards = sorted(shards)
    for shard in shards:
        if not os.path.isfile(shard):
            raise _refuse(f"{shard}: not found", "NOT_FOUND")
    return shards
