"""weightstream-aitk's ``sample_vram_budget``: ai-toolkit's ``sample`` runs inside each attached
session's ``Handle.sampling()``, the session grown for it and given back; read from the
``weightstream:`` section and ``WEIGHTSTREAM_SAMPLE_BUDGET``."""

from __future__ import annotations

import pytest
import torch
from weightstream.integrations.ai_toolkit.settings import Settings

from tests.python.ai_toolkit.test_ai_toolkit_trainable import (  # noqa: F401 - aitk: a fixture
    DTYPE,
    Model,
    aitk,
    model_loss,
    new_process,
    train_config,
)

#: One of Model's blocks (two 32×32 Linear layers in bf16, each aligned to 256 bytes).
BLOCK = 2 * (2048 + 256)


@pytest.mark.parametrize("budget", [None, 6 * BLOCK])
def test_ai_toolkits_sample_runs_at_the_sampling_budget(daemon, aitk, tmp_path, budget):  # noqa: F811
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

    got = new_process(tmp_path / "got", train_config(steps=2), model, loss_of)
    got.run()
    assert budgets == [budget or 3 * BLOCK]
    assert manager.handle.vram_budget == 3 * BLOCK, "given back after sample"
    assert torch.equal(ref.samples[0], got.samples[0])
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, got.losses, strict=True))
    MemoryManager.free(model)


def test_the_setting_reads_sizes_from_the_section_and_the_environment():
    assert Settings.load({}, env={}).sample_vram_budget is None
    assert Settings.load({"sample_vram_budget": "2GiB"}, env={}).sample_vram_budget == 2 << 30
    env = {"WEIGHTSTREAM_SAMPLE_BUDGET": "20GB"}
    assert Settings.load({"sample_vram_budget": "none"}, env=env).sample_vram_budget == 20 * 10**9
    assert Settings.load({"sample_vram_budget": "none"}, env={}).sample_vram_budget is None
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
