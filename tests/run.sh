#!/usr/bin/env bash
# Every test that runs without a GPU: formatting, lints, the Rust unit and integration tests
# (the daemon end to end on its host backend, the CLI and `weightstream demo`), the Python client
# (built by maturin: editable, and its abi3 wheel in a fresh venv) against the daemon, and the
# Python linter. Installs what it needs from the package registries. GPU suites live in tests/gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

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
# daemon/tests/security.rs, daemon/tests/security_store.rs and tests/python/test_security.py
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

step "pytest (the Python client and weightstream.torch against the daemon's host backend)"
cargo build --locked --bin weightstream
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

step "ruff (client-py/, tests/)"
python3 -m pip install --quiet --disable-pip-version-check "ruff==0.17.6"
py_dirs=()
for d in client-py tests; do [ -d "$d" ] && py_dirs+=("$d"); done
python3 -m ruff check --config client-py/pyproject.toml "${py_dirs[@]}"
python3 -m ruff format --config client-py/pyproject.toml --check "${py_dirs[@]}"

step "fuzzing: safetensors header parser and request validation (bounded)"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}" daemon/fuzz/run.sh

step "all passed"
