"""``weightstream.examples.generate`` on the host backend, with a stand-in for a diffusers
pipeline (a denoising loop over a transformer of 8 blocks, and a decoder): the streamed
pipeline's image equals the one of the pipeline in memory, and after the first denoising step
every acquire is a hit."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from weightstream.examples import generate

from tests.python.torch.test_sampling import BLOCK_BYTES, DIM, Net

#: A block of ``Net`` with its LoRA layer frozen too (64×64 f32): it streams with the block.
BLOCK = BLOCK_BYTES + DIM * DIM * 4


class StandInPipeline:
    """A diffusers pipeline's calling convention and ``components``, reduced."""

    def __init__(self):
        torch.manual_seed(0)
        self.transformer = Net().requires_grad_(False)
        self.vae = nn.Linear(DIM, 3)

    @property
    def components(self):
        return {"transformer": self.transformer, "vae": self.vae, "scheduler": object()}

    def __call__(self, prompt, num_inference_steps, height, width, generator):
        latents = torch.randn(height * width // 64, DIM, generator=generator)
        for _ in range(num_inference_steps):
            latents = latents - 0.1 * self.transformer(latents)
        return SimpleNamespace(images=[self.vae(latents)])


def stand_in(model, dtype):
    """``--pipeline`` for ``generate``'s command line: the stand-in, whatever ``model``."""
    return StandInPipeline()


def test_a_streamed_pipeline_generates_the_same_image(daemon):
    ref, pipe = StandInPipeline(), StandInPipeline()
    handles = generate.stream_components(
        pipe, None, "cpu", vram_budget=3 * BLOCK, client=daemon.client, min_bytes=0
    )
    assert list(handles) == ["transformer"]
    want = generate.generate(ref, {}, "a prompt", 6, 64, seed=3)
    got = generate.generate(pipe, handles, "a prompt", 6, 64, seed=3)
    assert torch.equal(got, want)
    s = handles["transformer"].stats()
    assert (s["sample_passes"], s["sample_acquires"], s["sample_hits"]) == (6, 48, 47)
    handles["transformer"].detach(release=True)


def sixteen_blocks() -> StandInPipeline:
    pipe = StandInPipeline()
    torch.manual_seed(1)
    net = pipe.transformer
    net.blocks.extend(type(net.blocks[0])() for _ in range(8))
    net.order = list(range(16))
    net.requires_grad_(False)
    return pipe


def test_a_streamed_denoiser_stages_three_blocks_and_keeps_the_rest_resident(daemon):
    """16 blocks at a budget of 14: the daemon's default for training stages a quarter (3.5
    blocks: 10 resident); forward-only passes stage three (the sampling staging), so 11 stay
    resident and 5 stream a step; the image the same."""
    ref, pipe = sixteen_blocks(), sixteen_blocks()
    handles = generate.stream_components(
        pipe, None, "cpu", vram_budget=14 * BLOCK, client=daemon.client, min_bytes=0
    )
    handle = handles["transformer"]
    assert handle.session.opened.staging_bytes == 3 * BLOCK
    assert [g.resident for g in handle.session.groups].count(True) == 11
    want = generate.generate(ref, {}, "a prompt", 6, 64, seed=3)
    got = generate.generate(pipe, handles, "a prompt", 6, 64, seed=3)
    assert torch.equal(got, want)
    s = handle.stats()
    assert (s["sample_passes"], s["sample_acquires"], s["sample_hits"]) == (6, 30, 29)
    handle.detach(release=True)


def test_a_component_the_pipeline_lacks_is_named(daemon):
    with pytest.raises(ValueError) as raised:
        generate.stream_components(StandInPipeline(), ["unet"], "cpu", client=daemon.client)
    assert str(raised.value) == "--stream unet: the pipeline has ['transformer', 'vae']"


def test_a_model_given_twice_or_for_a_component_that_does_not_stream_is_named(daemon):
    pipe, c = StandInPipeline(), daemon.client
    with pytest.raises(ValueError) as raised:
        generate.stream_components(pipe, None, "cpu", client=c, model_ids={"vae": "u-0"})
    assert str(raised.value) == "--model-id for vae, which does not stream: ['transformer']"
    files, ids = {"transformer": ["t"]}, {"transformer": "u-0"}
    with pytest.raises(ValueError) as raised:
        generate.stream_components(pipe, None, "cpu", client=c, model_files=files, model_ids=ids)
    assert str(raised.value) == "--model-file and --model-id both given for transformer: one"


@pytest.mark.no_daemon
def test_without_diffusers_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(SystemExit) as raised:
        generate.load_pipeline("some/model", torch.bfloat16)
    assert str(raised.value) == (
        "weightstream.examples.generate needs diffusers: pip install diffusers"
    )


@pytest.mark.no_daemon
def test_the_command_line_takes_sizes():
    args = generate.parse_args(["--model", "m", "--prompt", "p", "--vram-budget", "15GiB"])
    assert (args.steps, args.size, args.device, args.vram_budget) == (28, 1024, "cuda", "15GiB")
