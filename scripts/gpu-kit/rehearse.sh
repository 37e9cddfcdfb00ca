#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# rehearse.sh - the GPU kit's run on this machine, as the device would run
# it where no GPU is needed (scripts/gpu-kit/README.md, "Rehearsal").
#
#   scripts/gpu-kit/rehearse.sh [KIT]          KIT defaults to build/gpu-kit
#
# In new network and mount namespaces (unshare -n -m: no network), with an
# empty environment, driver.py --cpu runs under a Python that stands in
# for the device's: a venv without this machine's site-packages (so no bcc,
# pyelftools, orjson or zlib-ng), given only what the device's image holds
# that the tracer needs (numpy, and rich with its pygments, markdown-it and
# mdurl), copied from the project's venv.  The system's libbcc_bpf, libbpf
# and libelf are hidden (bind-mounted over by empty files), so that the
# tracer can load only the kit's.  The tracer is this checkout's tracer/
# and bpf/, which travel with the repository.
# Exit codes: driver.py's (0 the verdict holds).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=$(readlink -f "${1:-$ROOT/build/gpu-kit}")
WORK=$(mktemp -d /tmp/kvtrace-rehearse.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

/usr/bin/python3 -m venv --without-pip "$WORK/py"
SITE=$("$WORK/py/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VENV_SITE=$("$ROOT/.venv/bin/python" -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
for m in numpy numpy.libs rich pygments markdown_it mdurl; do
	[ -e "$VENV_SITE/$m" ] && cp -r "$VENV_SITE/$m" "$SITE/"
done

LIBDIR=/usr/lib/x86_64-linux-gnu
exec unshare -n -m -- /bin/sh -c '
set -e
for lib in "$1"/libbcc_bpf.so.0.* "$1"/libbpf.so.1.* "$1"/libelf-*.so "$1"/libelf.so.1*; do
	[ -f "$lib" ] && [ ! -L "$lib" ] && mount --bind /dev/null "$lib"
done
for py in /usr/lib/python3/dist-packages/bcc/__init__.py; do
	[ -f "$py" ] && mount --bind /dev/null "$py"
done
exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$2/py/bin/python" \
	"$3/scripts/gpu-kit/driver.py" --cpu --kit "$4" --out "$2/run"
' rehearse "$LIBDIR" "$WORK" "$ROOT" "$KIT"
