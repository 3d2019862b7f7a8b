"""State regions from Python: host memory the daemon holds for a session, mapped read-write and
used as CPU tensors (``torch.frombuffer``), charged to the uid while it lives, refused with the
daemon's numbers when it does not fit, and freed by ``close()`` and with the session."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
import weightstream
from weightstream.regions import StateRegion

from tests.daemon import Daemon


def _session(client: weightstream.Client):
    manifest, _ = client.upload_model("m", {"w": torch.ones(1024)})
    return client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20)


def _host_bytes(client: weightstream.Client) -> tuple[int, int]:
    usage = client.info().usage
    return usage.host_bytes, usage.state_bytes


def test_a_state_region_holds_tensors_written_through_its_mapping(daemon):
    client = daemon.client
    session = _session(client)
    before, _ = _host_bytes(client)
    region = session.alloc_state_region(10_000, label="master")
    assert isinstance(region, StateRegion)
    assert region.size == 12288, "rounded up to whole pages"
    assert region.region_id.startswith("st-") and len(region.region_id) == 19
    assert len(region.buffer) == 12288
    assert _host_bytes(client) == (before + 12288, 12288)
    (info,) = [s for s in client.list_sessions() if s.session_id == session.id]
    assert (info.state_bytes, info.state_regions) == (12288, 1)

    assert region.tensor().data_ptr() == region.address != 0, "the mapping's start"
    master = torch.frombuffer(region.buffer, dtype=torch.float32, count=3072)
    assert torch.equal(master, torch.zeros(3072)), "zero-filled"
    values = torch.arange(3072, dtype=torch.float32) / 7
    master.copy_(values)
    # The bytes are in the shared memory, not in a copy: a second mapping of the fd sees them.
    with mmap.mmap(region.fd, region.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        assert torch.equal(torch.frombuffer(bytearray(m), dtype=torch.float32), values)
    del master

    region.close()
    assert region.closed
    region.close()  # twice is fine
    assert daemon.memfds().count("state") == 0
    assert _host_bytes(client) == (before, 0)
    session.close()


def test_the_session_frees_its_regions_and_a_mapping_stays_charged_until_unmapped(daemon):
    client = daemon.client
    session = _session(client)
    before, _ = _host_bytes(client)
    with session.alloc_state_region(4096, "moments") as kept:
        view = kept.tensor(torch.int8)
        view.fill_(3)
        dropped = session.alloc_state_region(8192)
        assert _host_bytes(client) == (before + 12288, 12288)
        session.close()
        assert dropped.closed, "the session closed its regions"
        assert daemon.memfds().count("state") == 0
        # The tensor over the kept mapping holds it: still charged, but no longer a state
        # region of any session.
        assert _host_bytes(client) == (before + 4096, 0)
        assert int(view.sum()) == 3 * 4096
        del view
    assert _host_bytes(client) == (before, 0)


def test_a_region_over_the_host_quota_is_refused_with_the_numbers(tmp_path):
    uid = os.getuid()
    config = tmp_path / "config.toml"
    config.write_text(f"[quotas]\nper_uid_host_bytes = {1 << 20}\n")
    d = Daemon(tmp_path, "--config", str(config))
    try:
        session = _session(d.client)
        held, _ = _host_bytes(d.client)
        with pytest.raises(weightstream.RequestRejected) as e:
            session.alloc_state_region(1 << 20)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert e.value.message.startswith(
            f"quotas.per_uid_host_bytes = 1048576 exceeded: uid {uid} holds {held} host bytes "
            "and this state region needs 1048576 more; held by: u-"
        )
        assert e.value.message.endswith(
            "; a state region is charged whole when it is made: ask for fewer bytes, free host "
            "memory (state regions, sessions, models), or ask the daemon's administrator for a "
            "larger quota"
        )
        assert d.memfds().count("state") == 0
        with pytest.raises(weightstream.RequestRejected) as e:
            session.alloc_state_region(0)
        assert (e.value.code, e.value.message) == (
            "INVALID_ARGUMENT",
            "bytes: must be more than 0",
        )
        session.close()
    finally:
        d.stop()
