"""``trainable: host`` under weightstream-aitk (``integrations.ai_toolkit.optimizer``),
on the CPU: ai-toolkit's trainer, reduced and re-enacted in its order, asks for its optimizer,
trains, saves, resumes and samples; the LoRA's weights and optimizer state live in host memory.

The stand-in trainer (``TRAINER``) makes ai-toolkit's calls at ostris/ai-toolkit 27a03a91, read
in ``jobs/process/BaseSDTrainProcess.py`` (``run``: the network created, ``force_to(device,
float32)``, ``apply_to``, ``prepare_optimizer_params``; the last saved LoRA loaded;
``get_optimizer(self.params, type, learning_rate=, optimizer_params=)`` imported by name from
``toolkit.optimizer``; ``optimizer.pt`` loaded with ``torch.load(weights_only=True)``, errors
printed and ignored; ``accelerator.prepare`` of the network and the optimizer; ``save``: the
network's ``state_dict`` in the save dtype and ``optimizer.pt``; ``sample`` at the end, and
before the first step unless ``skip_first_sample``) and in
``extensions_built_in/sd_trainer/SDTrainer.py`` (``hook_train_loop``: ``zero_grad``, backward,
``sync_grad_transfers``, ``accelerator.clip_grad_norm_`` per parameter group, ``step``,
``zero_grad(set_to_none=True)``). The network (``Network``) is ai-toolkit's
``LoRASpecialNetwork`` reduced: ``LoRAModule``s holding their layer in a list, hooked through
``org_forward``, ``_update_torch_multiplier`` as ``toolkit/network_mixins.py`` has it.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from weightstream.integrations import ai_toolkit
from weightstream.integrations.ai_toolkit import launcher
from weightstream.integrations.ai_toolkit import optimizer as aitk_trainable
from weightstream.integrations.ai_toolkit.settings import Settings
from weightstream.torch.hooks import StreamedForward
from weightstream.torch.host import HostAdamW, TrainableError, reference_adamw, stream_trainable

from tests.python.ai_toolkit.test_ai_toolkit import DTYPE, make_transformer, transformer_inputs

DIM, RANK = 32, 4
LR, WD, MAX_NORM = 1e-2, 1e-2, 0.05

# --- the stand-in ai-toolkit ---------------------------------------------------------------

OPTIMIZER = '''
import torch

def get_optimizer(params, optimizer_type="adam", learning_rate=1e-6, optimizer_params=None):
    """ai-toolkit's toolkit/optimizer.py, reduced to the adamw branch."""
    if optimizer_params is None:
        optimizer_params = {}
    if optimizer_type.lower() == "adamw":
        return torch.optim.AdamW(params, lr=float(learning_rate), eps=1e-6, **optimizer_params)
    raise ValueError(f"Unknown optimizer type {optimizer_type}")
'''

TRAINER = '''
"""ai-toolkit's BaseSDTrainProcess (run, save, sample) and SDTrainer's step, reduced."""
import os

import torch
from toolkit.memory_management import sync_grad_transfers
from toolkit.optimizer import get_optimizer


class BaseSDTrainProcess:
    def __init__(self, save_root, train_config, model, make_network, loss_of, batches,
                 accelerator, save_every=2):
        self.save_root, self.train_config, self.model = save_root, train_config, model
        self.make_network, self.loss_of, self.batches = make_network, loss_of, batches
        self.accelerator, self.save_every = accelerator, save_every
        self.network = None
        self.optimizer = None
        self.losses, self.saved, self.samples, self.load_errors, self.ptrs = [], [], [], [], []

    def run(self):
        c = self.train_config
        self.model.requires_grad_(False)
        self.network = self.make_network(self.model)
        self.network.force_to("cpu", dtype=torch.float32)
        self.network.apply_to()
        self.network.requires_grad_(True)
        self.params = self.network.prepare_optimizer_params(c.lr)
        lora = os.path.join(self.save_root, "lora.pt")
        if os.path.exists(lora):
            self.network.load_state_dict(torch.load(lora, weights_only=True))
        self.optimizer = get_optimizer(
            self.params, c.optimizer.lower(), learning_rate=c.lr,
            optimizer_params=c.optimizer_params,
        )
        state = os.path.join(self.save_root, "optimizer.pt")
        if os.path.exists(state):
            try:
                self.optimizer.load_state_dict(torch.load(state, weights_only=True))
            except Exception as e:
                self.load_errors.append(str(e))
        self.ptrs.append([p.data_ptr() for p in self.network.parameters()])
        self.network = self.accelerator.prepare(self.network)
        self.optimizer = self.accelerator.prepare(self.optimizer)
        self.ptrs.append([p.data_ptr() for p in self.network.parameters()])
        if not getattr(c, "skip_first_sample", True):  # ai-toolkit's baseline sample
            self.sample(c.start_step)
        for step in range(c.start_step, c.steps):
            self.hook_train_loop(self.batches[step])
            if (step + 1) % self.save_every == 0 and step + 1 < c.steps:
                self.save(step + 1)
        self.save()
        self.sample()

    def hook_train_loop(self, batch):
        self.optimizer.zero_grad()
        loss = self.loss_of(self.model, batch)
        loss.backward()
        sync_grad_transfers()
        for group in self.params:
            self.accelerator.clip_grad_norm_(group["params"], self.train_config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())

    def save(self, step=None):
        lora = {
            k: v.detach().clone().to("cpu").to(self.train_config.save_dtype)
            for k, v in self.network.state_dict().items()
        }
        torch.save(lora, os.path.join(self.save_root, "lora.pt"))
        torch.save(self.optimizer.state_dict(), os.path.join(self.save_root, "optimizer.pt"))
        self.saved.append((step, [p.detach().clone() for p in self.network.parameters()]))

    def sample(self, step=None):
        with torch.no_grad():
            self.samples.append(self.loss_of(self.model, self.batches[0]))
'''


class LoRAModule(nn.Module):
    """ai-toolkit's ``LoRAModule`` with ``ToolkitModuleMixin.forward``, reduced: the wrapped
    layer in a list, its forward kept as ``org_forward``; the branch in the LoRA's dtype,
    scaled by the network's ``torch_multiplier``."""

    def __init__(self, name: str, org: nn.Linear, network, rank=RANK, alpha=8.0):
        super().__init__()
        self.lora_name = name
        self.network_ref = weakref.ref(network)
        self.org_module = [org]
        self.lora_down = nn.Linear(org.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5**0.5)
        nn.init.normal_(self.lora_up.weight, std=0.1)  # ai-toolkit's zeros: every weight moves
        self.scale = alpha / rank

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def forward(self, x, *args, **kwargs):
        org = self.org_forward(x, *args, **kwargs)
        lx = self.lora_up(self.lora_down(x.to(self.lora_down.weight.dtype)))
        return org + (lx * self.scale * self.network_ref().torch_multiplier).to(org.dtype)


class Network(nn.Module):
    """``LoRASpecialNetwork`` reduced: a LoRA on every Linear of the transformer blocks."""

    def __init__(self, root: nn.Module):
        super().__init__()
        torch.manual_seed(2)
        self.unet_loras = nn.ModuleList(
            LoRAModule(name, m, self)
            for name, m in root.named_modules()
            if "transformer_blocks" in name and isinstance(m, nn.Linear)
        )
        self.block_lr = False
        self._multiplier = 1.0
        self._update_torch_multiplier()

    def _update_torch_multiplier(self):
        first = self.unet_loras[0]
        device, dtype = first.lora_down.weight.device, first.lora_down.weight.dtype
        if hasattr(first.lora_down, "_memory_management_device"):
            device = first.lora_down._memory_management_device
        self.torch_multiplier = torch.tensor((self._multiplier,)).to(device, dtype=dtype)

    @property
    def multiplier(self):
        return self._multiplier

    @multiplier.setter
    def multiplier(self, value):
        self._multiplier = value
        self._update_torch_multiplier()

    def force_to(self, device, dtype):
        self.to(device, dtype)

    def apply_to(self):
        for lora in self.unet_loras:
            lora.apply_to()

    def prepare_optimizer_params(self, lr):
        """One group, or with ``block_lr`` one per LoRA module with its own rate (kohya's
        block-wise rates)."""
        self.requires_grad_(True)
        if not self.block_lr:
            return [{"params": list(self.parameters()), "lr": lr}]
        n = len(self.unet_loras)
        return [
            {"params": list(lora.parameters()), "lr": lr * (i + 1) / n}
            for i, lora in enumerate(self.unet_loras)
        ]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.attn(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transformer_blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(x)
        return x


def model_loss(model, x):
    return model(x).float().pow(2).mean()


def model_batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, DIM, generator=g).to(DTYPE) for _ in range(n)]


def train_config(**changes):
    values = dict(
        optimizer="AdamW",
        lr=LR,
        optimizer_params={"weight_decay": WD},
        max_grad_norm=MAX_NORM,
        steps=4,
        start_step=0,
        save_dtype=torch.float16,
    )
    values.update(changes)
    return SimpleNamespace(**values)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def aitk(tmp_path):
    """The stand-in ai-toolkit on ``sys.path`` with the launcher's finders installed; yields a
    function that sets the launcher's settings."""
    root = tmp_path / "ai-toolkit"
    (root / "toolkit" / "memory_management").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "memory_management" / "__init__.py").write_text(
        'raise AssertionError("ai-toolkit\'s own memory manager was imported")\n'
    )
    (root / "toolkit" / "optimizer.py").write_text(OPTIMIZER)
    (root / "jobs" / "process").mkdir(parents=True)
    (root / "jobs" / "__init__.py").write_text("")
    (root / "jobs" / "process" / "__init__.py").write_text(
        "from .BaseSDTrainProcess import BaseSDTrainProcess\n"
    )
    (root / "jobs" / "process" / "BaseSDTrainProcess.py").write_text(TRAINER)
    sys.path.insert(0, str(root))
    launcher.install()
    try:
        yield lambda **kw: ai_toolkit.configure(Settings(**kw))
    finally:
        ai_toolkit.configure(None)
        launcher.uninstall()
        for name in [n for n in sys.modules if n.split(".")[0] in ("toolkit", "jobs")]:
            del sys.modules[name]
        sys.path.remove(str(root))
        assert aitk_trainable.RUNNING == []


def new_process(tmp_path, config=None, model=None, loss_of=model_loss, batches=None, **kw):
    from accelerate import Accelerator
    from jobs.process import BaseSDTrainProcess

    save_root = tmp_path / "output"
    save_root.mkdir(parents=True, exist_ok=True)
    return BaseSDTrainProcess(
        str(save_root),
        config or train_config(),
        model if model is not None else Model().to(DTYPE),
        kw.pop("make_network", Network),
        loss_of,
        batches or model_batches(),
        Accelerator(),
        **kw,
    )


def lora_of(process) -> list[torch.Tensor]:
    return [p.detach().clone() for p in process.network.parameters()]


# --- get_optimizer ------------------------------------------------------------------------------


def test_the_hook_finds_the_network_and_returns_host_adamw(aitk, tmp_path, capsys):
    aitk(trainable="host")
    process = new_process(tmp_path, train_config(steps=1))
    got = {}
    from jobs.process import BaseSDTrainProcess as cls

    save = cls.save

    def spy(self, step=None):  # the optimizer and layers as they are while training
        opt = self.optimizer.optimizer  # accelerate's AcceleratedOptimizer around it
        got.update(
            opt=opt,
            placement=self.optimizer.device_placement,
            devices={p.device.type for p in self.network.parameters()},
            grads=[p.grad for p in self.network.parameters()],
            moved=[
                "_apply" in vars(m) and isinstance(vars(m).get("forward"), StreamedForward)
                for lora in self.network.unet_loras
                for m in (lora.lora_down, lora.lora_up)
            ],
            mm_device={
                lora.lora_down._memory_management_device for lora in self.network.unet_loras
            },
            groups=list(opt.trainable.groups),
        )
        self.network.to(torch.bfloat16)
        got["dtypes"] = {p.dtype for p in self.network.parameters()}
        return save(self, step)

    cls.save = spy
    try:
        process.run()
    finally:
        cls.save = save
    opt = got["opt"]
    assert type(opt) is aitk_trainable.ToolkitHostAdamW and isinstance(opt, HostAdamW)
    assert (opt.kind, opt.delay, opt.group_max_grad_norm, opt.max_grad_norm) == (
        "adamw",
        True,
        MAX_NORM,
        None,
    )
    assert [
        {k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in opt.param_groups
    ] == [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": WD}]
    assert got["placement"] is False, "accelerate left the state in host memory"
    assert got["devices"] == {"cpu"} and got["grads"] == [None] * 12
    assert all(got["moved"]) and got["mm_device"] == {torch.device("cpu")}
    assert process.ptrs[0] == process.ptrs[1], "network.to() left the weights where they were"
    assert got["dtypes"] == {torch.float32}, "network.to(dtype) left the weights as they were"
    # No attached model: grouped by the network's own modules.
    assert got["groups"] == [f"network:unet_loras.{i}" for i in range(6)]
    out = capsys.readouterr().out
    assert (
        "weightstream-aitk: trainable: host: 12 LoRA layers and their adamw state in 0.00 GB "
        "of host memory (the trainer's own: no attached model holds the layers the LoRA wraps); "
        "computing on cpu; delayed update on; master fp32\n" in out
    )
    # After run: ordinary CPU parameters again, ai-toolkit's attribute gone.
    lora = process.network.unet_loras[0].lora_down
    assert "_apply" not in vars(lora) and not hasattr(lora, "_memory_management_device")
    assert "_weightstream_host_optimizer" not in vars(process)


def test_without_trainable_host_ai_toolkits_optimizer_is_made(aitk, tmp_path):
    aitk()
    process = new_process(tmp_path, train_config(steps=1))
    process.run()
    inner = process.optimizer.optimizer
    assert type(inner) is torch.optim.AdamW and inner.defaults["eps"] == 1e-6
    assert process.optimizer.device_placement is True
    assert all(p.grad is None for p in process.network.parameters())  # zero_grad(set_to_none)
    assert process.ptrs[0] == process.ptrs[1]


@pytest.mark.parametrize(
    "optimizer,params,want",
    [
        (
            "lion",
            {},
            "train.optimizer: 'lion' is not supported with weightstream's trainable: host: use "
            "one of adamw, adamw8bit (ai-toolkit's aliases: adamw8; adam, adam8bit, adam8 "
            "without weight_decay), or trainable: device",
        ),
        (
            "adamw",
            {"amsgrad": True},
            "train.optimizer_params.amsgrad: True is not supported with trainable: host (it "
            "takes betas, weight_decay and eps)",
        ),
        (
            "adam8bit",
            {"weight_decay": 0.1},
            "train.optimizer_params.weight_decay: 0.1 with 'adam8bit' "
            "(bitsandbytes.optim.Adam8bit) adds an L2 term to the gradient, which trainable: "
            "host does not run: use adamw (or adamw8bit) for decoupled weight decay, or "
            "weight_decay 0",
        ),
        (
            "adamw",
            {"betas": [0.9, 1.5]},
            "train.optimizer_params.betas: [0.9, 1.5]: expected two numbers in [0, 1)",
        ),
    ],
)
def test_an_unsupported_optimizer_is_refused_before_anything_moves(
    aitk, tmp_path, optimizer, params, want
):
    aitk(trainable="host")
    process = new_process(tmp_path, train_config(optimizer=optimizer, optimizer_params=params))
    with pytest.raises(TrainableError) as e:
        process.run()
    assert str(e.value) == want
    for lora in process.network.unet_loras:
        for m in (lora.lora_down, lora.lora_up):
            assert "_apply" not in vars(m) and "forward" not in vars(m)
            assert not hasattr(m, "_memory_management_device")
    assert process.optimizer is None and aitk_trainable.RUNNING == []


def test_parameters_that_are_not_lora_linear_weights_are_refused_before_anything_moves(
    aitk, tmp_path
):
    class WithScalar(Network):  # like LoCon's trainable scalar, or DoRA's magnitude
        def __init__(self, root):
            super().__init__(root)
            self.unet_loras[1].scalar = nn.Parameter(torch.ones(()))

    aitk(trainable="host")
    process = new_process(tmp_path, make_network=WithScalar)
    with pytest.raises(
        TrainableError,
        match=r"^1 of the parameters ai-toolkit gives its optimizer are not weights of the "
        r"network's nn.Linear layers \(e.g. 'unet_loras.1.scalar'\)",
    ):
        process.run()
    assert not any("_apply" in vars(m) for m in process.network.modules())


@pytest.mark.parametrize(
    "name,params,want",
    [
        ("AdamW", None, aitk_trainable.Hyper("adamw", LR, (0.9, 0.999), 1e-6, 1e-2)),
        ("adamw8bit", {}, aitk_trainable.Hyper("adamw8bit", LR, (0.9, 0.999), 1e-6, 1e-2)),
        ("adamw8", {}, aitk_trainable.Hyper("adamw8bit", LR, (0.9, 0.999), 1e-6, 0.0)),
        (
            "adam",
            {"betas": (0.8, 0.99), "eps": 1e-8, "foreach": True},
            aitk_trainable.Hyper("adamw", LR, (0.8, 0.99), 1e-8, 0.0),
        ),
        (
            "adam8",
            {"weight_decay": 0},
            aitk_trainable.Hyper("adamw8bit", LR, (0.9, 0.999), 1e-6, 0),
        ),
    ],
)
def test_ai_toolkits_names_and_defaults(name, params, want):
    assert aitk_trainable.resolve_optimizer(name, LR, params) == want


# --- training -------------------------------------------------------------------------------------


def direct(steps=4, save_every=2, delay=True, clip=MAX_NORM):
    """The same job with ``stream_trainable`` and ``HostAdamW`` used directly (no launcher):
    flushed where the trainer saves."""
    model = Model().to(DTYPE).requires_grad_(False)
    network = Network(model)
    network.force_to("cpu", torch.float32)
    network.apply_to()
    network.requires_grad_(True)
    tr = stream_trainable(network, None, device="cpu")
    opt = HostAdamW(
        [{"params": list(network.parameters()), "lr": LR}],
        lr=LR,
        eps=1e-6,
        weight_decay=WD,
        trainable=tr,
        max_grad_norm=clip,
        delay=delay,
    )
    losses, saved = [], []
    for step, x in enumerate(model_batches()[:steps]):
        opt.zero_grad()
        loss = model_loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if (step + 1) % save_every == 0:
            opt.flush()
            saved.append([p.detach().clone() for p in network.parameters()])
    tr.close()
    return losses, saved


@pytest.mark.parametrize(
    ("dtype", "setting", "want"),
    [
        (torch.float32, None, "fp32"),
        (torch.bfloat16, None, "none"),
        (torch.bfloat16, "fp32", "fp32"),
        (torch.float32, "none", "none"),
    ],
)
def test_the_fp32_master_follows_the_network_dtype_unless_set(dtype, setting, want):
    """Unset, ``trainable_master`` is ``none`` for a bf16 network (ai-toolkit's optimizer keeps
    no fp32 copy of it), ``fp32`` otherwise; an fp32 weight is its own master either way."""
    network = Network(Model().to(DTYPE).requires_grad_(False))
    network.force_to("cpu", dtype)
    network.apply_to()
    network.requires_grad_(True)
    settings = Settings(trainable="host", trainable_master=setting)
    opt = aitk_trainable.host_optimizer(
        list(network.parameters()), "adamw8bit", LR, None, network=network,
        max_grad_norm=None, settings=settings,
    )  # fmt: skip
    try:
        assert opt.master == opt.trainable.master == want
        kept = [s.master is not s.working for s in opt.trainable.slots]
        assert kept == [want == "fp32" and dtype == torch.bfloat16] * len(kept)
    finally:
        aitk_trainable.release(opt.trainable)


@pytest.mark.parametrize("delay", [True, False])
def test_training_through_the_launcher_equals_host_adamw_used_directly(aitk, tmp_path, delay):
    aitk(trainable="host", trainable_delay=delay)
    process = new_process(tmp_path)
    process.run()
    losses, saved = direct(delay=delay)
    assert process.load_errors == []
    for step, (a, b) in enumerate(zip(losses, process.losses, strict=True)):
        assert torch.equal(a, b), f"loss differs at step {step}"
    assert [s for s, _ in process.saved] == [2, None]
    for (step, got), want in zip(process.saved, saved, strict=True):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"LoRA weight {i} differs at the save of step {step}"
    assert all(torch.equal(a, b) for a, b in zip(saved[-1], lora_of(process), strict=True))


def test_each_group_is_clipped_on_its_own_as_ai_toolkit_clips_it(aitk, tmp_path):
    """Block-wise rates give one group per LoRA module; ai-toolkit clips each group to
    max_grad_norm by itself. The reference trains the LoRA in place with that clipping and
    the formula HostAdamW's adamw applies (``reference_adamw``)."""

    def block_lr(root):
        network = Network(root)
        network.block_lr = True
        return network

    aitk(trainable="host", trainable_delay=False)
    process = new_process(tmp_path, make_network=block_lr)
    process.run()

    model = Model().to(DTYPE).requires_grad_(False)
    network = block_lr(model)
    network.force_to("cpu", torch.float32)
    network.apply_to()
    groups = network.prepare_optimizer_params(LR)
    ref = reference_adamw(groups, lr=LR, eps=1e-6, weight_decay=WD)
    for x in model_batches()[:4]:
        model_loss(model, x).backward()
        norms = [torch.nn.utils.clip_grad_norm_(g["params"], MAX_NORM) for g in groups]
        ref.step()
        ref.zero_grad()
    assert len(groups) == 6 and max(norms) > MAX_NORM, "clipping changed the gradients"
    for i, (a, b) in enumerate(zip(network.parameters(), lora_of(process), strict=True)):
        assert torch.equal(a.detach(), b), f"LoRA weight {i} differs"


def test_resuming_from_the_saved_lora_and_optimizer_pt_continues_exactly(aitk, tmp_path):
    """The LoRA is saved in float16 (ai-toolkit's default save dtype); optimizer.pt holds the
    fp32 masters and the moments, so the resumed run continues the same trajectory."""
    aitk(trainable="host")
    whole = new_process(tmp_path / "whole", train_config(steps=6), save_every=3)
    whole.run()
    first = new_process(tmp_path / "parts", train_config(steps=3), save_every=3)
    first.run()
    second = new_process(tmp_path / "parts", train_config(steps=6, start_step=3), save_every=3)
    second.run()
    assert second.load_errors == []
    assert all(torch.equal(a, b) for a, b in zip(whole.losses[3:], second.losses, strict=True))
    for i, (a, b) in enumerate(zip(lora_of(whole), lora_of(second), strict=True)):
        assert torch.equal(a, b), f"LoRA weight {i} differs after resuming"


def test_an_optimizer_pt_of_another_optimizer_is_refused_and_training_goes_on(aitk, tmp_path):
    aitk()
    new_process(tmp_path, train_config(steps=2)).run()  # torch's AdamW state in optimizer.pt
    aitk(trainable="host")
    process = new_process(tmp_path, train_config(steps=3, start_step=2))
    process.run()
    assert process.load_errors == ["the state dict is of a None optimizer, this one is 'adamw'"]
    assert len(process.losses) == 1


# --- against the daemon: the transformer streamed, the LoRA in its session's host memory ----


class Region:
    """Stands for ``weightstream.regions.StateRegion`` (``Session.alloc_state_region``)."""

    def __init__(self, nbytes: int, label: str):
        self.buffer, self.label, self.closed = bytearray(nbytes), label, False

    def close(self):
        self.closed = True


def test_the_lora_of_a_streamed_transformer_trains_in_its_sessions_host_memory(
    daemon, aitk, tmp_path, monkeypatch
):
    """FLUX.1's transformer attached (streamed from the daemon's host backend), the LoRA's
    weights and AdamW state in regions of its session: training equals the same job with the
    transformer unattached and the LoRA in the trainer's memory, bit for bit."""
    from toolkit.memory_management import MemoryManager

    aitk(trainable="host", socket=daemon.socket, vram_budget=1 << 20, staging_bytes=1 << 20)
    g = torch.Generator().manual_seed(9)
    batches = [
        (torch.randn(1, 8, 32, generator=g).to(DTYPE), torch.randn(1, 16, generator=g).to(DTYPE))
        for _ in range(3)
    ]

    def loss_of(model, batch):
        embeds, pooled = batch
        out = model(**transformer_inputs("flux", 0, embeds, pooled)).sample
        return out.float().pow(2).mean()

    config = train_config(steps=3)
    ref = new_process(
        tmp_path / "ref", config, make_transformer("flux").to(DTYPE), loss_of, batches
    )
    ref.run()

    transformer = make_transformer("flux").to(DTYPE)
    manager = MemoryManager.attach(transformer, "cpu")
    regions = []

    def alloc_state_region(nbytes, label=""):
        regions.append(Region(nbytes, label))
        return regions[-1]

    monkeypatch.setattr(
        manager.handle.session, "alloc_state_region", alloc_state_region, raising=False
    )
    seen = {}
    from jobs.process import BaseSDTrainProcess as cls

    sample = cls.sample

    def spy(self, step=None):
        tr = self.optimizer.optimizer.trainable
        seen.update(groups=list(tr.groups), session=tr.storage.session)
        return sample(self, step)

    monkeypatch.setattr(cls, "sample", spy)
    got = new_process(tmp_path / "got", config, transformer, loss_of, batches)
    got.run()
    assert seen["session"] is manager.handle.session
    assert [(r.label, r.closed) for r in regions] == [
        ("trainable weights and gradients", True),
        ("adamw state", True),
    ], "allocated from the session, freed when run ended"
    assert seen["groups"] == [
        "model:transformer_blocks.0",
        "model:single_transformer_blocks.0",
    ], "the LoRA's weights travel with the blocks of the layers they wrap"
    assert manager.handle.stats()["acquires"] > 0
    for step, (a, b) in enumerate(zip(ref.losses, got.losses, strict=True)):
        assert torch.equal(a, b), f"loss differs at step {step}"
    for i, (a, b) in enumerate(zip(lora_of(ref), lora_of(got), strict=True)):
        assert torch.equal(a, b), f"LoRA weight {i} differs"
    MemoryManager.free(transformer)


def test_the_trainer_module_without_get_optimizer_is_an_error_under_trainable_host(tmp_path, aitk):
    (Path(sys.path[0]) / "jobs" / "process" / "BaseSDTrainProcess.py").write_text(
        "class BaseSDTrainProcess: ...\n"
    )
    aitk()
    import jobs.process  # noqa: F401 - trainable: device: left as it is

    del sys.modules["jobs.process.BaseSDTrainProcess"], sys.modules["jobs.process"]
    aitk(trainable="host")
    with pytest.raises(ImportError, match="jobs.process.BaseSDTrainProcess has no get_optimizer"):
        import jobs.process  # noqa: F401, F811


def test_adamw8bit_runs_as_host_adamws_8bit_kind_where_this_weightstream_has_it(aitk, tmp_path):
    import importlib.util

    aitk(trainable="host")
    process = new_process(tmp_path, train_config(optimizer="adamw8bit", steps=1))
    if importlib.util.find_spec("weightstream.torch.host.adamw8") is None:
        with pytest.raises(TrainableError) as e:
            process.run()
        assert str(e.value) == (
            "train.optimizer: 'adamw8bit' runs as HostAdamW's adamw8bit, which this "
            "weightstream lacks (weightstream.torch.host.adamw8): use adamw"
        )
        assert not any("_apply" in vars(m) for m in process.network.modules())
    else:
        process.run()
        assert process.optimizer.optimizer.kind == "adamw8bit"
        assert len(process.losses) == 1


def test_a_job_in_several_processes_is_refused_before_anything_moves(aitk, tmp_path):
    aitk(trainable="host")
    process = new_process(tmp_path)
    process.accelerator = SimpleNamespace(num_processes=2)
    with pytest.raises(TrainableError) as e:
        process.run()
    assert str(e.value) == (
        "weightstream's trainable: host trains in one process, and this job runs in 2 "
        "(accelerate's num_processes): the gradients in host memory are not reduced across "
        "them; use trainable: device"
    )
    assert not any("_apply" in vars(m) for m in process.network.modules())


# --- ai-toolkit's save -------------------------------------------------------------------------


def test_the_save_warning_says_what_ai_toolkits_save_needs_and_what_to_do():
    warn = aitk_trainable.save_room_warning
    # Rank 1024 of FLUX.2's 24.9 B architecture: 4.84 B fp32 parameters, 19.4 GB a copy.
    assert warn(4_840_000_000, torch.float32, 30_000_000_000) == (
        "weightstream-aitk: warning: ai-toolkit's save of this LoRA needs about 38.7 GB more "
        "host memory (its copy of the 4.84 B parameters in float32, 19.4 GB, and that copy "
        "serialized again to hash it), and the host has 30.0 GB available now: the host's "
        "out-of-memory killer may end the job at its first save. Set save.dtype: bf16 (half of "
        "it), train a lower rank, or free host memory."
    )
    assert warn(4_840_000_000, torch.bfloat16, 19_000_000_000).endswith(
        "may end the job at its first save. Train a lower rank or free host memory."
    )
    assert warn(4_840_000_000, torch.bfloat16, 19_360_000_000) is None  # exactly enough
    assert warn(4_840_000_000, torch.float32, None) is None
    assert warn(4_840_000_000, None, 1) is None


def test_the_launcher_warns_at_get_optimizer_when_the_save_would_not_fit(
    aitk, tmp_path, capsys, monkeypatch
):
    aitk(trainable="host")
    process = new_process(tmp_path, train_config(steps=1))
    process.save_config = SimpleNamespace(dtype=torch.float32)
    numel = sum(p.numel() for p in Network(Model()).parameters() if p.requires_grad)
    monkeypatch.setattr(aitk_trainable, "_host_available", lambda: 8 * numel - 1)
    process.run()
    out = capsys.readouterr().out
    assert f"needs about {8 * numel / 1e9:.1f} GB more host memory" in out, out
    monkeypatch.setattr(aitk_trainable, "_host_available", lambda: 8 * numel)
    process = new_process(tmp_path / "again", train_config(steps=1))
    process.save_config = SimpleNamespace(dtype=torch.float32)
    process.run()
    assert "warning" not in capsys.readouterr().out
