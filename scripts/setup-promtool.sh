#!/usr/bin/env bash
# promtool, Prometheus's own checker of the text exposition format, for the
# scrape tests (tests/test_e2e_prometheus.py).  It ships only inside the
# distribution's prometheus server package (19 MB, 96 MB installed, with a
# daemon and a system user): that package is downloaded through the apt
# sources this machine is configured with, and only its promtool, a static
# Go binary, is unpacked to $1.  Nothing is installed system-wide.
set -euo pipefail
dest=$(realpath -m "${1:?usage: setup-promtool.sh DEST}")
if [ -x "$dest" ] && "$dest" --version >/dev/null 2>&1; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# the package lists may not have been fetched on a fresh machine
apt-cache show prometheus >/dev/null 2>&1 || apt-get update -q
# root downloads into a root-only temporary folder: no sandbox user
apt-get download -q -o APT::Sandbox::User=root prometheus >/dev/null
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool
mkdir -p "$(dirname "$dest")"
install -m 755 usr/bin/promtool "$dest"
"$dest" --version | head -1
