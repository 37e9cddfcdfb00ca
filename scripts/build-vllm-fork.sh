#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# build-vllm-fork.sh - vLLM with kvtrace-bpf's vllm:* USDT probes.
#
#   scripts/build-vllm-fork.sh cuda   [RELEASE] [WORKDIR]   fetch, check, patch, build a wheel
#   scripts/build-vllm-fork.sh cpu    [RELEASE] [WORKDIR]   ... for vLLM's CPU backend
#   scripts/build-vllm-fork.sh source [RELEASE] [WORKDIR]   fetch, check and patch only;
#                                                           prints the patched tree's path
#
# RELEASE is a release of the matrix, scripts/vllm-releases.txt, each with
# its patch scripts/vllm-fork/RELEASE/kvtrace-probes.patch; default: the
# newest release there.
# An argument after MODE that looks like a version (0.34.0) is the release,
# any other is WORKDIR.  WORKDIR (default build/vllm-fork) holds the patched
# tree WORKDIR/vllm-RELEASE (made anew when the sdist or the patch changes)
# and the wheel (WORKDIR/dist).
#
# The sdist is fetched and checked against its sha256 in
# scripts/vllm-releases.txt by scripts/vllm-sdist.sh (kept in
# build/vllm-sdist: a second run does not fetch again).  docs/fork.md has the
# details.
#
# The build runs vLLM's own setup.py/CMake with nothing changed but the
# patched sources; it uses the Python environment it runs in
# (--no-build-isolation), which must hold vLLM's build requirements
# (requirements/build/cuda.txt or requirements/build/cpu.txt of the tree).
# Both CMake paths fetch sources from GitHub during configure: the CPU build
# oneDNN (unless FETCHCONTENT_SOURCE_DIR_ONEDNN names a local copy), the CUDA
# build CUTLASS, vllm-flash-attn, FlashMLA, DeepGEMM and more (unless
# VLLM_CUTLASS_SRC_DIR, VLLM_FLASH_ATTN_SRC_DIR, FLASH_MLA_SRC_DIR, ... do).
#
# Exit codes: 0 done, 1 a step failed, 2 usage or a release with no patch.
set -euo pipefail

usage() {
	sed -n '4,17p' "$0" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)

die() {
	echo "build-vllm-fork: $*" >&2
	exit 1
}

# The releases of the matrix, oldest first.
releases() { awk '!/^#/ && NF { print $1 }' "$here/vllm-releases.txt" | sort -V; }

mode=${1:-}
case "$mode" in
cpu | cuda | source) ;;
*) usage ;;
esac
shift
release=
if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+(\.[0-9]+)+ ]]; then
	release=$1
	shift
fi
[ $# -le 1 ] || usage
release=${release:-$(releases | tail -n 1)}
if ! releases | grep -qxF "$release"; then
	echo "build-vllm-fork: vLLM $release is not in scripts/vllm-releases.txt" \
		"($(releases | paste -sd' '))" >&2
	exit 2
fi
patch_file="$here/vllm-fork/$release/kvtrace-probes.patch"
if ! [ -f "$patch_file" ]; then
	echo "build-vllm-fork: no patch for vLLM $release (scripts/vllm-fork/$release/kvtrace-probes.patch)" >&2
	exit 2
fi
work=${1:-$root/build/vllm-fork}
mkdir -p "$work"
work=$(cd "$work" && pwd)
tree="$work/vllm-$release"

sha256() { sha256sum "$1" | cut -d' ' -f1; }

# The tree is made anew whenever the sdist or the patch changed (a stamp
# records both hashes), so the patch never meets a half-patched tree, and an
# unchanged one is reused (incremental builds, quick test sessions).  It is
# unpacked from the checked sdist, not copied from vllm-sdist.sh's tree, which
# other tools read and may leave files in.
patched_tree() {
	local pristine sdist stamp want
	pristine=$("$here/vllm-sdist.sh" "$release") || exit $?
	sdist="$(dirname "$pristine")/vllm-$release.tar.gz"
	stamp="$tree/.kvtrace-fork-stamp"
	want="$(sha256 "$sdist") $(sha256 "$patch_file")"
	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
		return
	fi
	rm -rf "$tree"
	tar -xzf "$sdist" -C "$work"
	[ -d "$tree/csrc" ] || die "$sdist has no vllm-$release/csrc"
	# The tree may lie inside another git repository (this one): stop git
	# from finding it, or `git apply` would resolve paths against that
	# repository's top and silently skip them.  git apply is strict: no fuzz.
	(cd "$tree" && GIT_CEILING_DIRECTORIES="$work" git apply --check "$patch_file" &&
		GIT_CEILING_DIRECTORIES="$work" git apply "$patch_file") ||
		die "$release/$(basename "$patch_file") does not apply to vllm $release"
	echo "$want" >"$stamp"
}

# Asks the compiler, which knows the multiarch include paths.
check_sdt() {
	echo '#include <sys/sdt.h>' | "${CXX:-c++}" -E -x c++ - >/dev/null 2>&1 ||
		die "sys/sdt.h not found: install systemtap-sdt-dev (Debian, Ubuntu)"
}

patched_tree
if [ "$mode" = source ]; then
	echo "$tree"
	exit 0
fi

check_sdt
python3 -c 'import torch' 2>/dev/null ||
	die "no torch in $(command -v python3): pip install -r $tree/requirements/build/$mode.txt first"
cd "$tree"
mkdir -p "$work/dist"
if [ "$mode" = cpu ]; then
	[ -n "${FETCHCONTENT_SOURCE_DIR_ONEDNN:-}" ] ||
		echo "build-vllm-fork: FETCHCONTENT_SOURCE_DIR_ONEDNN is not set: CMake will clone oneDNN from GitHub" >&2
else
	command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] ||
		die "nvcc not found: set CUDA_HOME or put nvcc on PATH"
fi
echo "build-vllm-fork: building the $mode wheel of vLLM $release in $tree (MAX_JOBS=${MAX_JOBS:-all cores})" >&2
VLLM_TARGET_DEVICE=$mode python3 -m pip wheel --no-build-isolation --no-deps \
	-w "$work/dist" . || die "the $mode build failed (see above)"
ls "$work"/dist/vllm-"$release"*.whl
