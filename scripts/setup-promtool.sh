#!/usr/bin/env bash
# promtool, Prometheus's own checker of the text exposition format, and the
# Prometheus server itself, for the scrape tests (tests/test_e2e_prometheus.py,
# tests/test_e2e_agent.py, which start a real server on 127.0.0.1 that scrapes
# the agent).  Both ship only inside the distribution's prometheus package
# (19 MB, 96 MB installed, with a daemon and a system user): that package is
# downloaded through the apt sources this machine is configured with, and only
# its two static Go binaries are unpacked, promtool to $1 and the server to $2
# (default: `prometheus` beside $1).  Nothing is installed system-wide.
set -euo pipefail
dest=$(realpath -m "${1:?usage: setup-promtool.sh PROMTOOL_DEST [PROMETHEUS_DEST]}")
server=$(realpath -m "${2:-$(dirname "$dest")/prometheus}")
if [ -x "$dest" ] && "$dest" --version >/dev/null 2>&1 &&
   [ -x "$server" ] && "$server" --version >/dev/null 2>&1; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# the package lists may not have been fetched on a fresh machine
apt-cache show prometheus >/dev/null 2>&1 || apt-get update -q
# root downloads into a root-only temporary folder: no sandbox user
apt-get download -q -o APT::Sandbox::User=root prometheus >/dev/null
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool ./usr/bin/prometheus
mkdir -p "$(dirname "$dest")" "$(dirname "$server")"
install -m 755 usr/bin/promtool "$dest"
install -m 755 usr/bin/prometheus "$server"
"$dest" --version | head -1
"$server" --version | head -1
