#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# build-vllm-fork.sh - vLLM 0.33.0 with kvtrace-bpf's vllm:* USDT probes.
#
#   scripts/build-vllm-fork.sh cuda [WORKDIR]    fetch, check, patch, build a wheel
#   scripts/build-vllm-fork.sh cpu  [WORKDIR]    ... for vLLM's CPU backend
#   scripts/build-vllm-fork.sh source [WORKDIR]  fetch, check and patch only;
#                                                prints the patched tree's path
#
# WORKDIR (default build/vllm-fork) holds the sdist (kept: a second run does
# not fetch again), the patched tree WORKDIR/vllm-0.33.0 (made anew when the
# patch changes)
# and the wheel (WORKDIR/dist).  The sdist is PyPI's vllm-0.33.0.tar.gz,
# pinned by name and sha256 in scripts/vllm-fork/sdist.env and found on the
# index pip is configured with (scripts/vllm-fork/sdist-url.py); the patch is
# scripts/vllm-fork/kvtrace-probes.patch.  docs/fork.md has the details.
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
# Exit codes: 0 done, 1 a step failed, 2 usage.
set -euo pipefail

usage() {
	sed -n '4,9p' "$0" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
patch_file="$here/vllm-fork/kvtrace-probes.patch"
# shellcheck source=vllm-fork/sdist.env
. "$here/vllm-fork/sdist.env"

mode=${1:-}
case "$mode" in
cpu | cuda | source) ;;
*) usage ;;
esac
[ $# -le 2 ] || usage
work=${2:-$root/build/vllm-fork}
mkdir -p "$work"
work=$(cd "$work" && pwd)
sdist="$work/$SDIST_FILE"
tree="$work/vllm-$VLLM_VERSION"

die() {
	echo "build-vllm-fork: $*" >&2
	exit 1
}

sha256() { sha256sum "$1" | cut -d' ' -f1; }

fetch_sdist() {
	if [ -f "$sdist" ] && [ "$(sha256 "$sdist")" = "$SDIST_SHA256" ]; then
		return
	fi
	# the URL is resolved now, through pip's configured index: none is kept here
	local url
	url=$(python3 "$here/vllm-fork/sdist-url.py" vllm "$SDIST_FILE") ||
		die "cannot find $SDIST_FILE on pip's indexes (see above)"
	echo "build-vllm-fork: fetching $url" >&2
	python3 - "$url" "$sdist.part" <<-'EOF' || die "cannot fetch $url"
		import shutil, sys, urllib.request
		with urllib.request.urlopen(sys.argv[1], timeout=120) as r, open(sys.argv[2], "wb") as f:
		    shutil.copyfileobj(r, f)
	EOF
	got=$(sha256 "$sdist.part")
	if [ "$got" != "$SDIST_SHA256" ]; then
		rm -f "$sdist.part"
		die "sha256 mismatch for $url: got $got, pinned $SDIST_SHA256"
	fi
	mv "$sdist.part" "$sdist"
}

# The tree is made anew whenever the sdist or the patch changed (a stamp
# records both hashes), so the patch never meets a half-patched tree, and an
# unchanged one is reused (incremental builds, quick test sessions).
patched_tree() {
	local stamp="$tree/.kvtrace-fork-stamp"
	local want="$SDIST_SHA256 $(sha256 "$patch_file")"
	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
		return
	fi
	rm -rf "$tree"
	tar -xzf "$sdist" -C "$work"
	[ -d "$tree/csrc" ] || die "$sdist has no vllm-$VLLM_VERSION/csrc"
	# The tree may lie inside another git repository (this one): stop git
	# from finding it, or `git apply` would resolve paths against that
	# repository's top and silently skip them.  git apply is strict: no fuzz.
	(cd "$tree" && GIT_CEILING_DIRECTORIES="$work" git apply --check "$patch_file" &&
		GIT_CEILING_DIRECTORIES="$work" git apply "$patch_file") ||
		die "$(basename "$patch_file") does not apply to vllm $VLLM_VERSION"
	echo "$want" >"$stamp"
}

# Asks the compiler, which knows the multiarch include paths.
check_sdt() {
	echo '#include <sys/sdt.h>' | "${CXX:-c++}" -E -x c++ - >/dev/null 2>&1 ||
		die "sys/sdt.h not found: install systemtap-sdt-dev (Debian, Ubuntu)"
}

fetch_sdist
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
echo "build-vllm-fork: building the $mode wheel in $tree (MAX_JOBS=${MAX_JOBS:-all cores})" >&2
VLLM_TARGET_DEVICE=$mode python3 -m pip wheel --no-build-isolation --no-deps \
	-w "$work/dist" . || die "the $mode build failed (see above)"
ls "$work"/dist/vllm-*.whl
