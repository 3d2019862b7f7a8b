"""Access control and quotas as the Python client sees them: the daemon binary started with an
`[access]` or `[quotas]` config, its refusals raised as `RequestRejected` with the daemon's
exact message."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import weightstream

from tests.daemon import Daemon


def start(tmp_path, config: str) -> Daemon:
    path = tmp_path / "config.toml"
    path.write_text(config)
    return Daemon(tmp_path, "--config", str(path))


def test_a_peer_outside_the_allow_list_is_refused_and_logged(tmp_path):
    uid, gid, pid = os.getuid(), os.getgid(), os.getpid()
    groups = sorted(set(os.getgroups()))
    d = start(tmp_path, f"[access]\nallowed_uids = [{uid + 1}]\n")
    try:
        want = (
            f"uid {uid} (gid {gid}, groups {groups}, pid {pid}) may not use this daemon: "
            f"neither in access.allowed_uids [{uid + 1}] nor in access.allowed_gids []"
        )
        for call in (d.client.info, d.client.list_models, d.client.list_sessions):
            with pytest.raises(weightstream.RequestRejected) as e:
                call()
            assert (e.value.code, e.value.message) == ("PERMISSION_DENIED", want)
        with pytest.raises(weightstream.RequestRejected) as e:
            d.client.upload_model("x", {"w": torch.zeros(16)})
        assert (e.value.code, e.value.message) == ("PERMISSION_DENIED", want)
        # The daemon logs each attempt with the peer's uid and pid and the method (at warn: the
        # level the fixture runs it at). Its stderr is a file: poll it with a deadline. The
        # text format colours its fields even when stderr is not a terminal: strip that.
        log = tmp_path / "daemon.log"
        deadline = time.monotonic() + 10
        needle = ("access denied", f"uid={uid}", f"pid={pid}", "WeightStream/GetInfo")

        def lines() -> list[str]:
            return re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()).splitlines()

        while not any(all(n in line for n in needle) for line in lines()):
            assert time.monotonic() < deadline, lines()
            time.sleep(0.02)
    finally:
        d.stop()


def test_the_sessions_quota_is_refused_by_name_and_freed_by_close(tmp_path):
    uid = os.getuid()
    d = start(tmp_path, "[quotas]\nper_uid_sessions = 1\n")
    try:
        manifest, _ = d.client.upload_model("x", {"w": torch.ones(256)})
        assert d.client.info().quotas.per_uid_sessions == 1
        with d.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20) as session:
            session.release(session.acquire(0))
            usage = d.client.info().usage
            assert (usage.uid, usage.sessions, usage.daemon_sessions) == (uid, 1, 1)
            with pytest.raises(weightstream.RequestRejected) as e:
                d.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20)
            assert (e.value.code, e.value.message) == (
                "RESOURCE_EXHAUSTED",
                f"quotas.per_uid_sessions = 1 reached: uid {uid} has 1 open session",
            )
        with d.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20) as session:
            assert torch.equal(session.acquire(0).tensors[0], torch.ones(256))
    finally:
        d.stop()
