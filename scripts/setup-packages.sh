#!/usr/bin/env bash
# Install the distribution packages kvtrace-bpf needs (Debian/Ubuntu), only
# those missing: bcc and its Python module from the distribution (PyPI's "bcc"
# is another project), sys/sdt.h for the probes, kernel headers for bcc's
# run-time compile, the compilers (gcc for kvsim; g++ for the vLLM fork's CPU
# op and probe sites that tests/fork builds: those tests need no nvcc), and
# python3-venv; python3-dev (Python.h, for the vLLM plugin's C extension);
# tmux, the real terminal that the live view is tested in; chromium, the
# headless browser that report --html's page is opened in by the tests.
set -euo pipefail
arch=$(dpkg --print-architecture)
want=(bpfcc-tools python3-bpfcc systemtap-sdt-dev gcc g++ libc6-dev make python3-venv python3-dev tmux chromium)
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# Headers: the running kernel's own package if the archive has it, else the
# distribution's current ones (setup-kernel-headers.sh links them).
headers="linux-headers-$(uname -r)"
if ! dpkg-query -W -f='${Status}' "$headers" 2>/dev/null | grep -q "ok installed" &&
   ! dpkg-query -W -f='${Status}' "linux-headers-$arch" 2>/dev/null | grep -q "ok installed"; then
    missing+=(HEADERS)
fi
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: distribution packages present"
    exit 0
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
if [[ " ${missing[*]} " == *" HEADERS "* ]]; then
    missing=("${missing[@]/HEADERS/}")
    if apt-cache show "$headers" >/dev/null 2>&1; then
        missing+=("$headers")
    else
        missing+=("linux-headers-$arch")
    fi
fi
apt-get install -y -q --no-install-recommends ${missing[*]}
