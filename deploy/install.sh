#!/usr/bin/env bash
# Installs weightstream as a systemd service: user and group, binary, config, unit; enables and
# starts it. Run as root from the repository after `cargo build --release`.
#   deploy/install.sh [path/to/weightstream]
# Trainers: `usermod -aG weightstream USER` (then log in again) to reach the socket.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/weightstream}
[ -x "$bin" ] || { echo "no binary at $bin: cargo build --release first" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "run as root" >&2; exit 1; }

getent group weightstream >/dev/null || groupadd --system weightstream
id -u weightstream >/dev/null 2>&1 || useradd --system --gid weightstream \
    --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin weightstream
# GPU device nodes are usually group video/render on distributions that restrict them.
for g in video render; do getent group "$g" >/dev/null && usermod -aG "$g" weightstream; done

install -m 0755 "$bin" /usr/local/bin/weightstream
install -d -m 0755 /etc/weightstream
[ -e /etc/weightstream/config.toml ] ||
    install -m 0644 deploy/config.example.toml /etc/weightstream/config.toml
install -d -m 0755 /usr/local/share/doc/weightstream
install -m 0644 README.md /usr/local/share/doc/weightstream/README.md
install -m 0644 deploy/weightstream.service /etc/systemd/system/weightstream.service
systemd-analyze verify /etc/systemd/system/weightstream.service
systemctl daemon-reload
systemctl enable --now weightstream.service
systemctl --no-pager status weightstream.service
