#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# build.sh - the GPU kit (scripts/gpu-kit/README.md), built here for a
# machine with a GPU that has no registry, no bcc and no vLLM.
#
#   scripts/gpu-kit/build.sh [OUT]        OUT defaults to build/gpu-kit
#
# Makes, under OUT:
#   libkvtrace_kit_ops.so  kit_ops.cu by nvcc for sm_90 (CUDA runtime linked
#                          statically: only the driver's libcuda is needed)
#   lib/                   libbcc_bpf.so.0 and the libraries it needs that a
#                          machine without bcc may lack
#   wheels/                the tracer's pure-Python and compiled
#                          dependencies that the device's image lacks, for
#                          CPython 3.11 (this machine) and 3.12 (the device)
#   bpf-entry.json         the tracer's BPF program compiled by bcc here,
#                          for the flags driver.py attaches with; loaded
#                          there through KVTRACE_PROGRAM_ENTRY
#   MANIFEST               every file and its size
#
# Needs: nvcc (13.0 was used), the patched vLLM tree and its headers (make
# setup), Debian's libbpfcc, pip able to download, root (the compile loads
# the program once to measure the verifier).
# Exit codes: 0 built, 1 a step failed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT_SRC="$ROOT/scripts/gpu-kit"
OUT=${1:-$ROOT/build/gpu-kit}
RELEASE=0.34.0
PY=${PYTHON:-$ROOT/.venv/bin/python}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
TORCH_CUDA="$ROOT/build/vllm-fork/deps/torch-cuda/torch"

mkdir -p "$OUT/src" "$OUT/lib" "$OUT/wheels"

# 1. the fork's kernel, cut verbatim out of the patched cache_kernels.cu
TREE=$("$ROOT/scripts/build-vllm-fork.sh" source "$RELEASE")
"$PY" "$KIT_SRC/extract_kernel.py" "$TREE/csrc/cache_kernels.cu" \
	reshape_and_cache_flash_kernel >"$OUT/src/kit_kernel.inc"

# 2. the ops library; the flags are tests/fork/Makefile's (vLLM's CMake's)
nice -n 19 "$NVCC" -std=c++20 -O2 -g -DNDEBUG -Xcompiler -fPIC \
	--expt-relaxed-constexpr --expt-extended-lambda --use_fast_math \
	-gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
	-t1 -cudart static -shared -Xlinker -soname=libkvtrace_kit_ops.so \
	-I"$OUT/src" -I"$TREE/csrc" -I"$TORCH_CUDA/include" \
	-o "$OUT/libkvtrace_kit_ops.so" "$KIT_SRC/kit_ops.cu"
echo "build: $OUT/libkvtrace_kit_ops.so"

# 3. libbcc_bpf (Debian's libbpfcc: the loader without LLVM) and what it
# links beyond glibc and libstdc++, which any machine with torch has
BCC_LIB=$(readlink -f /usr/lib/x86_64-linux-gnu/libbcc_bpf.so.0)
rm -f "$OUT"/lib/*
cp "$BCC_LIB" "$OUT/lib/libbcc_bpf.so.0"
for dep in libbpf.so.1 libelf.so.1; do
	cp "$(ldd "$BCC_LIB" | awk -v d="$dep" '$1 == d { print $3 }')" "$OUT/lib/$dep"
done

# 4. the tracer's dependencies that the device's image does not hold (numpy
# and rich it has, with torch); compiled ones for CPython 3.11 and 3.12.
# Versions: what `make setup` installs here.
WHEELS="pyelftools==0.33 orjson==3.13.0 zlib-ng==1.1.0"
rm -f "$OUT"/wheels/*.whl
for v in 3.11 3.12; do
	"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
		--implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d "$OUT/wheels" $WHEELS 2>&1 | grep -v "^WARNING: Location" || true
done
ls "$OUT"/wheels/pyelftools-*.whl "$OUT"/wheels/orjson-*cp312*.whl \
	"$OUT"/wheels/zlib_ng-*cp312*.whl >/dev/null

# 5. the BPF program, compiled by bcc here with the flags driver.py attaches
# with: the driver's CPU path run once under the tracer, into a private
# cache, which also checks the library and the ops before the kit leaves
rm -rf "$OUT/build-run" "$OUT/bpf-entry.json"
"$PY" "$KIT_SRC/driver.py" --cpu --compile-entry --kit "$OUT" --out "$OUT/build-run" \
	>"$OUT/build-run.log" 2>&1 || { cat "$OUT/build-run.log"; exit 1; }
rm -rf "$OUT/build-run"
grep '^verdict' "$OUT/build-run.log"

# 6. what travels
(cd "$OUT" && find . -type f ! -name MANIFEST -printf '%s %p\n' | sort -k2) >"$OUT/MANIFEST"
echo "build: $(awk '{ s += $1 } END { printf "%.1f MiB", s / 1048576 }' "$OUT/MANIFEST") in $OUT"
