"""weightstream-aitk's ``sample_vram_budget``: ai-toolkit's ``sample`` runs inside each attached
session's ``Handle.sampling()``, the session grown for it and given back; read from the
``weightstream:`` section and ``WEIGHTSTREAM_SAMPLE_BUDGET``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from weightstream.integrations.ai_toolkit.settings import Settings

from tests.python.ai_toolkit.test_ai_toolkit_trainable import (  # noqa: F401 - aitk: a fixture
    DIM,
    DTYPE,
    Block,
    Model,
    aitk,
    lora_of,
    model_loss,
    new_process,
    train_config,
)

#: One of Model's blocks (two 32×32 Linear layers in bf16, each aligned to 256 bytes).
BLOCK = 2 * (2048 + 256)


@pytest.mark.parametrize("budget", [None, 6 * BLOCK])
def test_ai_toolkits_sample_runs_at_the_sampling_budget(daemon, aitk, tmp_path, budget, capsys):  # noqa: F811
    from toolkit.memory_management import MemoryManager

    aitk(
        socket=daemon.socket,
        min_bytes=0,
        vram_budget=3 * BLOCK,
        staging_bytes=3 * BLOCK,
        sample_vram_budget=budget,
    )
    ref = new_process(tmp_path / "ref", train_config(steps=2))
    ref.run()

    model = Model().to(DTYPE)
    manager = MemoryManager.attach(model, "cpu")
    assert [g.nbytes for g in manager.handle.session.groups] == [BLOCK] * 3
    budgets = []

    def loss_of(m, x):
        if not torch.is_grad_enabled():  # ai-toolkit's sample
            budgets.append(manager.handle.vram_budget)
        return model_loss(m, x)

    capsys.readouterr()
    got = new_process(tmp_path / "got", train_config(steps=2), model, loss_of)
    got.run()
    assert budgets == [budget or 3 * BLOCK]
    # One line for the sample: its one pass over the model's three blocks, streamed at the
    # training budget (three blocks' staging), or at the sampling one with all three resident
    # (no streamed group: no pass counted).
    lines = [x for x in capsys.readouterr().out.splitlines() if "sampled in" in x]
    streamed = "1 pass, 3/3" if budget is None else "0 passes, 0/0"
    assert [re.sub(r"[0-9.]+ s\b", "T s", x) for x in lines] == [
        f"weightstream-aitk: sampled in T s: Model {streamed} acquires in flight, GPU waited "
        f"T s, at {budget or 3 * BLOCK} bytes"
    ]
    assert manager.handle.vram_budget == 3 * BLOCK, "given back after sample"
    assert torch.equal(ref.samples[0], got.samples[0])
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, got.losses, strict=True))
    MemoryManager.free(model)


@pytest.mark.parametrize("budget", [None, 6 * BLOCK])
@pytest.mark.parametrize("dequantize", ["layer", "group"])
def test_a_sample_before_the_first_training_step_leaves_training_as_it_is(
    daemon,
    aitk,  # noqa: F811
    tmp_path,
    dequantize,
    budget,
):
    """ai-toolkit's baseline sample (``skip_first_sample: false``) runs before any training
    step: no plan yet, every group fetched on demand under no_grad, then the first training
    step records the plan. As weightstream-aitk streams ai-toolkit's ``qfloat8`` (the daemon's
    8-bit format), the sample and every loss equal those of the 8-bit model in memory
    (``to_fp8_resident``), and the losses and the LoRA equal those of the same job without the
    baseline sample: the sample leaves training as it is, at the training budget or grown to
    a sampling budget and back."""
    from toolkit.memory_management import MemoryManager
    from weightstream import quantize

    aitk(
        socket=daemon.socket,
        min_bytes=0,
        vram_budget=3 * BLOCK,
        staging_bytes=3 * BLOCK,
        quantize="fp8",
        dequantize=dequantize,
        sample_vram_budget=budget,
    )
    first = train_config(steps=3, skip_first_sample=False)
    resident = Model().to(DTYPE)
    assert len(quantize.to_fp8_resident(resident, lambda _, m: isinstance(m, nn.Linear))) == 6
    ref = new_process(tmp_path / "ref", first, resident)
    ref.run()

    def streamed(folder, config):
        model = Model().to(DTYPE)
        manager = MemoryManager.attach(model, "cpu")
        assert len(manager.handle.streamed) == 6
        process = new_process(tmp_path / folder, config, model)
        process.run()
        MemoryManager.free(model)
        return process

    got = streamed("got", first)
    unsampled = streamed("unsampled", train_config(steps=3))
    for other in (ref, unsampled):
        assert all(torch.equal(a, b) for a, b in zip(other.losses, got.losses, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(lora_of(other), lora_of(got), strict=True))
    assert len(got.samples) == 2, "the baseline sample and the one at the end"
    assert all(torch.equal(a, b) for a, b in zip(ref.samples, got.samples, strict=True))
    assert torch.equal(unsampled.samples[0], got.samples[1])


def test_the_setting_reads_sizes_from_the_section_and_the_environment():
    assert Settings.load({}, env={}).sample_vram_budget is None
    assert Settings.load({"sample_vram_budget": "2GiB"}, env={}).sample_vram_budget == 2 << 30
    env = {"WEIGHTSTREAM_SAMPLE_BUDGET": "20GB"}
    assert Settings.load({"sample_vram_budget": "none"}, env=env).sample_vram_budget == 20 * 10**9
    assert Settings.load({"sample_vram_budget": "none"}, env={}).sample_vram_budget == "none"
    assert Settings.load({"sample_vram_budget": "Auto"}, env={}).sample_vram_budget == "auto"
    env = {"WEIGHTSTREAM_SAMPLE_BUDGET": "auto"}
    assert Settings.load({}, env=env).sample_vram_budget == "auto"
    with pytest.raises(ValueError) as raised:
        Settings.load({"sample_vram_budget": "lots"}, env={})
    assert str(raised.value) == (
        "weightstream.sample_vram_budget: 'lots' is not a size (bytes, or a number with B, KiB, "
        "MiB, GiB, TiB, KB, MB, GB or TB)"
    )


def test_the_setting_is_refused_with_trainable_host():
    with pytest.raises(ValueError) as raised:
        Settings.load({"sample_vram_budget": "2GiB", "trainable": "host"}, env={})
    assert str(raised.value) == (
        "weightstream.sample_vram_budget with trainable: host: the LoRA's state lives in the "
        "session's host memory, which reopening the session for sampling would drop; leave "
        "sample_vram_budget unset"
    )


class TextEncoder(nn.Module):
    """A stand-in text encoder: blocks, a head registered before the projection a forward
    calls last, and never called while encoding (a causal LM's ``lm_head``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.lm_head = nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.proj(x)


def test_a_managed_text_encoder_follows_its_forward_plan(daemon, aitk, tmp_path):  # noqa: F811
    """Embeddings not cached: ai-toolkit encodes each batch's prompt under no_grad, in training
    steps and in samples alike. The text encoder's session follows its own forward plan while
    the transformer trains on its own: every acquire after the encoder's first pass is a hit,
    and the daemon counts the encoder's work as sampling."""
    from toolkit.memory_management import MemoryManager

    aitk(socket=daemon.socket, min_bytes=0, vram_budget=3 * BLOCK, staging_bytes=3 * BLOCK)
    te_ref, te = TextEncoder().to(DTYPE), TextEncoder().to(DTYPE)
    handle = MemoryManager.attach(te, "cpu").handle
    te.requires_grad_(False)
    assert len(handle.session.groups) == 6
    encoded, counts = [], []

    def encode_then(encoder, h=None):
        def loss_of(m, x):
            if h is not None:
                s = h.stats()
                counts.append((s["sample_acquires"], s["sample_hits"]))
            with torch.no_grad():
                x = encoder(x)
            encoded.append(x)
            return model_loss(m, x)

        return loss_of

    ref = new_process(tmp_path / "ref", train_config(steps=3), loss_of=encode_then(te_ref))
    ref.run()
    model = Model().to(DTYPE)
    manager = MemoryManager.attach(model, "cpu")
    got = new_process(tmp_path / "got", train_config(steps=3), model, encode_then(te, handle))
    got.run()
    # Three training steps and one sample: four passes of the encoder, outputs equal.
    assert len(encoded) == 8
    assert all(torch.equal(a, b) for a, b in zip(encoded[:4], encoded[4:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, got.losses, strict=True))
    s = handle.stats()
    counts.append((s["sample_acquires"], s["sample_hits"]))
    per_pass = [(a1 - a0, h1 - h0) for (a0, h0), (a1, h1) in zip(counts, counts[1:], strict=False)]
    # The first pass follows the module order, whose lm_head it never calls: the first
    # acquire and the projection after lm_head are fetched on demand. Then its own plan.
    assert per_pass == [(5, 3), (5, 5), (5, 5), (5, 5)]
    assert (s["sample_passes"], s["forward_plan_length"], s["train_acquires"]) == (4, 5, 0)
    train, sample = s["kinds"]["train"], s["kinds"]["sample"]
    assert list(s["kinds"]) == ["train", "sample"]
    assert (train["acquires"], train["bytes_copied"]) == (0, 0)
    assert sample["acquires"] == handle.session.submitted
    assert manager.handle.stats()["train_acquires"] > 0
    MemoryManager.free(model)
    MemoryManager.free(te)


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({}, "auto"),  # vram_budget auto (ai-toolkit offloads every layer): auto
        ({"sample_vram_budget": "none"}, None),
        ({"sample_vram_budget": 6 * BLOCK}, 6 * BLOCK),
        ({"vram_budget": 3 * BLOCK}, None),  # a budget the job chose: none unless set
        ({"trainable": "host"}, None),  # the LoRA's state in the session: never reopened
    ],
)
def test_the_sampling_budget_is_auto_where_the_session_is(daemon, aitk, settings, want):  # noqa: F811
    from toolkit.memory_management import MemoryManager

    aitk(socket=daemon.socket, min_bytes=0, **settings)
    model = Model().to(DTYPE)
    manager = MemoryManager.attach(model, "cpu")
    assert manager.handle.options.sample_vram_budget == want
    MemoryManager.free(model)


def test_an_auto_sampling_budget_grows_the_largest_session_only(daemon, aitk, tmp_path):  # noqa: F811
    """With ``auto``, ai-toolkit's sample grows only the session that streams the most bytes
    (here the text encoder's six groups, not the model's three); both are back at their
    training budgets for the next step."""
    from toolkit.memory_management import MemoryManager

    aitk(
        socket=daemon.socket,
        min_bytes=0,
        vram_budget=3 * BLOCK,
        staging_bytes=3 * BLOCK,
        sample_vram_budget="auto",
    )
    te = TextEncoder().to(DTYPE)
    te_handle = MemoryManager.attach(te, "cpu").handle
    te.requires_grad_(False)
    model = Model().to(DTYPE)
    handle = MemoryManager.attach(model, "cpu").handle
    assert (len(te_handle.session.groups), len(handle.session.groups)) == (6, 3)
    budgets = []

    def loss_of(m, x):
        if not torch.is_grad_enabled():
            budgets.append((te_handle.vram_budget, handle.vram_budget))
        with torch.no_grad():
            x = te(x)
        return model_loss(m, x)

    new_process(tmp_path / "got", train_config(steps=2), model, loss_of).run()
    [(te_budget, model_budget)] = budgets
    assert te_budget > 3 * BLOCK and model_budget == 3 * BLOCK
    assert (te_handle.vram_budget, handle.vram_budget) == (3 * BLOCK, 3 * BLOCK)
    MemoryManager.free(model)
    MemoryManager.free(te)
