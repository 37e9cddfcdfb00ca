#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# vllm-sdist.sh VERSION [DIR] - a pinned vLLM release's source tree, unpacked.
#
# Fetches vllm-VERSION.tar.gz (kept in DIR: a second run does not fetch
# again), checks it against its sha256 in scripts/vllm-releases.txt, unpacks
# it to DIR/vllm-VERSION (made anew only when missing) and prints that path.
# DIR defaults to build/vllm-sdist.  Exit codes: 0 done, 1 a step failed,
# 2 usage or a release not in scripts/vllm-releases.txt.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
[ $# -ge 1 ] && [ $# -le 2 ] || { sed -n '4,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
version=$1
work=${2:-$root/build/vllm-sdist}
pinned=$(awk -v v="$version" '$1 == v { print $2 }' "$here/vllm-releases.txt")
[ -n "$pinned" ] || { echo "vllm-sdist: $version is not in scripts/vllm-releases.txt" >&2; exit 2; }
mkdir -p "$work"
work=$(cd "$work" && pwd)
file=vllm-$version.tar.gz
sdist=$work/$file
tree=$work/vllm-$version
die() { echo "vllm-sdist: $*" >&2; exit 1; }
sha256() { sha256sum "$1" | cut -d' ' -f1; }

if ! [ -f "$sdist" ] || [ "$(sha256 "$sdist")" != "$pinned" ]; then
	# the URL is resolved now, through pip's configured index: none is kept here
	url=$(python3 "$here/vllm-fork/sdist-url.py" vllm "$file") ||
		die "cannot find $file on pip's indexes (see above)"
	echo "vllm-sdist: fetching $file" >&2
	python3 - "$url" "$sdist.part" <<-'PY' || die "cannot fetch $url"
		import shutil, sys, urllib.request
		with urllib.request.urlopen(sys.argv[1], timeout=120) as r, open(sys.argv[2], "wb") as f:
		    shutil.copyfileobj(r, f)
	PY
	got=$(sha256 "$sdist.part")
	[ "$got" = "$pinned" ] || { rm -f "$sdist.part"; die "sha256 mismatch for $file: got $got, pinned $pinned"; }
	mv "$sdist.part" "$sdist"
	rm -rf "$tree"
fi
if ! [ -f "$tree/.kvtrace-unpacked" ]; then
	rm -rf "$tree" "$tree.part"
	mkdir -p "$tree.part"
	tar -xzf "$sdist" -C "$tree.part" --strip-components=1
	touch "$tree.part/.kvtrace-unpacked"
	mv "$tree.part" "$tree"
fi
echo "$tree"
