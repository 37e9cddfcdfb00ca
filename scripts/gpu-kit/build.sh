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
