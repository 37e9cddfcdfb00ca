#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# refresh-patch.sh [RELEASE] [TREE] - rewrite RELEASE/kvtrace-probes.patch
# from a patched tree of that release (default build/vllm-fork/vllm-RELEASE,
# as `build-vllm-fork.sh source RELEASE` made it, then edited), with
# csrc/kvtrace_probes.h taken from bpf/ so that the copy stays identical.
# The diff is taken against the release's pinned sdist (scripts/vllm-sdist.sh
# fetches and checks it).  RELEASE defaults to the newest release in
# scripts/vllm-releases.txt.  Exit codes: 0 done, 1 a step failed, 2 usage.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ $# -le 2 ] || { sed -n '4,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
release=${1:-$(awk '!/^#/ && NF { print $1 }' "$root/scripts/vllm-releases.txt" | sort -V | tail -n 1)}
tree=${2:-$root/build/vllm-fork/vllm-$release}
pristine=$("$root/scripts/vllm-sdist.sh" "$release") || exit $?
sdist="$(dirname "$pristine")/vllm-$release.tar.gz"
[ -d "$tree/csrc" ] || {
	echo "refresh-patch: need the patched tree $tree (run build-vllm-fork.sh source $release)" >&2
	exit 1
}
out="$here/$release/kvtrace-probes.patch"
files=(csrc/cache_kernels.cu csrc/cpu/cpu_attn.cpp csrc/kvtrace_cuda_sites.h)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
top=vllm-$release
tar -xzf "$sdist" -C "$tmp" "$top/csrc/cache_kernels.cu" "$top/csrc/cpu/cpu_attn.cpp"
cd "$tmp/$top"
export GIT_CEILING_DIRECTORIES=$tmp GIT_AUTHOR_NAME=kvtrace GIT_AUTHOR_EMAIL=kvtrace@localhost \
	GIT_COMMITTER_NAME=kvtrace GIT_COMMITTER_EMAIL=kvtrace@localhost
git init -q && git add -A && git commit -qm "vllm $release"
for f in "${files[@]}"; do cp "$tree/$f" "$f"; done
cp "$root/bpf/kvtrace_probes.h" csrc/kvtrace_probes.h
git add -A
mkdir -p "$(dirname "$out")"
git diff --cached --no-color >"$out"
echo "refresh-patch: wrote $out" >&2
