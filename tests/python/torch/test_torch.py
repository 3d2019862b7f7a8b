"""weightstream.torch.attach on the CPU against the daemon's host backend: outputs, LoRA
gradients and losses equal (torch.equal) to the same model with its weights in place."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import weightstream
import weightstream.torch as wst
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.utils.checkpoint import checkpoint
from weightstream.integrations.ai_toolkit import MemoryManager

DIM = 64


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        heads = [t(x).view(b, n, 4, DIM // 4).transpose(1, 2) for t in (self.q, self.k, self.v)]
        y = F.scaled_dot_product_attention(*heads)
        return self.o(y.transpose(1, 2).reshape(b, n, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    """Conv2d, Linear, LayerNorm, attention (ours and nn.MultiheadAttention)."""

    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(4, DIM, 3, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.mha = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.proj_out = nn.Linear(DIM, 4)
        self.ckpt = None  # None, "reentrant" or "non-reentrant"

    def forward(self, x):
        h = self.conv_in(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            if self.ckpt is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.proj_out(h)


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)  # peft's LoRA init uses the global RNG
    model = Net()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o", "fc1", "fc2"])
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model.to(dtype)


def inputs(steps, dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(2, 4, 8, 8, generator=g).to(device, dtype).requires_grad_()
        for _ in range(steps)
    ]


def train(model, xs, sample_between=False, autocast=False):
    """AdamW on the LoRA parameters; returns losses, outputs, LoRA gradients of each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, outs, grads, samples = [], [], [], []
    for x in xs:
        with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach().clone())
        outs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
        if sample_between:
            with torch.no_grad():
                samples.append(model(x.detach()).clone())
    return losses, outs, grads, samples


def assert_equal_runs(ref, got):
    for what, a, b in zip(("loss", "output", "grads", "samples"), ref, got, strict=True):
        assert len(a) == len(b), what
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            if isinstance(x, list):
                for i, (gx, gy) in enumerate(zip(x, y, strict=True)):
                    assert torch.equal(gx, gy), f"{what} {i} differs at step {step}"
            else:
                assert torch.equal(x, y), f"{what} differs at step {step}"


#: (budget, staging) that make groups stream through a small staging arena: 96 KiB layer by
#: layer; by block (fp32 194 KiB, bf16 97 KiB), staging for one and a half blocks.
BUDGETS = {
    ("layer", torch.float32): (96 << 10, 0),
    ("layer", torch.bfloat16): (96 << 10, 0),
    ("block", torch.float32): (400 << 10, 300 << 10),
    ("block", torch.bfloat16): (250 << 10, 150 << 10),
}


@pytest.mark.parametrize(
    "dtype,ckpt,autocast,group_by",
    [
        (torch.float32, None, False, "layer"),
        (torch.float32, "reentrant", False, "layer"),
        (torch.bfloat16, None, False, "layer"),
        (torch.bfloat16, "non-reentrant", False, "layer"),
        (torch.float32, "non-reentrant", True, "layer"),
        (torch.float32, None, False, "block"),
        (torch.float32, "reentrant", False, "block"),
        (torch.bfloat16, "non-reentrant", False, "block"),
        (torch.float32, "non-reentrant", True, "block"),
    ],
)
def test_attach_is_bit_exact(daemon, dtype, ckpt, autocast, group_by):
    steps = 4
    ref = make_model(dtype)
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    budget, staging = BUDGETS[group_by, dtype]
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
        group_by=group_by,
    )
    # Every frozen Linear and Conv2d streams, except MultiheadAttention's out_proj, which the
    # attention reads directly; the LoRA layers are trainable and stay.
    assert "mha.out_proj" in handle.resident
    assert len(handle.streamed) == 1 + 3 * 6 + 1
    placeholder = streamed.blocks[0].attn.q.base_layer.weight
    assert isinstance(placeholder, wst.Placeholder) and placeholder.device.type == "cpu"
    xs = inputs(steps, dtype)
    assert_equal_runs(
        train(ref, xs, sample_between=True, autocast=autocast),
        train(streamed, xs, sample_between=True, autocast=autocast),
    )
    stats = handle.stats()
    assert stats["acquires"] > 0 and stats["misses"] < stats["acquires"]
    # Where the attach's time went: the upload (the daemon's commit within it), the session.
    assert stats["attach_total_s"] >= stats["attach_model_s"] >= stats["attach_upload_total_s"]
    assert stats["attach_upload_total_s"] >= stats["attach_upload_daemon_total_s"] > 0
    assert stats["attach_upload_daemon_input_bytes"] > 0 and stats["attach_open_session_s"] > 0
    streaming = sum(not g.resident for g in handle.session.groups)
    assert stats["copies"] > 2 * streaming, "groups were evicted and copied again"
    handle.detach(release=True)


@pytest.mark.parametrize("ckpt", [None, "non-reentrant"])
def test_a_block_is_one_group_acquired_once_per_pass(daemon, ckpt):
    """By default a group is one of the model's repeated blocks, and its ticket serves all of
    the block's layers in a pass: a step acquires conv_in, the three blocks and proj_out once
    in forward and once in backward (a block's recompute and backward share one acquire)."""
    model = make_model()
    model.ckpt = ckpt
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, vram_budget=1 << 20, staging_bytes=1 << 20
    )
    names = [g.name for g in handle.session.groups]
    assert names == ["conv_in", "blocks.0", "blocks.1", "blocks.2", "proj_out"]
    block0 = handle.session.groups[1]
    assert [t.name for t in block0.tensors][:3] == [
        "blocks.0.attn.q.base_layer.weight",
        "blocks.0.attn.q.base_layer.bias",
        "blocks.0.attn.k.base_layer.weight",
    ]
    assert handle.streamed["blocks.0.fc2.base_layer"].group == 1
    xs = inputs(4, torch.float32)
    train(model, xs[:2])
    # Counted in the steady state (the lookahead keeps the next step's first acquires sent).
    before = handle.session.submitted
    train(model, xs[2:])
    assert handle.session.submitted - before == 2 * (5 + 5)
    handle.detach(release=True)


def test_resident_groups_run_without_acquires(daemon):
    """Groups the budget keeps resident are acquired once, when the session opens: their
    modules then run their own operation on the resident views, with nothing sent per step;
    results stay equal, and so after set_budget moves groups in and out of the resident set."""
    ref = make_model()
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = "non-reentrant"
    handle = wst.attach(streamed, "cpu", client=daemon.client, min_bytes=0, vram_budget=1 << 20)
    resident = [g.name for g in handle.session.groups if g.resident]
    # Spread along the pass: the block between the resident ones streams.
    assert resident == ["conv_in", "blocks.0", "blocks.2", "proj_out"], resident
    assert handle.streamed["blocks.0.attn.q.base_layer"].fixed is not None
    assert handle.streamed["blocks.1.attn.q.base_layer"].fixed is None
    xs = inputs(5, torch.float32)
    splits = (xs[:2], xs[2:3], xs[3:])
    want = [train(ref, x) for x in splits]
    assert_equal_runs(want[0], train(streamed, splits[0]))
    before = handle.session.submitted  # the plan is followed from here on
    assert_equal_runs(want[1], train(streamed, splits[1]))
    assert handle.session.submitted - before == 2, "only blocks.1, once per pass"
    label = [s.label for s in daemon.client.list_sessions()]
    handle.set_budget(660 << 10, staging_bytes=600 << 10)
    assert [s.label for s in daemon.client.list_sessions()] == label, "the reopened keeps it"
    assert [g.name for g in handle.session.groups if g.resident] == ["conv_in", "proj_out"]
    assert handle.streamed["blocks.0.attn.q.base_layer"].fixed is None
    assert_equal_runs(want[2], train(streamed, splits[2]))
    handle.detach(release=True)


def test_a_budget_below_three_blocks_streams_layer_by_layer(daemon):
    model = make_model()
    with pytest.warns(UserWarning, match="streaming layer by layer instead"):
        handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, vram_budget=96 << 10)
    assert len(handle.session.groups) == len(handle.streamed)
    handle.detach(release=True)
    with pytest.raises(ValueError, match="group_by='rows': expected 'block', 'layer'"):
        wst.attach(make_model(), "cpu", client=daemon.client, min_bytes=0, group_by="rows")


def test_later_steps_are_prefetched(daemon):
    model = make_model()
    model.ckpt = "non-reentrant"
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, vram_budget=96 << 10, group_by="layer"
    )
    xs = inputs(6, torch.float32)
    train(model, xs[:1])
    first = handle.stats()
    train(model, xs[1:])
    after = handle.stats()
    acquires, hits = after["acquires"] - first["acquires"], after["hits"] - first["hits"]
    assert after["misses"] > 0, "the budget is small enough that groups must be copied"
    assert handle._recording is None, "the first step's plan was sent"
    assert hits / acquires >= 0.95, f"{hits}/{acquires} hits after the first step"
    assert after["reuses"] > first["reuses"], "recompute and backward reuse the staged bytes"
    handle.detach()


def test_detach_gives_the_weights_back(daemon):
    model = make_model()
    ref = copy.deepcopy(model)
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    handle.detach(release=True)
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert daemon.client.list_models().models == []
    assert daemon.memfds() == []


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_attach_frees_the_trainers_copy(daemon):
    big = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(16))).requires_grad_(
        False
    )
    gc.collect()
    before = rss()
    handle = wst.attach(big, "cpu", client=daemon.client, vram_budget=64 << 20)
    gc.collect()
    dropped = before - rss()
    assert dropped > 200 << 20, f"RSS fell by only {dropped >> 20} MiB of 256"
    x = torch.randn(3, 2048)
    assert big(x).shape == (3, 2048)
    handle.detach(release=True)


class OpenSessionSpy:
    """A client that calls ``before_open`` just before each session opens."""

    def __init__(self, client, before_open):
        self._client, self._before_open = client, before_open

    def open_session(self, *args, **kwargs):
        self._before_open()
        return self._client.open_session(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_attach_frees_the_device_copies_before_the_session_opens(daemon, monkeypatch):
    """The daemon allocates the session's budget on the device: by then the trainer's copies
    there are gone (nothing holds them) and torch's cache was emptied."""
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4))).requires_grad_(False)
    copies = [weakref.ref(p) for p in model.parameters()]
    events = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    spy = OpenSessionSpy(
        daemon.client, lambda: events.append(("open", sum(c() is not None for c in copies)))
    )
    handle = wst.attach(model, "cpu", client=spy, min_bytes=0)
    assert events == ["empty_cache", ("open", 0)]
    handle.detach(release=True)


def test_a_failed_attach_releases_its_upload(tmp_path):
    """A session refused after the upload (here by the device quota) leaves the daemon's host
    bytes where they were: the next attach is not refused by the host quota, which holds one
    model (before the fix, the first upload stayed and took it)."""
    from tests.daemon import Daemon

    model_bytes = 8 * 256 * 256 * 4
    config = tmp_path / "config.toml"
    config.write_text(
        f"[quotas]\nper_uid_host_bytes = {model_bytes * 3 // 2}\nper_uid_device_bytes = {1 << 20}\n"
    )
    d = Daemon(tmp_path, "--config", str(config))

    def model():
        return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(8))).requires_grad_(
            False
        )

    try:
        with pytest.raises(weightstream.RequestRejected, match="per_uid_device_bytes"):
            wst.attach(model(), "cpu", client=d.client, min_bytes=0, vram_budget=2 << 20)
        listed = d.client.list_models()
        assert listed.models == [] and listed.store_bytes == 0
        # A committed upload's memfd is its model's arena (it keeps the name "upload").
        assert [k for k in d.memfds() if k in ("model", "upload")] == []
        handle = wst.attach(model(), "cpu", client=d.client, min_bytes=0, vram_budget=768 << 10)
        assert d.client.list_models().store_bytes == model_bytes
        handle.detach(release=True)
    finally:
        d.stop()


def test_two_processes_share_one_copy(daemon, tmp_path):
    worker = Path(__file__).with_name("attach_worker.py")
    env = {**os.environ, "WEIGHTSTREAM_SOCKET": daemon.socket}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(tmp_path), str(i)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    ids = [p.stdout.readline().strip() for p in procs]
    listed = daemon.client.list_models()
    sessions = daemon.client.list_sessions()
    for p in procs:
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    assert ids[0] == ids[1] and ids[0].startswith("u-"), ids
    assert len(sessions) == 2
    assert len(listed.models) == 1
    assert listed.store_bytes == listed.models[0].total_bytes


@pytest.mark.parametrize("pin", [False, True])
def test_an_attached_upload_goes_with_its_process_unless_pinned(daemon, tmp_path, pin):
    """The upload ``attach`` makes is released once its session and its process are gone (the
    next job uploads again); with ``pin=True`` it stays, pinned, until released."""
    worker = Path(__file__).with_name("attach_worker.py")
    env = {**os.environ, "WEIGHTSTREAM_SOCKET": daemon.socket}
    args = [sys.executable, str(worker), str(tmp_path), "0", *(["pin"] if pin else [])]
    proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    model_id = proc.stdout.readline().strip()
    (listed,) = daemon.client.list_models().models
    assert (listed.model_id, listed.refcount, listed.sessions) == (model_id, 1, 1)
    assert (listed.pinned, listed.cached) == (int(pin), False)
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10  # a bound on the daemon's teardown, not a delay
    while True:
        models = daemon.client.list_models().models
        gone = not models
        settled = models and models[0].sessions == 0
        if (gone and not pin) or (settled and pin):
            break
        assert time.monotonic() < deadline, models
        time.sleep(0.02)
    if pin:
        (kept,) = models
        assert (kept.model_id, kept.refcount, kept.pinned, kept.cached) == (model_id, 1, 1, False)
        assert daemon.client.release_model(model_id) == 0
        assert daemon.client.list_models().models == []
    assert daemon.memfds() == []


def test_a_killed_daemon_fails_the_trainer_fast(daemon):
    model = make_model()
    wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    xs = inputs(2, torch.float32)
    train(model, xs[:1])
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=30)
    with pytest.raises(weightstream.DaemonUnavailable):
        train(model, xs[1:])


def test_ai_toolkit_adapter(daemon, monkeypatch):
    monkeypatch.setenv("WEIGHTSTREAM_SOCKET", daemon.socket)
    ref = make_model()
    model = copy.deepcopy(ref)
    manager = MemoryManager.attach(
        model, torch.device("cpu"), offload_percent=0.5, ignore_modules=[]
    )
    MemoryManager.sync_grad_transfers()
    streamed = set(manager.handle.streamed)
    again = copy.deepcopy(ref)
    streamed_again = set(MemoryManager.attach(again, "cpu", offload_percent=0.5).handle.streamed)
    assert streamed == streamed_again, "the choice is deterministic"
    frozen = sum(
        m.weight.nbytes
        for n, m in ref.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) and not m.weight.requires_grad
    )
    chosen = sum(
        m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
        for n, m in ref.named_modules()
        if n in streamed
    )
    assert 0.5 * frozen <= chosen < frozen
    xs = inputs(3, torch.float32)
    assert_equal_runs(train(ref, xs), train(model, xs))
    MemoryManager.detach(again)
    MemoryManager.detach(model, release=True)


def test_weights_read_outside_forward_stay_resident(daemon):
    from torch.nn.utils import parametrizations

    torch.manual_seed(5)
    tied, twin = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
    twin.weight = tied.weight  # tied weights: one Parameter in two modules
    model = nn.Sequential(
        tied,
        nn.Linear(32, 32),
        twin,
        parametrizations.weight_norm(nn.Linear(32, 32)),
    ).requires_grad_(False)
    ref = copy.deepcopy(model)
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    assert set(handle.streamed) == {"1"}
    assert {"0", "2", "3"} <= set(handle.resident)
    x = torch.randn(4, 32)
    assert torch.equal(model(x), ref(x))
    handle.detach(release=True)


def test_attach_to_a_model_the_daemon_loaded(daemon, tmp_path):
    from safetensors.torch import save_file

    model = make_model()
    ref = copy.deepcopy(model)
    frozen = {
        n: p.detach()
        for n, p in model.named_parameters()
        if not p.requires_grad and not n.startswith(("mha.", "blocks.0.norm", "blocks.1.norm"))
    }
    path = tmp_path / "base.safetensors"
    save_file({n: t.contiguous() for n, t in frozen.items()}, str(path))
    manifest = daemon.client.load_model([str(path)], "base")
    with pytest.warns(UserWarning, match="streaming the daemon's copy"):
        handle = wst.attach(
            model, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id
        )
    assert handle.model_id == manifest.model_id
    assert len(daemon.client.list_models().models) == 1, "nothing was uploaded"
    stats = handle.stats()
    assert stats["attach_total_s"] >= stats["attach_model_s"] + stats["attach_open_session_s"]
    assert not any(k.startswith("attach_upload_") for k in stats)
    xs = inputs(2, torch.float32)
    assert_equal_runs(train(ref, xs), train(model, xs))
    bad = make_model()
    bad.blocks[0].fc1.base_layer.weight.data = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="blocks.0.fc1.base_layer.weight' has shape"):
        wst.attach(bad, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id)
    handle.detach()


def test_a_daemon_killed_mid_step_fails_the_trainer(daemon):
    model = make_model()
    wst.attach(model, "cpu", client=daemon.client, min_bytes=0)

    def kill(*_):
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(timeout=30)

    model.blocks[1].register_forward_pre_hook(kill)
    with pytest.raises(weightstream.DaemonUnavailable):
        train(model, inputs(1, torch.float32))


@pytest.mark.parametrize("group_by", ["layer", "block"])
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non-reentrant"])
def test_lookahead_keeps_results_exact(daemon, ckpt, group_by):
    """With room in staging, the plan's next acquires are kept in flight (the trainer never
    waits on a round trip); results stay equal, also across no_grad sampling passes that leave
    the plan."""
    ref = make_model()
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        # All staging, nothing resident: every group streams.
        vram_budget=(512 if group_by == "layer" else 1536) << 10,
        staging_bytes=(512 if group_by == "layer" else 1536) << 10,
        group_by=group_by,
    )
    xs = inputs(4, torch.float32)
    assert_equal_runs(train(ref, xs, sample_between=True), train(streamed, xs, sample_between=True))
    ahead = handle._lookahead
    largest = max(g.nbytes for g in handle.session.groups)
    assert ahead is not None and ahead.cap > 2 * largest, "the lookahead had room"
    stats = handle.stats()
    assert stats["acquires"] > 3 * len(handle.session.groups)
    handle.detach(release=True)
    assert daemon.client.list_sessions() == []


def make_wrapped_model():
    """make_model with two more libraries' forwards on its frozen layers: ai-toolkit's LoRA
    on proj_out (``org_forward``) and an accelerate hook on blocks.1.fc1's base layer."""
    from accelerate.hooks import add_hook_to_module

    from tests.python.torch.test_torch_hooks import CountingHook, OrgForwardLoRA

    model = make_model()
    lora = OrgForwardLoRA(model.proj_out)
    lora.apply_to()
    model.network = nn.ModuleList([lora])  # so that train() finds its parameters
    hook = CountingHook()
    add_hook_to_module(model.blocks[1].fc1.base_layer, hook)
    return model, lora, hook


def test_attach_streams_inside_other_libraries_forwards(daemon):
    """Their forwards keep running around the streamed op, results stay equal, and detach
    leaves exactly their forwards in place."""
    from weightstream.torch.hooks import StreamedForward

    ref, ref_lora, ref_hook = make_wrapped_model()
    streamed, lora, hook = make_wrapped_model()
    ref.ckpt = streamed.ckpt = "non-reentrant"
    fc1 = streamed.blocks[1].fc1.base_layer
    links = [(streamed.proj_out, "forward"), (lora, "org_forward")]
    links += [(fc1, "forward"), (fc1, "_old_forward")]
    before = [vars(owner)[attr] for owner, attr in links]
    budget, staging = BUDGETS["block", torch.float32]
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
    )
    assert {"proj_out", "blocks.1.fc1.base_layer"} <= set(handle.streamed)
    assert vars(streamed.proj_out)["forward"] is before[0], "ai-toolkit's forward stays outside"
    assert isinstance(vars(lora)["org_forward"], StreamedForward)
    assert vars(fc1)["forward"] is before[2], "accelerate's forward stays outside"
    assert isinstance(vars(fc1)["_old_forward"], StreamedForward)
    xs = inputs(3, torch.float32)
    assert_equal_runs(train(ref, xs, sample_between=True), train(streamed, xs, sample_between=True))
    assert lora.calls == ref_lora.calls > 0 and hook.calls == ref_hook.calls > 0
    handle.detach(release=True)
    after = [vars(owner)[attr] for owner, attr in links]
    assert all(a is b for a, b in zip(after, before, strict=True)), "detach restored each link"
    x = inputs(1, torch.float32)[0]
    assert torch.equal(streamed(x), ref(x))


def test_attach_refuses_a_forward_it_cannot_chain_before_uploading(daemon):
    from tests.python.torch.test_torch_hooks import ReadsTheWeight

    model = make_model()
    ReadsTheWeight(model.proj_out)
    with pytest.raises(wst.HookConflict, match="^cannot stream 'proj_out': lycoris replaced"):
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    assert daemon.client.list_models().models == [], "nothing was uploaded"
    assert model.proj_out.weight.device.type == "cpu", "the model is untouched"


def test_attach_with_nothing_to_stream_says_why():
    """No daemon needed: attach refuses before it connects."""
    model = make_model().requires_grad_(True)  # the base model was not frozen
    with pytest.raises(ValueError) as raised:
        wst.attach(model, "cpu", min_bytes=0)
    assert str(raised.value) == (
        "nothing to stream: 56 Conv2d/Linear layers skipped: their weights require grad — "
        "freeze the base model first (model.requires_grad_(False)); 1 read directly by their "
        "parent (nn.MultiheadAttention's out_proj)"
    )
    model.requires_grad_(False)
    with pytest.raises(ValueError) as raised:
        wst.attach(model, "cpu")
    assert str(raised.value) == (
        "nothing to stream: 56 Conv2d/Linear layers skipped: smaller than min_bytes (1 MiB); "
        "1 read directly by their parent (nn.MultiheadAttention's out_proj). The largest layer "
        "under min_bytes holds 66560 bytes: to stream layers that small, lower min_bytes "
        "(attach(..., min_bytes=0) streams every frozen Linear and Conv2d layer)"
    )


def test_stream_options_choose_the_input_gradient_and_the_lookahead(daemon, monkeypatch):
    from weightstream.torch import ops

    recomputed = []
    real = ops.input_grad_by_recompute
    monkeypatch.setattr(ops, "input_grad_by_recompute", lambda *a: recomputed.append(1) or real(*a))
    ref = make_model()
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = "non-reentrant"
    options = wst.StreamOptions(input_grad="recompute", lookahead=0, min_bytes=0)
    budget, staging = BUDGETS["block", torch.float32]
    handle = wst.attach(
        streamed,
        "cpu",
        options,
        client=daemon.client,
        vram_budget=budget,
        staging_bytes=staging,
    )
    xs = inputs(3, torch.float32)
    assert_equal_runs(train(ref, xs), train(streamed, xs))
    assert recomputed, "backward recomputed the layers"
    assert handle._recording is None and handle._lookahead is None, "plan sent, none in flight"
    handle.detach(release=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_byte'"):
        wst.attach(make_model(), "cpu", client=daemon.client, min_byte=0)


def test_input_grad_is_an_attach_option_not_a_module_global(daemon):
    import warnings

    assert not hasattr(wst, "INPUT_GRAD"), "the deprecated global went"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = wst.attach(
            make_model(), "cpu", client=daemon.client, min_bytes=0, input_grad="recompute"
        )
    assert handle.options.input_grad == "recompute"
    handle.detach(release=True)


def test_group_sizes_follow_the_daemons_alignment(daemon):
    """Blocks stream when the budget holds three of the largest as the daemon lays it out
    (its GetInfo alignment), and the client's sizes are the daemon's."""
    import warnings

    from weightstream.torch import policy

    alignment = daemon.client.info().alignment
    model = make_model()
    layers = policy.select(model, wst.StreamOptions(min_bytes=0)).streamed
    largest = max(policy.choose_groups(model, layers, "block", alignment, None, 0).sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = wst.attach(
            model, "cpu", client=daemon.client, min_bytes=0, vram_budget=3 * largest
        )
    assert max(g.nbytes for g in handle.session.groups) == largest
    for g in handle.session.groups:
        assert g.nbytes == policy.group_nbytes([t.nbytes for t in g.tensors], alignment), g.name
    handle.detach(release=True)
    with pytest.warns(UserWarning, match="streaming layer by layer instead"):
        handle = wst.attach(
            make_model(),
            "cpu",
            client=daemon.client,
            min_bytes=0,
            vram_budget=3 * largest - 1,
        )
    handle.detach(release=True)


def test_a_budget_too_small_is_refused_before_anything_is_freed(daemon):
    """A vram_budget under the largest group is refused by attach itself, with the minimum,
    before it frees a weight (the daemon's refusal came after the weights on the session's
    device were freed); the upload is released and the model is as it was."""
    model = make_model().requires_grad_(False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as raised:
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0, vram_budget=4096)
    assert str(raised.value) == (
        "vram_budget=4096 is smaller than the largest streamed group 'blocks.0.fc1.base_layer' "
        "(66560 bytes): the session needs at least 66560 bytes; raise "
        "vram_budget or pass vram_budget='auto'. Nothing was freed."
    )
    assert daemon.client.list_models().models == [], "the upload was released"
    after = dict(model.named_parameters())
    changed = [
        n for n, p in after.items() if isinstance(p, wst.Placeholder) or not p.equal(before[n])
    ]
    assert changed == [], "nothing was freed or changed"
