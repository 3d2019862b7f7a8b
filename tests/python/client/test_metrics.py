"""The Prometheus endpoint, scraped and parsed by the reference Python parser, against the
daemon's own ListSessions after a known workload."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import ROOT, Daemon

LAYERS = 4
LAYER_BYTES = 64 << 10  # a multiple of the daemon's alignment: a group is exactly this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    port = free_port()
    d = Daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield d
    d.stop()


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = r.read().decode()
            break
        except OSError:
            # The endpoint binds before the socket appears, but poll rather than assume it.
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.05)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples


def only(samples, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def test_counters_match_list_sessions_after_a_known_workload(served):
    client = served.client
    g = torch.Generator().manual_seed(11)
    tensors = {f"l{i}": torch.randn(LAYER_BYTES // 4, generator=g) for i in range(LAYERS)}
    manifest, _ = client.upload_model("metrics", tensors)
    groups = [(name, [name]) for name in tensors]
    budget = LAYERS * LAYER_BYTES
    session = client.open_session(
        manifest.model_id, groups, budget, staging_bytes=budget, label="metrics-probe"
    )
    # Two passes in order: the first misses every group, the second finds each still staged.
    for _ in range(2):
        for i in range(LAYERS):
            session.release(session.acquire(i))
    # The client's measured waits, reported now; the report travels on the session's stream.
    session.report_gpu_wait()
    sent = session._native.gpu_wait_reports
    deadline = time.monotonic() + 30
    while True:
        [info] = [s for s in client.list_sessions() if s.session_id == session.id]
        if info.stats.gpu_wait_reports == sent:
            break
        assert time.monotonic() < deadline, "the client's report never arrived"
        time.sleep(0.01)

    m = scrape(served.metrics_url)
    st = info.stats
    assert st.gpu_wait_ns == session.gpu_wait().total_ns > 0
    assert (st.acquires, st.hits, st.misses, st.copies) == (8, 4, 4, 4)
    assert st.bytes_copied == LAYERS * LAYER_BYTES
    who = {"session": session.id, "label": "metrics-probe", "device": info.device_uuid}
    assert only(m, "weightstream_session_acquires_total", **who) == st.acquires
    assert only(m, "weightstream_session_prefetch_hits_total", **who) == st.hits
    assert only(m, "weightstream_session_prefetch_misses_total", **who) == st.misses
    assert only(m, "weightstream_session_copies_total", **who) == st.copies
    assert only(m, "weightstream_session_streamed_bytes_total", **who) == st.bytes_copied
    # No other session keeps the model's groups resident: nothing staged within the device.
    assert only(m, "weightstream_session_bytes_from_device_total", **who) == 0
    assert only(m, "weightstream_session_gpu_wait_seconds_total", **who) == pytest.approx(
        st.gpu_wait_ns / 1e9, rel=1e-9
    )
    assert only(m, "weightstream_session_acquire_pending_seconds_total", **who) == pytest.approx(
        st.acquire_pending_ns / 1e9, rel=1e-9
    )
    # A client that names no pass kind counts as training (Acquire.kind).
    assert only(m, "weightstream_session_pass_acquires_total", kind="train", **who) == st.acquires
    assert only(m, "weightstream_session_pass_acquires_total", kind="sample", **who) == 0
    assert only(m, "weightstream_session_pass_prefetch_hits_total", kind="train", **who) == st.hits
    assert (
        only(m, "weightstream_session_pass_streamed_bytes_total", kind="train", **who)
        == st.bytes_copied
    )
    assert not [k for k in m if "stall" in k[0]], "the old name of acquire pending went"
    assert only(m, "weightstream_session_staging_bytes", **who) == info.staging_bytes == budget
    assert only(m, "weightstream_session_budget_bytes", **who) == budget
    assert only(m, "weightstream_session_resident_bytes", **who) == info.resident_bytes == 0
    dev = {"device": info.device_uuid}
    assert only(m, "weightstream_device_acquires_total", **dev) == 8
    assert only(m, "weightstream_device_prefetch_hits_total", **dev) == 4
    assert only(m, "weightstream_device_prefetch_misses_total", **dev) == 4
    assert only(m, "weightstream_device_copies_total", **dev) == 4
    assert only(m, "weightstream_device_streamed_bytes_total", **dev) == LAYERS * LAYER_BYTES
    assert only(m, "weightstream_device_copy_queue_length", **dev) == 0
    assert only(m, "weightstream_device_staging_bytes", **dev) == budget
    assert only(m, "weightstream_device_copy_busy_seconds_total", **dev) > 0
    assert only(m, "weightstream_sessions") == 1
    assert only(m, "weightstream_models") == 1
    assert only(m, "weightstream_store_bytes") == client.list_models().store_bytes
    assert only(m, "weightstream_stopping") == 0
    assert only(m, "weightstream_build_info", backend="host") == 1

    # Every series the Grafana dashboard queries is one the daemon exports.
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"weightstream_\w+", target["expr"])
    }
    assert len(queried) >= 15
    exported = {name for name, _ in m}
    assert queried <= exported, queried - exported

    # A session that ends leaves its series, but the device totals keep what it did.
    session.close()
    deadline = time.monotonic() + 30
    while only(m := scrape(served.metrics_url), "weightstream_sessions") != 0:
        assert time.monotonic() < deadline, "the session never closed"
        time.sleep(0.05)
    assert not [k for k in m if k[0].startswith("weightstream_session_")]
    assert only(m, "weightstream_device_acquires_total", **dev) == 8
    assert only(m, "weightstream_device_prefetch_hits_total", **dev) == 4
    assert only(m, "weightstream_device_prefetch_misses_total", **dev) == 4
    assert only(m, "weightstream_device_streamed_bytes_total", **dev) == LAYERS * LAYER_BYTES
    assert only(m, "weightstream_device_gpu_wait_seconds_total", **dev) == pytest.approx(
        st.gpu_wait_ns / 1e9, rel=1e-9
    )
    assert only(m, "weightstream_device_acquire_pending_seconds_total", **dev) == pytest.approx(
        st.acquire_pending_ns / 1e9, rel=1e-9
    )
    assert only(m, "weightstream_device_staging_bytes", **dev) == 0
