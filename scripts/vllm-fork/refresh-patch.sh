#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# refresh-patch.sh [TREE] - rewrite kvtrace-probes.patch from a patched tree
# (default build/vllm-fork/vllm-0.33.0, as `build-vllm-fork.sh source` made
# it, then edited), with csrc/kvtrace_probes.h taken from bpf/ so that the
# copy stays identical.  The diff is taken against the pinned sdist.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=sdist.env
. "$here/sdist.env"
tree=${1:-$root/build/vllm-fork/vllm-$VLLM_VERSION}
sdist=$(dirname "$tree")/vllm-$VLLM_VERSION.tar.gz
[ -d "$tree/csrc" ] && [ -f "$sdist" ] || {
	echo "refresh-patch: need $tree and $sdist (run build-vllm-fork.sh source)" >&2
	exit 1
}
files=(csrc/cache_kernels.cu csrc/cpu/cpu_attn.cpp csrc/kvtrace_cuda_sites.h)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
top=vllm-$VLLM_VERSION
tar -xzf "$sdist" -C "$tmp" "$top/csrc/cache_kernels.cu" "$top/csrc/cpu/cpu_attn.cpp"
cd "$tmp/$top"
export GIT_CEILING_DIRECTORIES=$tmp GIT_AUTHOR_NAME=kvtrace GIT_AUTHOR_EMAIL=kvtrace@localhost \
	GIT_COMMITTER_NAME=kvtrace GIT_COMMITTER_EMAIL=kvtrace@localhost
git init -q && git add -A && git commit -qm "vllm $VLLM_VERSION"
for f in "${files[@]}"; do cp "$tree/$f" "$f"; done
cp "$root/bpf/kvtrace_probes.h" csrc/kvtrace_probes.h
git add -A
git diff --cached --no-color >"$here/kvtrace-probes.patch"
echo "refresh-patch: wrote $here/kvtrace-probes.patch" >&2
