"""Several generation processes on one daemon (host backend): two ``python -m
weightstream.examples.generate`` processes attach the same stand-in denoiser, by uploading the
same tensors, by ``--model-file`` (the daemon reads the safetensors itself) or the second by
``--model-id`` (the model the first uploaded, no upload of its own), and generate
while both are attached: the daemon's host store holds one copy of the model, and each
process's image equals the pipeline's in memory (as a process alone computes it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from weightstream.examples import generate

from tests.daemon import Daemon
from tests.python.examples.test_generate import BLOCK, StandInPipeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
MIB = 1 << 20
STEPS, SIZE, SEED = 6, 64, 0


class Generator:
    """One generation process, held open once its image is written (``--hold``)."""

    @staticmethod
    def command(daemon, out, *extra) -> list[str]:
        return (
            [sys.executable, "-m", "weightstream.examples.generate", "--model", "stand-in"]
            + ["--prompt", "p", "--steps", str(STEPS), "--size", str(SIZE), "--seed", str(SEED)]
            + ["--device", "cpu", "--socket", daemon.socket, "--min-bytes", "0"]
            + ["--pipeline", "tests.python.examples.test_generate:stand_in"]
            + ["--vram-budget", str(3 * BLOCK), "--hold", "--out", str(out), *extra]
        )

    def __init__(self, daemon, out, *extra):
        self.out = out
        self.proc = subprocess.Popen(
            self.command(daemon, out, *extra),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("wrote "):
                return
        self.proc.wait(timeout=60)
        raise AssertionError(
            f"the generation failed: {''.join(self.lines)}{self.proc.stderr.read()}"
        )

    def finish(self) -> torch.Tensor:
        _, err = self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0, err
        return torch.load(self.out)


def store_bytes(daemon) -> int:
    return daemon.client.list_models().store_bytes


@pytest.mark.parametrize("source", ["upload", "model-file", "model-id"])
def test_two_generation_processes_share_one_host_copy(daemon, tmp_path, source):
    extra = []
    if source == "model-file":
        path = tmp_path / "transformer.safetensors"
        save_file(StandInPipeline().transformer.state_dict(), str(path))
        extra = ["--model-file", str(path)]
    first = Generator(daemon, tmp_path / "first.pt", *extra)
    one = store_bytes(daemon)
    assert one >= 8 * BLOCK, "the first process's model is in the store"
    if source == "model-id":
        extra = ["--model-id", first_model(daemon)]
    second = Generator(daemon, tmp_path / "second.pt", *extra)
    two = store_bytes(daemon)
    assert two < one + MIB, f"a second copy: {two - one} more bytes"
    assert [s.model_id for s in daemon.client.list_sessions()] == [first_model(daemon)] * 2
    assert "transformer: 6 passes, 48 acquires, hit rate 0.979" in "".join(second.lines)
    want = generate.generate(StandInPipeline(), {}, "p", STEPS, SIZE, SEED)
    assert torch.equal(first.finish(), want)
    assert torch.equal(second.finish(), want)


def first_model(daemon) -> str:
    models = daemon.client.list_models().models
    assert len(models) == 1, [m.model_id for m in models]
    return models[0].model_id


def test_a_second_upload_without_room_names_the_model_to_attach_by_id(tmp_path):
    """A host quota with room for one copy of the model and not two: the second process's
    upload is refused, and the error names the model the first holds and the --model-id that
    attaches it; with it the second process generates the same image."""
    config = tmp_path / "config.toml"
    config.write_text(f"[quotas]\nper_uid_host_bytes = {12 * BLOCK}\n")
    daemon = Daemon(tmp_path, "--config", str(config))
    try:
        first = Generator(daemon, tmp_path / "first.pt")
        model = first_model(daemon)
        cmd = Generator.command(daemon, tmp_path / "second.pt")
        refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1
        assert refused.stderr.endswith(
            f"the daemon already holds 'Net' as {model}: if it is these weights, run this "
            f"process with --model-id {model} to attach it without an upload of its own\n"
        ), refused.stderr
        second = Generator(daemon, tmp_path / "second.pt", "--model-id", model)
        want = generate.generate(StandInPipeline(), {}, "p", STEPS, SIZE, SEED)
        assert torch.equal(first.finish(), want)
        assert torch.equal(second.finish(), want)
    finally:
        daemon.stop()
