#!/usr/bin/env bash
# bcc compiles its BPF C at run time against /lib/modules/$(uname -r)/build.
# Where the running kernel ships no headers (this VM's does not), link the
# newest Debian linux-headers there instead, and say so.  kvtrace's program
# uses only long-stable layouts (struct pt_regs, BPF helpers and map types),
# which is why headers of another version serve.  Never touches a kernel
# that has its own headers.
set -euo pipefail
release=$(uname -r)
mod=/lib/modules/$release
if [ -d "$mod/build/include" ]; then
    echo "setup: kernel headers for $release present ($mod/build)"
    exit 0
fi
arch=$(dpkg --print-architecture)
build=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$build" ]; then
    echo "setup: no linux-headers-*-$arch under /usr/src; install linux-headers-$arch" >&2
    exit 1
fi
common=${build%-"$arch"}-common
mkdir -p "$mod"
ln -sfn "$build" "$mod/build"
[ -d "$common" ] && ln -sfn "$common" "$mod/source"
echo "setup: kernel $release has no headers of its own; linked $(basename "$build") as $mod/build (fallback)"
