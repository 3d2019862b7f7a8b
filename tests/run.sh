#!/usr/bin/env bash
# Every test that runs without a GPU: formatting, lints, the module layering, the Rust unit and
# integration tests (the daemon end to end on its host backend, the CLI and `weightstream demo`),
# the install commands (`cargo install` into a temporary root, the abi3 wheel into a fresh venv),
# the documents' commands against `--help`, the Python client against the daemon, ruff,
# `systemd-analyze verify` of the unit, and bounded fuzzing. GPU suites live in tests/gpu/.
#
# Time: ~17 min on 2 cores from a fresh clone (crates and wheels in the caches); of it, the
# fuzzing step runs 2 targets x 60 s (FUZZ_SECONDS=10 shortens it).
# Disk: ~3.5 GB in target/ (debug with line tables only, the fuzz targets, the wheel), ~5 GB in
# .venv/ (torch).
# What it installs and changes:
# - as root, when missing: `apt-get install systemd tmux` (systemd-analyze, and a terminal for
#   `weightstream top`); as a user without them it stops and says so;
# - as root: `useradd ws-attacker` (no home, group nogroup, no login shell), the second uid the
#   security tests attack the daemon from (WEIGHTSTREAM_REQUIRE_ROOT=0 skips those tests instead);
# - .venv/: the pinned test requirements (tests/python/requirements.txt: torch for the CPU,
#   peft, pytest, maturin, ruff, ...) from PyPI, and client-py installed editable into it;
# - rustup components rustfmt and clippy; crates from crates.io into ~/.cargo;
# - target/install-root and target/wheel-venv (the install checks). Nothing else outside the
#   repository.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's heading shows the minutes and seconds since the start: where the time goes.
step() { printf '\n==> [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

step "toolchain"
cargo --version
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "Debian packages the tests use: systemd (systemd-analyze), tmux (weightstream top)"
if ! command -v systemd-analyze >/dev/null || ! command -v tmux >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "systemd-analyze or tmux missing: apt-get install systemd tmux (as root)" >&2
        exit 1
    fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd tmux
fi

step "a second uid for the security tests: user ws-attacker"
# daemon/e2e/tests/security.rs, daemon/e2e/tests/security_store.rs and tests/python/client/test_security.py
# attack the daemon as another uid;
# with WEIGHTSTREAM_REQUIRE_ROOT=1 they fail (rather than skip) without root and that user.
# CI runs as root; as a user, run WEIGHTSTREAM_REQUIRE_ROOT=0 tests/run.sh to skip them.
export WEIGHTSTREAM_REQUIRE_ROOT="${WEIGHTSTREAM_REQUIRE_ROOT:-1}"
if [ "$(id -u)" -eq 0 ]; then
    id -u ws-attacker >/dev/null 2>&1 ||
        useradd --no-create-home --no-user-group --gid nogroup --shell /usr/sbin/nologin ws-attacker
    id ws-attacker
elif [ "$WEIGHTSTREAM_REQUIRE_ROOT" = 1 ]; then
    echo "not root: the tests that attack the daemon as another uid will fail" >&2
fi

step "cargo fmt --check (the workspace and the fuzz crate, a workspace of its own)"
cargo fmt --all -- --check
cargo fmt --manifest-path daemon/fuzz/Cargo.toml -- --check

step "module layering: every import in daemon/src points down the module map"
python3 tests/check_layers.py --self-test
python3 tests/check_layers.py

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "python: .venv with the pinned test requirements (torch, peft, grpcio-tools, pytest, maturin)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
# torchao's quantized weights stream pre-quantized (test_torchao.py). Its wheel pins a torch of
# its own that the tests do not want: installed without dependencies, next to the torch above.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "torchao==0.18.0"

step "python: pip install -e client-py (maturin builds weightstream._native, dev profile, in target/)"
# The extension is a workspace member: maturin builds it into the workspace's target/ with the
# dev profile (pyproject's editable-profile), reusing what cargo built above where it can; maturin
# comes from the requirements (no build isolation: nothing to download).
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    --no-build-isolation -e client-py

step "python: the abi3 wheel installs into a fresh venv and imports (no torch there)"
# The GPU machine (no Rust) installs a wheel: `maturin build --release`. CI checks the wheel
# itself (tag, layout, import, a call) with the dev profile the editable install just built.
rm -rf target/wheels target/wheel-venv
.venv/bin/maturin build --quiet --profile dev --manifest-path client-py/Cargo.toml \
    --out target/wheels
ls target/wheels/weightstream-0.1.0-cp310-abi3-linux_x86_64.whl
python3 -m venv target/wheel-venv
target/wheel-venv/bin/python -m pip install --quiet --disable-pip-version-check \
    target/wheels/weightstream-0.1.0-cp310-abi3-linux_x86_64.whl
wheel_python="$PWD/target/wheel-venv/bin/python"
# `pip install ./client-py` builds this same wheel (release profile) and installs it.
(cd /tmp && "$wheel_python" -c '
import weightstream, weightstream._native as native
assert native.__file__.endswith("_native.abi3.so"), native.__file__
client = weightstream.connect("/nonexistent/ws.sock")
try:
    client.info()
except weightstream.DaemonUnavailable as e:
    print("wheel ok:", e)
else:
    raise SystemExit("a missing daemon answered")
')

step "install: cargo install --path daemon/cli into a temporary root; weightstream --version"
# What a user runs is `cargo install --locked --path daemon/cli` (release); the debug profile
# here reuses this run's build in target/ instead of building everything again.
cargo build --locked --bin weightstream
rm -rf target/install-root
CARGO_TARGET_DIR="$PWD/target" cargo install --quiet --debug --locked --path daemon/cli \
    --root target/install-root
version=$(target/install-root/bin/weightstream --version)
[ "$version" = "weightstream 0.1.0" ] || { echo "installed: $version" >&2; exit 1; }
echo "installed: $version"
rm -rf target/install-root

step "the documents' commands exist: every weightstream subcommand and --flag in */README.md, DESIGN.md"
python3 tests/check_doc_commands.py --self-test
python3 tests/check_doc_commands.py --bin target/debug/weightstream

step "pytest (the Python client and weightstream.torch against the daemon's host backend)"
WEIGHTSTREAM_BIN="$PWD/target/debug/weightstream" WEIGHTSTREAM_REQUIRE_TMUX=1 \
    .venv/bin/python -m pytest -q tests/python

step "systemd-analyze verify deploy/weightstream.service"
# verify checks that ExecStart exists: point it at the binary built above. It exits 0 on
# warnings (an unknown key, a bad value), so any output at all fails the step.
unit_dir=$(mktemp -d)
sed "s#^ExecStart=/usr/local/bin/weightstream#ExecStart=$PWD/target/debug/weightstream#" \
    deploy/weightstream.service >"$unit_dir/weightstream.service"
verify_out=$(systemd-analyze verify "$unit_dir/weightstream.service" 2>&1) || {
    echo "$verify_out"; exit 1; }
rm -r "$unit_dir"
if [ -n "$verify_out" ]; then echo "$verify_out"; exit 1; fi
bash -n deploy/install.sh

step "ruff (client-py/, tests/; installed into .venv with the test requirements)"
py_dirs=()
for d in client-py tests; do [ -d "$d" ] && py_dirs+=("$d"); done
.venv/bin/python -m ruff check --config client-py/pyproject.toml "${py_dirs[@]}"
.venv/bin/python -m ruff format --config client-py/pyproject.toml --check "${py_dirs[@]}"

step "fuzzing: safetensors header parser and request validation (bounded)"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}" daemon/fuzz/run.sh

step "all passed"
