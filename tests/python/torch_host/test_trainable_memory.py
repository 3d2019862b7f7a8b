"""Trainable weights in host memory (``stream_trainable`` + ``HostAdamW``): what the host memory
holds and who holds it (the daemon's session, its quota, its paced copies), the sizing checks
and refusals before anything moves, the bounce ring, and a trainer killed mid-step."""

from __future__ import annotations

import threading

import pytest
import torch
import weightstream
import weightstream.torch as wst
from torch import nn
from weightstream.sizes import size_text
from weightstream.torch.host import HostAdamW, TrainableError, host_bytes, stream_trainable
from weightstream.torch.host.storage import BounceRing

from tests.python.torch_host.trainable_pair import (
    DIM,
    RANK,
    Reference,
    assert_same_lora,
    backward_both,
    batches,
    lora_params,
    loss_of,
    make,
    step_both,
    train_pair,
)


def test_the_daemon_holds_the_host_memory_and_frees_it_with_the_session(daemon):
    """Base streamed from the daemon, LoRA state in the session's state regions: the same
    bits, the bytes charged to the uid, nothing left after close."""
    client = daemon.client
    ref_model, model, tr, opt, _ = train_pair(client=client, ckpt=True, delay=True, max_norm=0.05)
    assert_same_lora(ref_model, model)
    assert tr.handle.streamed, "the base streams"
    usage = client.info().usage
    assert usage.state_bytes == tr.host_bytes > 0
    assert daemon.memfds().count("state") == 2, "weights and gradients; the optimizer's moments"
    tr.close()  # the optimizer still exists: its views go too, so the mappings do
    after = client.info().usage
    assert (after.state_bytes, after.host_bytes) == (0, usage.host_bytes - usage.state_bytes)
    assert opt.state_dict()["state"] == {}
    tr.handle.close(release=True)
    assert client.info().usage.host_bytes == 0
    assert daemon.memfds().count("state") == 0


#: ``quota_daemon``'s host quota per uid: the test model's upload fits, its state beside it
#: does not.
QUOTA = 128 << 10


@pytest.fixture
def quota_daemon(tmp_path):
    from tests.daemon import Daemon

    config = tmp_path / "config.toml"
    config.write_text(f"[quotas]\nper_uid_host_bytes = {QUOTA}\n")
    d = Daemon(tmp_path, "--config", str(config))
    yield d
    d.stop()


def test_a_state_over_the_host_quota_is_refused_before_anything_moves(quota_daemon):
    d = quota_daemon
    model = make()
    handle = wst.attach(model, "cpu", client=d.client, min_bytes=0)
    held = d.client.info().usage.host_bytes
    before = [p.detach().clone() for p in lora_params(model)]
    storages = [p.data_ptr() for p in lora_params(model)]
    with pytest.raises(TrainableError) as e:
        stream_trainable(model, handle, optimizer="adamw")
    numel = sum(p.numel() for p in before)
    ring = 8192  # the bounce ring: twice a block's 3 KiB of gradients, in whole pages
    need, lean = ring + numel * (2 + 4 + 2 + 8), ring + numel * (2 + 2 + 4)
    assert lean <= QUOTA - held < need, "the test's quota: refused, and fits without the master"
    assert str(e.value) == (
        f"the trainable state needs {need} bytes of host memory with adamw and the fp32 "
        f"master, and quotas.per_uid_host_bytes leaves this uid {QUOTA - held} bytes beside "
        "what it holds: without the fp32 master (master='none': the optimizer updates the "
        f"weights in place) it needs {lean} bytes, which fits; else use adamw8bit, a lower "
        "rank, or raise the daemon's quota"
    )
    assert all(p.device.type == "cpu" for p in lora_params(model))
    assert [p.data_ptr() for p in lora_params(model)] == storages, "untouched"
    assert all(torch.equal(p, b) for p, b in zip(lora_params(model), before, strict=True))
    assert d.client.info().usage.state_bytes == 0
    tr = stream_trainable(model, handle, optimizer="adamw", master="none")
    HostAdamW(tr.params(), trainable=tr)
    assert tr.host_bytes == lean
    # Two regions (weights and gradients; moments) of lean / 2 each, in whole pages.
    assert d.client.info().usage.state_bytes == 2 * (-(-(lean // 2) // 4096) * 4096)
    tr.close()
    handle.close(release=True)


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
def test_master_none_holds_each_weight_once(kind):
    """``master="none"``: the optimizer's parameter is the bf16 weight itself, no fp32 copy;
    adamw's moments are bf16 (torch's AdamW on a bf16 parameter); the host bytes are
    ``host_bytes``' (the test's tensors fill whole 256-byte slots)."""
    model = make()
    numel = [p.numel() for p in lora_params(model)]
    tr = stream_trainable(model, device="cpu", master="none")
    assert tr.master == "none"
    assert all(s.master is s.working and s.working.dtype == torch.bfloat16 for s in tr.slots)
    ring = tr.bounce_bytes
    assert ring == 8192, "twice a block's 3 KiB of gradients, in whole pages"
    assert tr.host_bytes == ring + sum(host_bytes(n, torch.bfloat16, None, "none") for n in numel)
    assert tr.host_bytes == ring + sum(numel) * (2 + 2)
    opt = HostAdamW(tr.params(), trainable=tr, kind=kind)
    assert opt.master == "none"
    state = opt.state_dict()
    assert state["master"] == "none"
    assert state["state"][0]["master"].dtype == torch.bfloat16
    if kind == "adamw":
        assert state["state"][0]["exp_avg"].dtype == torch.bfloat16
        assert tr.host_bytes == ring + sum(
            host_bytes(n, torch.bfloat16, "adamw", "none") for n in numel
        )
        assert tr.host_bytes == ring + sum(numel) * (2 + 2 + 4)
    tr.close()
    fp32 = stream_trainable(make(), device="cpu")
    assert fp32.master == "fp32" and fp32.host_bytes == ring + sum(numel) * (2 + 4 + 2)
    fp32.close()


@pytest.mark.parametrize("master", ["fp32", "none"])
def stub_client(room: int):
    """A client whose daemon allows this uid ``room`` more host bytes (``host_room``)."""
    from types import SimpleNamespace

    info = SimpleNamespace(
        quotas=SimpleNamespace(per_uid_host_bytes=room + 100, max_host_bytes=0),
        usage=SimpleNamespace(host_bytes=100),
    )
    return SimpleNamespace(info=lambda: info)


def test_the_host_check_counts_each_master_mode():
    """``check_host_fits``: 1 Mi bf16 elements with adamw8bit are 10 MiB + 32 KiB with the fp32
    master, 6 MiB + 32 KiB without; the refusal with the master says when none would fit."""
    from weightstream.torch.host import check_host_fits

    params = [torch.empty(1 << 20, dtype=torch.bfloat16)]
    full, lean = (10 << 20) + (32 << 10), (6 << 20) + (32 << 10)
    assert host_bytes(1 << 20, torch.bfloat16, "adamw8bit") == full
    assert host_bytes(1 << 20, torch.bfloat16, "adamw8bit", "none") == lean
    assert host_bytes(1 << 20, torch.float32, "adamw8bit", "none") == full
    tail = "use adamw8bit, a lower rank, or raise the daemon's quota"
    check_host_fits(stub_client(full), params, "adamw8bit")
    check_host_fits(stub_client(lean), params, "adamw8bit", master="none")
    with pytest.raises(TrainableError) as e:
        check_host_fits(stub_client(8 << 20), params, "adamw8bit")
    assert str(e.value) == (
        f"the trainable state needs {size_text(full)} of host memory with adamw8bit and the "
        "fp32 master, and quotas.per_uid_host_bytes leaves this uid 8.00 MiB beside what it "
        "holds: without the fp32 master (master='none': the optimizer updates the weights in "
        f"place) it needs {size_text(lean)}, which fits; else {tail}"
    )
    with pytest.raises(TrainableError) as e:
        check_host_fits(stub_client(4 << 20), params, "adamw8bit")
    assert str(e.value) == (
        f"the trainable state needs {size_text(full)} of host memory with adamw8bit and the "
        f"fp32 master, and quotas.per_uid_host_bytes leaves this uid 4.00 MiB beside what it "
        f"holds: {tail}"
    )
    with pytest.raises(TrainableError) as e:
        check_host_fits(stub_client(4 << 20), params, "adamw8bit", master="none")
    assert str(e.value) == (
        f"the trainable state needs {size_text(lean)} of host memory with adamw8bit, and "
        f"quotas.per_uid_host_bytes leaves this uid 4.00 MiB beside what it holds: {tail}"
    )
    with pytest.raises(TrainableError) as e:
        check_host_fits(stub_client(8 << 20), [params[0].float()], "adamw8bit")
    assert str(e.value) == (
        f"the trainable state needs {size_text(full)} of host memory with adamw8bit, and "
        f"quotas.per_uid_host_bytes leaves this uid 8.00 MiB beside what it holds: {tail}"
    )


def test_the_bounce_ring_lends_first_in_first_out_and_waits_when_full():
    ring = BounceRing(torch.zeros(1024, dtype=torch.uint8))
    at = [ring.take((64,), torch.float32)[0] for _ in range(3)]  # 256 bytes each
    base = ring.region.data_ptr()
    assert [t.data_ptr() - base for t in at] == [0, 256, 512]
    with pytest.raises(TrainableError, match="does not fit the 1024-byte bounce ring"):
        ring.take((257,), torch.float32)
    ring.give()  # [0, 256) is free again; [768, 1024) too: a 512-byte piece fits neither
    assert ring._room(512) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.take((128,), torch.float32)))
    waiter.start()
    ring.give()  # now [0, 512) is free: the waiting piece goes there (the wrap)
    waiter.join()
    assert got[0][0].data_ptr() - base == 0
    assert ring.in_use == 2
    ring.give()
    ring.give()
    assert ring.in_use == 0 and ring._room(1024) == 0


def test_weights_change_and_close_puts_them_back():
    model = make()
    before = [p.detach().clone() for p in lora_params(model)]
    tr = stream_trainable(model, device="cpu")
    opt = HostAdamW(tr.params(), lr=1e-2, trainable=tr)
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    after = [p.detach().clone() for p in lora_params(model)]
    assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    tr.close()
    for p, a in zip(lora_params(model), after, strict=True):
        assert torch.equal(p.detach(), a)
        assert p.grad is None
    loss_of(model, batches(1)[0]).backward()  # the layers' own forward again
    assert all(p.grad is not None for p in lora_params(model))


def test_module_to_keeps_the_weights_in_host_memory():
    model = make()
    tr = stream_trainable(model, device="cpu")
    ptrs = [p.data_ptr() for p in tr.params()]
    model.to(torch.bfloat16)
    model.to("cpu")
    assert [p.data_ptr() for p in tr.params()] == ptrs
    tr.close()


def test_bad_input_is_named():
    model = make()
    with pytest.raises(TrainableError, match="'sgd' is not supported.*adamw, adamw8bit"):
        tr = stream_trainable(model, device="cpu")
        HostAdamW(tr.params(), trainable=tr, kind="sgd")
    tr.close()
    model = make()
    tr = stream_trainable(model, device="cpu")
    stray = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(
        TrainableError, match=r"1 of the optimizer's parameters \(shapes \[\(3, 4\)"
    ):
        HostAdamW([*tr.params(), stray], trainable=tr)
    opt = HostAdamW(tr.params(), trainable=tr)
    state = opt.state_dict()
    state["state"][0] = {**state["state"][0], "master": torch.zeros(2, 2)}
    with pytest.raises(
        TrainableError, match=r"parameter 0 \(blocks.0.q.lora_A\): master is \[2, 2\]"
    ):
        opt.load_state_dict(state)
    tr.close()
    frozen = make()
    frozen.requires_grad_(False)
    with pytest.raises(TrainableError, match="no trainable nn.Linear"):
        stream_trainable(frozen, device="cpu")
    for bad in (None, "bf16", "None"):
        with pytest.raises(TrainableError) as e:
            stream_trainable(make(), device="cpu", master=bad)
        assert str(e.value).startswith(f"master={bad!r}: expected one of 'fp32', 'none' (")
    for master in ("fp32", "none"):
        tr = stream_trainable(make(lora_dtype=torch.float16), device="cpu", master=master)
        with pytest.raises(TrainableError) as e:
            HostAdamW(tr.params(), trainable=tr, kind="adamw8bit")
        assert str(e.value) == (
            "blocks.0.q.lora_A: adamw8bit steps bf16 and fp32 weights, and this one is "
            "float16: use adamw, or a bf16 LoRA"
        )
        tr.close()
    conv = nn.Sequential(nn.Conv2d(3, 3, 1))
    with pytest.raises(TrainableError, match=r"'0' \(Conv2d\) has a trainable weight"):
        stream_trainable(conv, device="cpu")


KILLED_MID_STEP = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import torch, weightstream
import weightstream
import weightstream.torch as wst
from tests.python.torch_host.trainable_pair import batches, loss_of, make
from weightstream.torch.host import HostAdamW, stream_trainable

client = weightstream.connect(sys.argv[1])
model = make(ckpt=True)
handle = wst.attach(model, "cpu", client=client, min_bytes=0)
tr = stream_trainable(model, handle)
opt = HostAdamW(tr.params(), trainable=tr, kind="adamw8bit", delay=True)
for x in batches(2):
    loss_of(model, x).backward()
    opt.step()

def die(*_):
    print(client.info().usage.state_bytes, flush=True)
    sys.stdin.readline()  # the parent kills it here, in the middle of backward
model.blocks[1].register_full_backward_pre_hook(die)  # block 2's gradients are home by then
loss_of(model, batches(1)[0]).backward()
"""


def test_a_trainer_killed_mid_step_leaves_no_state_behind(daemon):
    """SIGKILL in the middle of backward, with a delayed update pending and the worker busy:
    the daemon frees the session's state regions and the uploaded base."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.python.client.test_reliability import wait_until

    worker = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_STEP, daemon.socket, str(Path(__file__).parents[3])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    held = int(worker.stdout.readline())
    assert held > 0, "the state was in the daemon's regions"
    assert daemon.client.info().usage.state_bytes == held
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    wait_until(
        "the killed trainer's state freed", lambda: daemon.client.info().usage.host_bytes == 0
    )
    assert daemon.client.list_sessions() == []
    wait_until("no shared memory left", lambda: daemon.memfds() == [])


def test_attach_with_trainable_host_streams_the_base_and_holds_the_lora(daemon):
    """``attach(..., trainable="host")``: one call; the same bits as the LoRA in place."""
    ref_model, model = make(ckpt=True), make(ckpt=True)
    ref = Reference(ref_model)
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, trainable="host", optimizer="adamw"
    )
    tr = handle.trainable
    assert handle.streamed and len(tr.slots) == 12
    opt = HostAdamW(tr.params(), lr=1e-2, weight_decay=1e-2, trainable=tr)
    for x in batches(3):
        backward_both(ref_model, model, x)
        ref.step()
        opt.step()
        opt.zero_grad()
    assert_same_lora(ref_model, model)
    assert daemon.client.info().usage.state_bytes > 0
    stats = handle.stats()
    assert stats["trainable_host_bytes"] == tr.host_bytes > 0
    assert {k for k in stats if k.startswith("trainable_") and k.endswith("_s")} == {
        f"trainable_{k}" for k in tr.times
    }
    handle.detach(release=True)  # the LoRA back as ordinary parameters, the regions freed
    assert handle.trainable is None
    assert_same_lora(ref_model, model)
    assert all(p.grad is None and p.device.type == "cpu" for p in lora_params(model))
    assert daemon.client.info().usage.host_bytes == 0


def test_attach_refuses_what_the_host_cannot_hold_before_uploading(quota_daemon):
    d = quota_daemon
    model = make()
    with pytest.raises(TrainableError) as e:
        wst.attach(model, "cpu", client=d.client, min_bytes=0, trainable="host", optimizer="adamw")
    ring = 8192  # the bounce ring: twice a block's 3 KiB of gradients, in whole pages
    state = ring + 3 * 2 * 2 * DIM * RANK * (2 + 4 + 2 + 8)
    message = str(e.value)
    prefix = "the upload ("
    assert message.startswith(prefix), message
    upload = int(message[len(prefix) :].split(" ")[0])
    lean = ring + 3 * 2 * 2 * DIM * RANK * (2 + 2 + 4)
    assert upload + lean <= QUOTA < upload + state
    assert message == (
        f"the upload ({upload} bytes) and the trainable state ({state} bytes with adamw and "
        f"the fp32 master) need {upload + state} bytes of host memory, and "
        f"quotas.per_uid_host_bytes leaves this uid {QUOTA} bytes: without the fp32 master "
        "(master='none': the optimizer updates the weights in place) the state is "
        f"{lean} bytes and both need {upload + lean} bytes, which fits; else use adamw8bit, "
        "quantize='fp8', a lower rank, or raise the daemon's quota"
    )
    with pytest.raises(TrainableError, match=r"master='fp16': expected one of 'fp32', 'none'"):
        wst.attach(model, "cpu", client=d.client, min_bytes=0, trainable="host", master="fp16")
    assert d.client.list_models().models == [], "nothing was uploaded"
    assert d.memfds() == []
    assert not any(isinstance(p, wst.Placeholder) for p in model.parameters())
    # The estimate is the daemon's own charge for that upload.
    handle = wst.attach(model, "cpu", client=d.client, min_bytes=0)
    assert d.client.info().usage.host_bytes == upload
    handle.close(release=True)


def test_a_layer_whose_forward_cannot_be_chained_is_refused_before_anything_moves():
    model = make()
    lora_a = model.blocks[0].q.lora_A
    lora_a.forward = lambda x: x  # a closure keeps no reference to the layer's own forward
    before = [p.data_ptr() for p in lora_params(model)]
    with pytest.raises(wst.HookConflict, match="cannot stream 'blocks.0.q.lora_A'"):
        stream_trainable(model, device="cpu")
    assert [p.data_ptr() for p in lora_params(model)] == before


def test_a_session_with_a_share_grants_the_trainers_own_copies(daemon):
    """A session with a copy share (or a device with a copy limit) tells the client to ask
    before each copy of its own: ``HostStorage.grant`` (what the trainable's device copies
    call) waits for the daemon, which counts the bytes by direction; without a share nothing
    is asked or counted."""
    from weightstream.torch.host.storage import HostStorage

    manifest, _ = daemon.client.upload_model("w", {"w": torch.zeros(1024)})

    def granted(session):
        [info] = [s for s in daemon.client.list_sessions() if s.session_id == session.id]
        return info.stats.granted_h2d_bytes, info.stats.granted_d2h_bytes

    groups = [("w", ["w"])]
    with daemon.client.open_session(
        manifest.model_id, groups, 1 << 20, copy_bandwidth_limit=100_000_000
    ) as session:
        assert session.paces_client_copies
        storage = HostStorage(torch.device("cpu"), session)
        storage.grant(4096, to_device=True)
        storage.grant(1000, to_device=False)
        storage.grant(1, to_device=True)
        assert granted(session) == (4097, 1000)
        with pytest.raises(weightstream.SessionFault) as e:
            session.grant(0, True)
        # Bounded by the bytes the session is charged for (staging plus resident).
        most = session.opened.staging_bytes + session.opened.resident_bytes
        assert session.opened.max_grant_bytes == most
        assert daemon.client.info().limits.max_waiting_grants == 256, "the default"
        assert (
            f"grant.bytes: 0 is outside 1 to {most} (the smaller of the daemon's largest grant, "
            f"268435456, and the {most} device bytes the session is charged for): split the "
            f"copy into grants of at most {most} bytes"
        ) in str(e.value)
        assert granted(session) == (4097, 1000)
    with daemon.client.open_session(manifest.model_id, groups, 1 << 20) as session:
        assert not session.paces_client_copies
        HostStorage(torch.device("cpu"), session).grant(4096, to_device=True)
        assert granted(session) == (0, 0)


@pytest.fixture
def paced_daemon(tmp_path):
    from tests.daemon import Daemon

    d = Daemon(tmp_path, "--copy-bandwidth-limit", "10GB/s")
    yield d
    d.stop()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_paced_copies_are_asked_for_and_issued_on_the_granter_thread(paced_daemon, accumulate):
    """Under a copy bandwidth limit each of the trainable's own copies is asked of the daemon
    and issued by the granter thread while the trainer goes on: the same bits as without, and
    the daemon counts each copy's bytes once, by direction."""
    ref_model, model, tr, opt, ref = train_pair(
        client=paced_daemon.client, ckpt=True, delay=True, blocks=7, accumulate=accumulate
    )
    assert tr._granter is not None, "the daemon paces the trainer's copies"
    assert_same_lora(ref_model, model)
    copied = {"to_device": 0, "back": 0}
    fetch, grad_ready = tr._fetch, tr.grad_ready

    def counting_fetch(group):
        copied["to_device"] += group.nbytes
        fetch(group)

    def counting_grads(slot, grad):
        copied["back"] += grad.nbytes
        grad_ready(slot, grad)

    tr._fetch, tr.grad_ready = counting_fetch, counting_grads

    def granted():
        [session] = paced_daemon.client.list_sessions()
        return session.stats.granted_h2d_bytes, session.stats.granted_d2h_bytes

    before = granted()
    step_both(ref_model, model, ref, opt, batches(1, seed=5)[0])
    assert copied["to_device"] > 0 and copied["back"] == 7 * 3072
    for granter in (tr._granter, tr._granter_back):
        granter.close()  # every grant asked for is answered
    tr._granter = tr._granter_back = None
    after = granted()
    assert (after[0] - before[0], after[1] - before[1]) == (copied["to_device"], copied["back"])
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    tr.close()
    tr.handle.close(release=True)
