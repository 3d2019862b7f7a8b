"""Probe of the FLUX equality finding (see tests/bench/results/flux_train.md): two-block FLUX
transformers, small and at full width (4096 image + 512 text tokens), resident against
weightstream with either input-gradient path, in deterministic mode. Run on the GPU machine:
    PYTHONPATH=$PWD/client-py/src:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 \\
        python3 tests/bench/flux_equality_probe.py
"""

import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, "tests/bench")
import flux_train as ft
import weightstream
import weightstream.torch as wst
from diffusers import FluxTransformer2DModel

torch.backends.cuda.enable_cudnn_sdp(False)
tmp = tempfile.mkdtemp()
sock = f"{tmp}/ws.sock"
d = subprocess.Popen(
    ["target/release/weightstream", "serve", "--backend", "cuda", "--socket", sock],
    stderr=subprocess.DEVNULL,
)
while not os.path.exists(sock):
    time.sleep(0.05)
client = weightstream.connect(sock)


def build(big):
    torch.manual_seed(0)
    with torch.device("cuda"):
        if big:
            m = FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,
                num_layers=2,
                num_single_layers=2,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
            )
        else:
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
    return ft.add_lora(m)


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


torch.use_deterministic_algorithms(True)
for big in (False, True):
    ref = build(big)
    lr, gr = run(ref, big)
    lr2, _ = run(build(big), big)
    print("big" if big else "small", "resident twice equal:", lr == lr2)
    for mode in ("formula", "recompute"):
        wst.INPUT_GRAD = mode
        s = build(big).cpu()
        h = wst.attach(s, "cuda", client=client, min_bytes=0, vram_budget=1 << 30)
        ls, gs = run(s, big)
        bad = [k for k in gr[0] if not torch.equal(gr[0][k], gs[0][k])]
        print(" ", mode, "losses equal:", lr == ls, "first differing grad:", bad[:2], len(bad))
        h.detach(release=True)
d.terminate()
