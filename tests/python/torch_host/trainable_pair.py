"""The test model and the reference of tests/python/torch_host: a few blocks of LoRA'd linear
layers, batches, the LoRA trained in place with the documented optimizer formula on the CPU
(``Reference``), and ``train_pair``, which trains it beside the same model under
``stream_trainable`` + ``HostAdamW`` asserting equal losses. Also imported by
tests/gpu/torch_suite.py (on CUDA) and by the trainer that test_trainable_memory.py kills."""

from __future__ import annotations

import torch
import weightstream.torch as wst
from torch import nn
from torch.utils.checkpoint import checkpoint
from weightstream.torch.host import HostAdamW, reference_adamw, stream_trainable

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


def step_both(ref_model, model, ref, opt, x):
    """One step of ``train_pair``'s two models on ``x`` (one micro-batch), asserting equal
    losses."""
    backward_both(ref_model, model, x)
    ref.after_first_backward()
    ref.step()
    opt.step()
