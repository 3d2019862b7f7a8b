"""Models the daemon holds coded (``coding="rans8"``) against its host backend: the manifest's
coded tensors, the bytes a session copies, and the tensors a session hands out, equal
(torch.equal) to those of the same model held as it is; uploads and loads alike; a coding the
client does not know refused by name."""

from __future__ import annotations

import pytest
import torch
import weightstream.torch as wst
from safetensors.torch import save_file
from torch import nn
from weightstream import quantize

MiB = 1 << 20


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)


def weights() -> dict[str, torch.Tensor]:
    """Two weights whose fp8 form (1 MiB of data and its scales) is coded, and a small one
    and a bias that are not."""
    return {
        "a.weight": gaussian(1024, 1024, 0),
        "b.weight": gaussian(1024, 1152, 1),
        "c.weight": gaussian(64, 64, 2),
        "a.bias": gaussian(1, 1024, 3).reshape(-1),
    }


def staged(client, manifest) -> dict[str, torch.Tensor | quantize.Fp8Weight]:
    """Every tensor of ``manifest``'s model as a session hands it out (one group each), cloned,
    and the session's bytes copied and decoded."""
    names = [t.name for t in manifest.tensors]
    out = {}
    with client.open_session(
        manifest.model_id, [(n, [n]) for n in names], vram_budget=64 * MiB
    ) as s:
        for i, name in enumerate(names):
            ticket = s.acquire(i)
            (view,) = ticket.tensors
            if isinstance(view, quantize.Fp8Weight):
                out[name] = (view.data.clone(), view.scale.clone())
            else:
                out[name] = view.clone()
            s.release(ticket)
        stats = s.stats()
        return out, stats.bytes_copied, s.decoded_bytes


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if isinstance(w, tuple):
            assert torch.equal(g[0].view(torch.uint8), w[0].view(torch.uint8)), name
            assert torch.equal(g[1], w[1]), name
        else:
            assert torch.equal(g, w), name


def test_a_coded_load_hands_out_the_tensors_of_the_same_load_uncoded(daemon, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(weights(), str(path))
    plain = daemon.client.load_model([str(path)], quantize="fp8")
    coded = daemon.client.load_model([str(path)], quantize="fp8", coding="rans8")
    assert coded.model_id != plain.model_id
    by_name = {t.name: t for t in coded.tensors}
    plain_by_name = {t.name: t for t in plain.tensors}
    assert sorted(n for n, t in by_name.items() if t.coding == "rans8") == ["a.weight", "b.weight"]
    for name, t in by_name.items():
        p = plain_by_name[name]
        assert (t.nbytes, t.quantization, list(t.scale_shape), t.scale_offset) == (
            p.nbytes,
            p.quantization,
            list(p.scale_shape),
            p.scale_offset,
        ), name
        if t.coding == "none":
            assert (t.stored_nbytes, t.coded_lanes) == (0, 0), name
        else:
            # a lane per 512 bytes; coded, at most 31/32 of the bytes
            assert t.coded_lanes == t.nbytes // 512, name
            assert t.stored_nbytes <= t.nbytes - t.nbytes // 32, name
    saved = sum(t.nbytes - t.stored_nbytes for t in coded.tensors if t.coding == "rans8")
    assert coded.total_bytes == plain.total_bytes - saved
    formats = {f.format: f.bytes for f in coded.formats}
    assert "fp8_e4m3_block64+rans8" in formats and "fp8_e4m3_block64" in formats
    assert coded.phases.code_ns > 0 and plain.phases.code_ns == 0

    want, plain_copied, plain_decoded = staged(daemon.client, plain)
    got, coded_copied, decoded = staged(daemon.client, coded)
    assert_same(got, want)
    assert plain_decoded == 0
    assert decoded == sum(-(-t.nbytes // 256) * 256 for t in coded.tensors if t.coding == "rans8")
    align = daemon.client.info().alignment

    def copied(manifest):  # a group a tensor, each at the daemon's alignment
        return sum(-(-(t.stored_nbytes or t.nbytes) // align) * align for t in manifest.tensors)

    assert (plain_copied, coded_copied) == (copied(plain), copied(coded))
    assert coded_copied < plain_copied - saved + len(coded.tensors) * align


def test_an_upload_coded_at_commit_is_another_model_decoded_to_the_same_bytes(daemon):
    tensors = weights()
    names = ["a.weight", "b.weight", "c.weight"]
    plain, _ = daemon.client.upload_model("m", tensors, quantize=names)
    coded, dedup = daemon.client.upload_model("m", tensors, quantize=names, coding="rans8")
    assert not dedup and coded.model_id != plain.model_id
    again, dedup = daemon.client.upload_model("m", tensors, quantize=names, coding="rans8")
    assert dedup and again.model_id == coded.model_id
    assert sum(t.coding == "rans8" for t in coded.tensors) == 2
    got, _, _ = staged(daemon.client, coded)
    want, _, _ = staged(daemon.client, plain)
    assert_same(got, want)


def test_an_unknown_coding_is_refused_by_name(daemon, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(path))
    with pytest.raises(ValueError, match=r'coding: "zstd" is not supported: the accepted values'):
        daemon.client.load_model([str(path)], coding="zstd")
    with pytest.raises(ValueError, match=r"coding='zstd': expected 'none' or 'rans8'"):
        wst.StreamOptions(coding="zstd")


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(1024, 1024)
        self.b = nn.Linear(1024, 1024)
        self.lora = nn.Linear(1024, 4, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.lora(x).sum(-1, keepdim=True)


def coded_training(client, device: str) -> str:
    """Streamed in 8 bits and held coded, on ``device``: outputs and gradients equal the
    model with each streamed weight replaced by its w_hat, over the steps; the streamed
    weights were coded and decoded."""

    def run(model):
        opt = torch.optim.AdamW(model.lora.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(2):
            x = torch.randn(3, 1024, generator=g).to(device)
            out = model(x)
            out.pow(2).mean().backward()
            outs.append((out.detach().clone(), model.lora.weight.grad.clone()))
            opt.step()
            opt.zero_grad()
        return outs

    ref, streamed = Two(), Two()
    for m in (ref, streamed):
        for name, p in m.named_parameters():
            p.requires_grad = name.startswith("lora")
    handle = wst.attach(
        streamed,
        device,
        client=client,
        min_bytes=0,
        vram_budget=8 * MiB,
        group_by="layer",
        ignore={"lora"},
        quantize="fp8",
        coding="rans8",
    )
    placed = {t.name: t for g in handle.session.groups for t in g.tensors}
    assert placed["a.weight"].coding == placed["b.weight"].coding == "rans8"
    assert placed["a.bias"].coding == "none"
    quantize.to_fp8_resident(ref, handle.streamed)
    ref.to(device)
    steps = list(zip(run(ref), run(streamed), strict=True))
    for (o1, g1), (o2, g2) in steps:
        assert torch.equal(o1, o2) and torch.equal(g1, g2)
    decoded = handle.stats()["decoded_bytes"]
    assert decoded == handle.session.decoded_bytes > 0
    handle.detach(release=True)
    return f"{len(steps)} steps equal, {decoded} bytes decoded"


def test_attach_coded_trains_as_the_8bit_resident_reference(daemon):
    coded_training(daemon.client, "cpu")
