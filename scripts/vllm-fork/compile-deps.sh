#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# compile-deps.sh DESTDIR [PYTHON] - the headers and libraries the fork tests
# compile the patched vLLM sources against, unpacked from wheels that pip
# fetches (on the project's machines pip takes them from the local disk):
#
#   DESTDIR/torch-cpu/torch/{include,lib}  torch 2.13.0+cpu: headers for g++,
#                                          libc10 + libtorch_cpu for the driver
#   DESTDIR/torch-cuda/torch/include       torch 2.14.1 (CUDA build): headers
#                                          for nvcc (the releases pin 2.14.0)
#   DESTDIR/cublas/nvidia/cu13/include     cublas_v2.h (torch_utils.h needs it)
#
# Only these members are unpacked and the wheels are deleted afterwards.
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || {
	echo "usage: compile-deps.sh DESTDIR [PYTHON]" >&2
	exit 2
}
dest=$1
python=${2:-python3}
mkdir -p "$dest"
tmp=$(mktemp -d "$dest/.wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# name  requirement  members-to-unpack...
unpack() {
	local name=$1 req=$2
	shift 2
	echo "compile-deps: $req -> $dest/$name" >&2
	"$python" -m pip download -q --disable-pip-version-check --no-deps \
		--only-binary :all: -d "$tmp/$name" "$req"
	rm -rf "${dest:?}/$name.part"
	"$python" - "$tmp/$name"/*.whl "$dest/$name.part" "$@" <<-'EOF'
		import sys, zipfile
		whl, out, prefixes = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
		with zipfile.ZipFile(whl) as z:
		    members = [m for m in z.namelist() if m.startswith(prefixes)]
		    if not members:
		        sys.exit(f"compile-deps: nothing under {prefixes} in {whl}")
		    z.extractall(out, members)
	EOF
	rm -rf "${dest:?}/$name" "$tmp/$name"
	mv "$dest/$name.part" "$dest/$name"
}

unpack torch-cpu 'torch==2.13.0+cpu' torch/include/ torch/lib/libc10.so \
	torch/lib/libtorch_cpu.so torch/lib/libgomp
unpack torch-cuda 'torch==2.14.1' torch/include/
unpack cublas 'nvidia-cublas==13.1.1.3' nvidia/cu13/include/
