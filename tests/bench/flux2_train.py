"""Benchmark: LoRA training of FLUX.2-dev's transformer (diffusers' `Flux2Transformer2DModel`
default config, 32 B parameters, random bf16 weights) on the GPU machine: `flux_train.py` with
`--model flux2` (same modes, options and checks; results in $OUT/flux2_train.json).

The whole job held to 24 GiB (trainer + daemon + CUDA contexts as nvidia-smi sees them): the
trainer's share is `--trainer-gib`, the daemon's the rest of each `--budgets` entry, and every
budget also records `nvidia_smi_used_gib`:
    python3 -m tests.bench.flux2_train --bin target/release/weightstream --out $OUT \\
        --modes resident weightstream --budgets 24 16 --trainer-gib 7 --min-blocks 0
A PCIe Gen4 x16 link, emulated: add `--copy-bandwidth-limit 25GB/s`; 8 bits: `--quantize fp8`.
LoRA rank: `--rank R`; where its AdamW state outgrows `--trainer-gib`, `--optimizer adamw8bit`
(torchao's AdamW8bit; its wheel in .whl/, see tests/gpu/README.md).
ai-toolkit's MemoryManager at 100 % offload (its code in .aitk/, tests/bench/ai_toolkit_prepare.sh;
it pins ~94 GiB of host memory for FLUX.2's 60 GiB of weights): add `aitk` to `--modes`.
"""

from __future__ import annotations

import sys

from tests.bench.flux_train import main

if __name__ == "__main__":
    sys.exit(main(model="flux2"))
