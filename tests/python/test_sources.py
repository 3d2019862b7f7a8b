"""Client-side resolution of what a load names (``weightstream._sources``): the daemon's former
rules and messages, files opened read-only and checked to be regular. Needs no daemon binary."""

from __future__ import annotations

import os

import pytest
from weightstream import _sources
from weightstream.errors import RequestRejected

pytestmark = pytest.mark.no_daemon


def test_a_directory_gives_its_safetensors_sorted(tmp_path):
    # Made out of order, so that no directory listing order happens to be sorted.
    for name in ["c", "a", "d", "b"]:
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    (tmp_path / "x.safetensors.index.json").write_text("{}")
    (tmp_path / "sub.safetensors").mkdir()
    want = [str(tmp_path / f"{name}.safetensors") for name in "abcd"]
    assert _sources.resolve_sources([str(tmp_path)]) == want


def test_resolves_files_indexes_and_directories(tmp_path):
    for f in ["b.safetensors", "a.safetensors", "notes.txt"]:
        (tmp_path / f).write_bytes(b"")
    (tmp_path / "m.safetensors.index.json").write_text(
        '{"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}'
    )
    both = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert _sources.resolve_sources([str(tmp_path)]) == both
    assert _sources.resolve_sources([str(tmp_path / "m.safetensors.index.json")]) == both
    one = [str(tmp_path / "b.safetensors")]
    assert _sources.resolve_sources(one + one) == one


def test_refuses_bad_sources_with_the_daemons_messages(tmp_path):
    d = tmp_path
    (d / "notes.txt").write_bytes(b"")
    (d / "missing.safetensors.index.json").write_text('{"weight_map": {"x": "gone.safetensors"}}')
    (d / "evil.safetensors.index.json").write_text('{"weight_map": {"x": "../etc/passwd"}}')
    (d / "list.safetensors.index.json").write_text("[]")
    (d / "empty").mkdir()
    cases = [
        ([], "INVALID_ARGUMENT", "paths: no file given"),
        (
            ["model.safetensors"],
            "INVALID_ARGUMENT",
            "paths: model.safetensors: the daemon needs an absolute path",
        ),
        ([f"{d}/nope.safetensors"], "NOT_FOUND", f"paths: {d}/nope.safetensors: not found"),
        (
            [f"{d}/empty"],
            "INVALID_ARGUMENT",
            f"paths: {d}/empty: directory holds no .safetensors file",
        ),
        (
            [f"{d}/notes.txt"],
            "INVALID_ARGUMENT",
            f"paths: {d}/notes.txt: not a .safetensors file, a *.safetensors.index.json "
            "or a directory",
        ),
        (
            [f"{d}/missing.safetensors.index.json"],
            "NOT_FOUND",
            f"paths: {d}/gone.safetensors: not found",
        ),
        (
            [f"{d}/evil.safetensors.index.json"],
            "INVALID_ARGUMENT",
            f'paths: {d}/evil.safetensors.index.json: invalid index: weight_map["x"] = '
            '"../etc/passwd" leaves the index\'s directory',
        ),
        (
            [f"{d}/list.safetensors.index.json"],
            "INVALID_ARGUMENT",
            f'paths: {d}/list.safetensors.index.json: invalid index: no "weight_map" object',
        ),
    ]
    failures = []
    for paths, code, message in cases:
        try:
            got = _sources.resolve_sources(paths)
        except RequestRejected as e:
            got = (e.code, e.message)
        if got != (code, message):
            failures.append(f"{paths}: want {(code, message)}, got {got}")
    assert not failures, "\n".join(failures)


def test_opens_files_through_links_and_names_them_as_given(tmp_path):
    (tmp_path / "blob").write_bytes(b"weights")
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blob")
    [(path, fd)] = _sources.open_sources([str(tmp_path / "model.safetensors")])
    try:
        assert path == str(tmp_path / "model.safetensors")
        assert os.pread(fd, 100, 0) == b"weights"
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(RequestRejected) as e:
        _sources.open_sources([str(fifo)])
    assert e.value.message == (
        f"paths: {fifo}: a FIFO, not a regular file: only regular files can be loaded"
    )


def test_refuses_more_files_than_one_load_can_pass(tmp_path):
    for i in range(254):
        (tmp_path / f"{i:03}.safetensors").write_bytes(b"")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RequestRejected, match="paths: 254 files, more than the 253 one load"):
        _sources.open_sources([str(tmp_path)])
    assert set(os.listdir("/proc/self/fd")) <= before
