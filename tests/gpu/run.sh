#!/usr/bin/env bash
# GPU suite and benchmarks, in one call on the GPU machine (see tests/gpu/README.md):
#   target/release/weightstream and the client's wheel (target/wheels/, both built on the build
#   machine) must be carried along.
# Writes logs and results under $OUT; exits non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ws-gpu-out}
mkdir -p "$OUT"
# The Python package: the abi3 wheel built on the build machine (`maturin build --release
# --manifest-path client-py/Cargo.toml`, carried along; this machine has no Rust), installed
# into a private directory. Without one: client-py/src with its extension built in place.
wheel=${WEIGHTSTREAM_WHEEL:-$(ls target/wheels/weightstream-*-cp310-abi3-linux_x86_64.whl 2>/dev/null | head -1)}
if [ -n "$wheel" ]; then
  pydir=$(mktemp -d)
  python3 -m pip install --quiet --no-deps --target "$pydir" "$wheel"
  export PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD/client-py/src${PYTHONPATH:+:$PYTHONPATH}"
fi
# torchao and bitsandbytes (the torch suite streams their quantized weights): their wheels
# carried in .whl/, without their dependencies (the image's torch 2.11 stays).
wheels=$(ls .whl/torchao-0.18.0-*.whl .whl/bitsandbytes-*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  aodir=$(mktemp -d)
  python3 -m pip install --quiet --no-index --no-deps --target "$aodir" $wheels
  export PYTHONPATH="$PYTHONPATH:$aodir"
fi
export PYTHONUNBUFFERED=1
BIN=${WEIGHTSTREAM_BIN:-target/release/weightstream}
status=0
nvidia-smi --query-gpu=name,uuid,pci.bus_id,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m tests.gpu.suite --bin "$BIN" --out "$OUT" 2>&1 | tee "$OUT/suite.log" || status=1
python3 -m tests.gpu.torch_suite "$BIN" 2>&1 | tee "$OUT/torch_suite.log" || status=1
# What the daemon assumes of CUDA interprocess events (query and stream-wait across processes).
python3 -m tests.gpu.ipc_event_probe --out "$OUT" 2>&1 | tee "$OUT/ipc_event_probe.log" || status=1
# The copy bandwidth limit: 25 GB/s (a Gen4 link emulated) and 12 GB/s, one and two sessions,
# the bytes the daemon copied within 5 % of the limit.
python3 -m tests.gpu.link_cap --bin "$BIN" --out "$OUT" 2>&1 | tee "$OUT/link_cap.log" || status=1
# The README's first command, on this machine's backend (CUDA here).
"$BIN" demo --size 4GiB --steps 4 2>&1 | tee "$OUT/demo.log" || status=1
if [ "${WS_SKIP_BENCH:-0}" != 1 ]; then
  python3 -m tests.bench.stream_bandwidth --bin "$BIN" --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
fi
# The device tool brings back at most 8 files from $OUT: keep the results, pack the logs.
(cd "$OUT" && logs=$(ls -- *.log *.txt 2>/dev/null) && [ -n "$logs" ] &&
  tar czf gpu-logs.tgz --remove-files $logs) || true
exit $status
