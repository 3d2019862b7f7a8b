#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer's coverage instrumentation on the stable toolchain
# (the flags cargo-fuzz passes, without a sanitizer, which would need nightly) and runs each
# for FUZZ_SECONDS (default 60) over its committed corpus. New inputs go to a scratch copy, so
# the committed corpus only changes when someone copies a finding in on purpose.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${FUZZ_SECONDS:-60}
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
# An explicit --target keeps these flags off build scripts and proc macros (as cargo-fuzz does).
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --locked --target "$triple"
for target in safetensors_header upload_request; do
  scratch=$(mktemp -d)
  cp corpus/"$target"/* "$scratch"/ 2>/dev/null || true
  echo "fuzzing $target for ${seconds}s"
  "$CARGO_TARGET_DIR/$triple/release/$target" -max_total_time="$seconds" -max_len=65536 \
    -print_final_stats=1 "$scratch" 2>&1 | grep -E "^(Done|stat::number_of_executed|stat::new_units)|ERROR|panicked|SUMMARY"
  rm -rf "$scratch"
done
