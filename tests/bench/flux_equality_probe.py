"""Probe of the FLUX equality finding (see tests/bench/results/flux_train.md): two-block FLUX
transformers, small and at full width (4096 image + 512 text tokens), resident against
weightstream (layer and block groups, either input-gradient path) in deterministic mode, with
every streamed weight read checked against the module's own weight on the device. Exits 1
unless all losses are equal and no read saw wrong bytes. Run on the GPU machine:
    PYTHONPATH=$PWD/client-py/src:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 \\
        python3 -m tests.bench.flux_equality_probe
"""

import sys
import tempfile

import torch
import weightstream.torch as wst
from diffusers import FluxTransformer2DModel
from weightstream.torch import ops

from tests.bench.benchlib import flux
from tests.daemon import Daemon

torch.backends.cuda.enable_cudnn_sdp(False)
d = Daemon(
    tempfile.mkdtemp(),
    binary="target/release/weightstream",
    backend="cuda",
    log_level=None,
    ready_s=60,
)
client = d.client


def build(big):
    if big:
        return flux.add_lora(flux.build(num_layers=2, num_single_layers=2))
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(8, 12, 12),
        )
    m = m.to(torch.bfloat16)
    m.requires_grad_(False)
    return flux.add_lora(m)


def batch(big):
    g = torch.Generator(device="cuda").manual_seed(2)
    bf = torch.bfloat16
    dv = "cuda"
    n, t, c, j, p = (4096, 512, 64, 4096, 768) if big else (64, 16, 16, 64, 32)
    return dict(
        hidden_states=torch.randn(1, n, c, generator=g, dtype=bf, device=dv),
        encoder_hidden_states=torch.randn(1, t, j, generator=g, dtype=bf, device=dv),
        pooled_projections=torch.randn(1, p, generator=g, dtype=bf, device=dv),
        timestep=torch.tensor([0.5], dtype=bf, device=dv),
        img_ids=torch.zeros(n, 3, dtype=bf, device=dv),
        txt_ids=torch.zeros(t, 3, dtype=bf, device=dv),
        guidance=torch.tensor([3.5], dtype=bf, device=dv),
    )


def run(m, big, n=3):
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = batch(big)
    losses = []
    grads = []
    for _ in range(n):
        out = m(**x, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        loss.backward()
        grads.append({n_: p.grad.clone() for n_, p in m.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def with_read_check(model):
    """Records, for every streamed weight read, whether the bytes read equal the module's own
    weight (a copy kept on the device): a check on the GPU, queued before the read, no sync."""
    ref = {
        id(m): (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
    }
    names = {id(m): n for n, m in model.named_modules()}
    flags = []

    def check(module, weight, bias):
        w, b = ref[id(module)]
        bad = (weight != w).any()
        if bias is not None:
            bad = bad | (bias != b).any()
        flags.append((names[id(module)], bad))

    op, grad = ops.op, ops.input_grad

    def checked_op(module, x, weight, bias):
        check(module, weight, bias)
        return op(module, x, weight, bias)

    def checked_grad(module, x, grad_out, weight, *rest):
        check(module, weight, None)
        return grad(module, x, grad_out, weight, *rest)

    ops.op, ops.input_grad = checked_op, checked_grad

    def report():
        ops.op, ops.input_grad = op, grad
        bad = [n for n, f in flags if bool(f)]
        return len(flags), bad

    return report


def variant(big, name, ref_losses, ref_grads, group_by="layer", check=False, mode="formula"):
    torch.cuda.synchronize()
    m = build(big)
    report = with_read_check(m) if check else None
    m = m.cpu()
    # Layer by layer: 1 GiB; by block: staging for about two of the largest block.
    budget = (1 << 30) if group_by == "layer" else (3 << 29)
    staging = 0 if group_by == "layer" else (3 << 29)
    if not big:
        budget, staging = 1 << 30, 0
    h = wst.attach(
        m,
        "cuda",
        client=client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
        group_by=group_by,
        input_grad=mode,
    )
    ls, gs = run(m, big, STEPS)
    bad = [k for k in ref_grads[0] if not torch.equal(ref_grads[0][k], gs[0][k])]
    line = f"  {name}: losses equal: {ls == ref_losses} {ls} first-step grads differing: {len(bad)}"
    if report:
        reads, wrong = report()
        line += f"; reads checked {reads}, wrong {len(wrong)} {wrong[:4]}"
    stats = h.stats()
    line += f"; copies {stats['copies']}, acquires {stats['acquires']}"
    print(line, flush=True)
    h.detach(release=True)
    return ls == ref_losses and (not report or not wrong)


STEPS = 4
torch.use_deterministic_algorithms(True)
ok = True
for big in (True,) if "--big-only" in sys.argv else (False, True):
    ref = build(big)
    lr, gr = run(ref, big, STEPS)
    lr2, _ = run(build(big), big, STEPS)
    print("big" if big else "small", "resident twice equal:", lr == lr2, lr, flush=True)
    del ref
    for group_by in ("layer", "block"):
        for mode in ("formula", "recompute"):
            name = f"{group_by}, {mode}, reads checked"
            ok &= variant(big, name, lr, gr, group_by, check=True, mode=mode)
d.stop(timeout=30)
print("all equal:", ok)
sys.exit(0 if ok else 1)
