"""Trainable weights in host memory (``stream_trainable`` + ``HostAdamW``), on the CPU: losses
and LoRA weights ``torch.equal`` to the same model trained with its LoRA in place and the
documented optimizer formula applied to fp32 masters (``master="fp32"``) or to the bf16 weights
themselves (``master="none"``); delayed updates equal to a reference that applies each update
one step late; accumulation, clipping, schedulers and resume."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import weightstream
import weightstream.torch as wst
from torch import nn
from torch.utils.checkpoint import checkpoint
from weightstream.sizes import size_text
from weightstream.torch.host import (
    HostAdamW,
    TrainableError,
    host_bytes,
    reference_adamw,
    stream_trainable,
)
from weightstream.torch.host.storage import BounceRing

DIM, RANK, TOKENS = 48, 8, 6


class LoraLinear(nn.Module):
    """A frozen base with a LoRA branch, shaped like peft's (``lora_A``, ``lora_B``)."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.base_layer = nn.Linear(dim, dim)
        self.lora_A = nn.Linear(dim, rank, bias=False)
        self.lora_B = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = LoraLinear(DIM, RANK)
        self.mlp = LoraLinear(DIM, RANK)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.q(x)))


class Model(nn.Module):
    def __init__(self, blocks: int = 3, ckpt: bool = False):
        # 3 blocks: every group's copies stay live (lookahead 1 keeps 4); more: they come and go
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


def make(ckpt=False, seed=0, device="cpu", lora_dtype=torch.bfloat16, blocks=3):
    torch.manual_seed(seed)
    m = Model(blocks, ckpt=ckpt).to(torch.bfloat16).to(device)
    for n, p in m.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_" in n:
            p.data = p.data.to(lora_dtype)
    return m


def lora_params(m):
    return [p for n, p in m.named_parameters() if "lora_" in n]


def batches(n, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, TOKENS, DIM, generator=g).to(torch.bfloat16).to(device) for _ in range(n)
    ]


#: Set by ``train_pair(autocast=True)``: the forward runs under bf16 autocast.
AUTOCAST = [False]


def loss_of(model, x):
    with torch.autocast(x.device.type, torch.bfloat16, enabled=AUTOCAST[0]):
        out = model(x)
    return out.float().pow(2).mean()


def backward_both(ref_model, model, x, where=None):
    """Both models' losses on ``x`` (one micro-batch), asserted equal, and their backward."""
    want, got = loss_of(ref_model, x), loss_of(model, x)
    assert torch.equal(want, got), (where, want, got)
    want.backward()
    got.backward()


class Reference:
    """The LoRA in place, the optimizer's formula on the CPU, on fp32 masters (``master="fp32"``)
    or on copies of the weights in their own dtype (``"none"``: torch's AdamW on bf16
    parameters, adamw8's step on a bf16 ``p``)."""

    def __init__(
        self, model, kind="adamw", lr=1e-2, wd=1e-2, max_norm=None, delay=False, master="fp32"
    ):
        self.model, self.kind, self.max_norm, self.delay = model, kind, max_norm, delay
        self.params = lora_params(model)
        if master == "fp32":
            self.masters = [p.detach().float().cpu() for p in self.params]
        else:
            self.masters = [p.detach().cpu().clone() for p in self.params]
        self.hyper = {"lr": lr, "weight_decay": wd}
        self.opt = reference_adamw(self.masters, **self.hyper) if kind == "adamw" else None
        self.pending = None
        self.state8 = None
        self.steps = 0

    def step(self):
        if self.max_norm is not None:
            # torch's clipping reads the parameters' .grad
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            assert norm > self.max_norm, "the test clips"
        grads = [p.grad.cpu().clone() for p in self.params]
        for p in self.params:
            p.grad = None
        if self.delay:
            # Applied during the next step's first backward (``after_first_backward``).
            assert self.pending is None
            self.pending = grads
            return
        self.apply(grads)

    def after_first_backward(self):
        """The delayed update: the previous step's, once this step's first backward is done
        (a later micro-batch of the step computes with it)."""
        if self.pending is not None:
            grads, self.pending = self.pending, None
            self.apply(grads)

    def apply(self, grads):
        self.steps += 1
        if self.kind == "adamw":
            for m, g in zip(self.masters, grads, strict=True):
                m.grad = g.to(m.dtype)
            self.opt.step()
        else:
            from weightstream.torch.host import adamw8

            if self.state8 is None:
                self.state8 = [adamw8.new_state(m.numel()) for m in self.masters]
            for m, g, st in zip(self.masters, grads, self.state8, strict=True):
                adamw8.reference_step(
                    m.view(-1),
                    g.view(-1),
                    *st,
                    None,
                    step=self.steps,
                    lr=self.hyper["lr"],
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=self.hyper["weight_decay"],
                )
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def train_pair(
    steps=4,
    ckpt=False,
    accumulate=1,
    device="cpu",
    client=None,
    autocast=False,
    blocks=3,
    group_by="block",
    **kw,
):
    """Trains the LoRA in place (``Reference``) and the same model with ``stream_trainable``
    side by side, asserting equal losses; returns both models, the Trainable, the optimizer and
    the reference. ``client``: a daemon's client: the base streams through it (``attach``) and
    its session holds the host memory (``tr.handle``); ``autocast``: an fp32 LoRA under bf16
    autocast."""
    lora = torch.float32 if autocast else torch.bfloat16
    ref_model = make(ckpt, device=device, lora_dtype=lora, blocks=blocks)
    model = make(ckpt, device=device, lora_dtype=lora, blocks=blocks)
    AUTOCAST[0] = autocast
    ref = Reference(ref_model, **kw)
    handle = None
    if client is not None:
        handle = wst.attach(model, device, client=client, min_bytes=0)
    tr = stream_trainable(
        model, handle, device=device, master=kw.get("master", "fp32"), group_by=group_by
    )
    tr.handle = handle
    opt = HostAdamW(
        tr.params(),
        lr=1e-2,
        weight_decay=1e-2,
        trainable=tr,
        kind=kw.get("kind", "adamw"),
        max_grad_norm=kw.get("max_norm"),
        delay=kw.get("delay", False),
    )
    data = batches(steps * accumulate, device=device)
    for i in range(steps):
        for j in range(accumulate):
            backward_both(ref_model, model, data[i * accumulate + j], where=(i, j))
            if j == 0:
                ref.after_first_backward()
        ref.step()
        opt.step()
        opt.zero_grad()
    return ref_model, model, tr, opt, ref


def assert_same_lora(ref_model, model):
    for (n, a), b in zip(
        ((n, p) for n, p in ref_model.named_parameters() if "lora_" in n),
        lora_params(model),
        strict=True,
    ):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), n


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("master", ["fp32", "none"])
def test_adamw_equals_torch_adamw_on_masters(ckpt, master):
    ref_model, model, tr, _, _ = train_pair(ckpt=ckpt, master=master)
    assert_same_lora(ref_model, model)
    assert all(p.grad is None for p in lora_params(model))
    assert all(p.device.type == "cpu" for p in lora_params(model))
    tr.close()


@pytest.mark.parametrize(
    "kw", [{}, {"delay": True, "ckpt": True}, {"accumulate": 2, "max_norm": 0.05}]
)
@pytest.mark.parametrize("master", ["fp32", "none"])
def test_adamw8bit_equals_its_torch_reference(kw, master):
    """HostAdamW's adamw8bit (the native kernel) against adamw8.reference_step on the masters
    (or on the bf16 weights themselves): equal losses every step (train_pair) and equal LoRA
    weights at the end."""
    ref_model, model, tr, _, _ = train_pair(steps=5, kind="adamw8bit", master=master, **kw)
    assert_same_lora(ref_model, model)
    tr.close()


def test_fp32_lora_under_autocast():
    """fp32 working weights are their own masters; autocast's casts are differentiated by
    running the op again."""
    try:
        ref_model, model, tr, _, _ = train_pair(autocast=True, ckpt=True, max_norm=0.05)
    finally:
        AUTOCAST[0] = False
    assert_same_lora(ref_model, model)
    assert all(s.master is s.working for s in tr.slots)
    assert all(p.dtype == torch.float32 for p in lora_params(model))
    tr.close()


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


def test_a_state_saved_with_another_master_is_refused_naming_it():
    model = make()
    tr = stream_trainable(model, device="cpu")
    saved = HostAdamW(tr.params(), trainable=tr).state_dict()
    assert saved["master"] == "fp32"
    saved = copy.deepcopy(saved)
    tr.close()
    tr = stream_trainable(make(), device="cpu", master="none")
    opt = HostAdamW(tr.params(), trainable=tr)
    with pytest.raises(TrainableError) as e:
        opt.load_state_dict(saved)
    assert str(e.value) == (
        "parameter 0 (blocks.0.q.lora_A): master is [8, 48] torch.float32 in the state dict, "
        "[8, 48] torch.bfloat16 here (saved with master='fp32', this optimizer's trainable has "
        "master='none': resume with the same master)"
    )
    tr.close()


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


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_clipping_and_accumulation(master):
    ref_model, model, tr, _, _ = train_pair(accumulate=2, max_norm=0.05, master=master)
    assert_same_lora(ref_model, model)
    tr.close()


@pytest.mark.parametrize("master", ["fp32", "none"])
@pytest.mark.parametrize("group_by", ["block", "layer"])
def test_delayed_update_is_one_step_late(master, group_by):
    """Per layer, backward takes a group (and sets its update off) several groups before it
    gives the gradient: its copies are kept until then, or a later copy would read the updated
    weight."""
    ref_model, model, tr, opt, ref = train_pair(
        steps=5, delay=True, ckpt=True, master=master, group_by=group_by
    )
    assert_same_lora(ref_model, model)
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    tr.close()


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("blocks", [3, 7])
def test_delayed_update_with_accumulation_lands_after_the_first_backward(ckpt, blocks):
    """With gradient accumulation the previous step's update lands during the step's first
    backward and the later micro-batches compute with it, whether their forward still finds
    the group's copies (3 blocks: all live) or copies them again (7: they come and go)."""
    ref_model, model, tr, opt, ref = train_pair(
        steps=4, accumulate=3, delay=True, ckpt=ckpt, blocks=blocks, max_norm=0.05
    )
    assert_same_lora(ref_model, model)
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    tr.close()


def step_both(ref_model, model, ref, opt, x):
    """One step of ``train_pair``'s two models on ``x`` (one micro-batch), asserting equal
    losses."""
    backward_both(ref_model, model, x)
    ref.after_first_backward()
    ref.step()
    opt.step()


def test_delayed_updates_run_before_their_gradients_and_those_land_in_place():
    """Backward's first take of a group sets its delayed updates off: with the worker given
    time to finish them (here: each gradient waits for the worker to be idle), every gradient
    of a step after the first lands straight in its slot and none goes through the bounce
    ring, whether backward copied the group again (7 checkpointed blocks: the first ones) or
    found the copies forward left (the last). The ring is the session's host memory, twice
    the largest group's gradients, and every piece it lends comes back."""
    ref_model, model, tr, opt, ref = train_pair(steps=2, delay=True, ckpt=True, blocks=7)
    bounced = []
    take, grad_ready = tr._bounce.take, tr.grad_ready

    def counting(shape, dtype):
        bounced.append(shape)
        return take(shape, dtype)

    def after_the_worker(slot, grad):
        tr.wait_grads()
        grad_ready(slot, grad)

    tr._bounce.take, tr.grad_ready = counting, after_the_worker
    for x in batches(2, seed=9):
        step_both(ref_model, model, ref, opt, x)
        assert bounced == []
    assert tr._bounce.in_use == 0
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    block = sum(-(-s.param.nbytes // 256) * 256 for s in tr.groups["blocks.0"].slots)
    assert tr._bounce.size == tr.bounce_bytes == 8192 == -(-2 * block // 4096) * 4096
    tr.close()


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


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_resume_continues_the_same_trajectory(master):
    data = batches(4)
    whole = make()
    tr = stream_trainable(whole, device="cpu", master=master)
    opt = HostAdamW(tr.params(), lr=1e-2, trainable=tr, delay=True)
    for x in data:
        loss_of(whole, x).backward()
        opt.step()
        opt.zero_grad()

    first = make()
    tr1 = stream_trainable(first, device="cpu", master=master)
    opt1 = HostAdamW(tr1.params(), lr=1e-2, trainable=tr1, delay=True)
    for x in data[:2]:
        loss_of(first, x).backward()
        opt1.step()
        opt1.zero_grad()
    saved = copy.deepcopy(opt1.state_dict())
    lora = {k: v.clone() for k, v in first.state_dict().items() if "lora_" in k}
    tr1.close()

    second = make()
    with torch.no_grad():
        for p in lora_params(second):
            p.zero_()  # the weights come from the saved LoRA, the masters from the state
    second.load_state_dict(lora, strict=False)
    tr2 = stream_trainable(second, device="cpu", master=master)
    opt2 = HostAdamW(tr2.params(), lr=1e-2, trainable=tr2, delay=True)
    opt2.load_state_dict(saved)
    for x in data[2:]:
        loss_of(second, x).backward()
        opt2.step()
        opt2.zero_grad()
    assert_same_lora(whole, second)


def test_scheduler_sets_the_learning_rate():
    ref_model, model = make(), make()
    ref = Reference(ref_model)
    tr = stream_trainable(model, device="cpu")
    opt = HostAdamW(tr.params(), lr=1e-2, weight_decay=1e-2, trainable=tr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for i, x in enumerate(batches(3)):
        loss_of(ref_model, x).backward()
        loss_of(model, x).backward()
        for g in ref.opt.param_groups:
            g["lr"] = 1e-2 / (i + 1)
        ref.step()
        opt.step()
        sched.step()
    assert_same_lora(ref_model, model)


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


def test_the_state_dict_saves_with_torch_save_each_tensor_alone():
    """The state's tensors are views of shared regions in several dtypes (fp32 masters and a
    bf16 pending gradient in one region): ``torch.save`` takes them, each with its own bytes
    only, and ``torch.load(weights_only=True)`` gives them back equal."""
    import io

    model = make()
    tr = stream_trainable(model, device="cpu")
    opt = HostAdamW(tr.params(), lr=1e-2, trainable=tr, delay=True)
    for x in batches(2):
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    assert "pending_grad" in state["state"][0]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["kind"] == "adamw" and loaded["param_groups"] == state["param_groups"]
    for i, entry in state["state"].items():
        assert loaded["state"][i].keys() == entry.keys()
        for name, t in entry.items():
            got = loaded["state"][i][name]
            if isinstance(t, torch.Tensor):
                assert got.dtype == t.dtype and torch.equal(got, t), (i, name)
                assert got.untyped_storage().nbytes() == t.nbytes, (i, name)
            else:
                assert got == t, (i, name)
    tr.close()


KILLED_MID_STEP = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import torch, weightstream
import weightstream
import weightstream.torch as wst
from tests.python.torch_host.test_trainable import batches, loss_of, make
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
