#!/usr/bin/env bash
# Lays out what tests/bench/ai_toolkit_real.py needs on the GPU machine, in git-ignored paths of
# the repo root (carried with `run`, never committed):
#   .aitk/  ai-toolkit's code at the pinned commit, from a git dir of ostris/ai-toolkit
#           (only its *.py files and the small data files next to them: no UI, assets,
#           notebooks or keymap safetensors)
#   .whl/   wheels the GPU image lacks: ai-toolkit's pinned diffusers commit (built from a git
#           dir of huggingface/diffusers), oyaml, python-dotenv; for the 8-bit recipe
#           (quantize: true, optimizer: adamw8bit) torchao and optimum-quanto, and bitsandbytes
#           with only its CUDA 13.0 and CPU libraries (the GPU image's torch is cu130; the full
#           wheel, 43 MB, would not fit what a device call carries)
# Usage: tests/bench/ai_toolkit_prepare.sh AITK_GIT_DIR DIFFUSERS_GIT_DIR
set -euo pipefail
AITK_GIT=$1
DIFFUSERS_GIT=$2
AITK_COMMIT=27a03a91f23eb1b757d5ec2e80ee3e129cfcc350
DIFFUSERS_COMMIT=c943837899b16cbae2f619b8dd4f7bb6f07dd81a  # ai-toolkit's requirements_base.txt
cd "$(dirname "$0")/../.."
rm -rf .aitk && mkdir .aitk
git --git-dir="$AITK_GIT" ls-tree -r "$AITK_COMMIT" | while read -r _ type sha path; do
  [ "$type" = blob ] || continue
  case "$path" in
    ui/*|assets/*|notebooks/*|docker/*|*.safetensors|*.png|*.jpg|*.webp|*.mp4) continue ;;
    *.py|*.json|*.yaml|*.yml|*.txt|*.toml) ;;
    *) continue ;;
  esac
  mkdir -p ".aitk/$(dirname "$path")"
  git --git-dir="$AITK_GIT" cat-file blob "$sha" >".aitk/$path"
done
mkdir -p .whl
tmp=$(mktemp -d)
git --git-dir="$DIFFUSERS_GIT" archive "$DIFFUSERS_COMMIT" | tar -x -C "$tmp"
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$tmp"
rm -rf "$tmp" && tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d .whl oyaml==1.0 python-dotenv==1.2.4 \
  optimum-quanto==0.2.7
platform="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: $platform -d .whl torchao==0.18.0
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: $platform -d "$tmp" bitsandbytes==0.50.2
(cd "$tmp" && python3 -m wheel unpack -d unpacked bitsandbytes-*.whl &&
  find unpacked -name 'libbitsandbytes_*.so' ! -name '*_cuda130.so' ! -name '*_cpu.so' -delete &&
  sed -i '/libbitsandbytes_.*\.so/{/_cuda130\.so\|_cpu\.so/!d}' unpacked/*/*.dist-info/RECORD &&
  python3 -m wheel pack -d "$OLDPWD/.whl" unpacked/bitsandbytes-*)
rm -rf "$tmp"
du -sh .aitk .whl/*
