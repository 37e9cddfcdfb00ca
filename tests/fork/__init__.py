"""Paths and helpers shared by the vLLM fork tests (tests/test_fork_*.py); the
fork's driver and its Makefile live beside this file.

The releases are scripts/vllm-releases.txt's lines: each has its pinned
sdist there and its patch in scripts/vllm-fork/RELEASE/, and every fork
test runs once per release."""

import hashlib
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORK_DIR = ROOT / "scripts" / "vllm-fork"
BUILD_SCRIPT = ROOT / "scripts" / "build-vllm-fork.sh"
SDIST_SCRIPT = ROOT / "scripts" / "vllm-sdist.sh"
RELEASES_FILE = ROOT / "scripts" / "vllm-releases.txt"
PROBES_H = ROOT / "bpf" / "kvtrace_probes.h"
WORK = ROOT / "build" / "vllm-fork"      # the patched trees, made by the build script
DEPS = WORK / "deps"                     # scripts/vllm-fork/compile-deps.sh (make setup)
DRIVER_DIR = ROOT / "tests" / "fork"


def pinned_releases() -> dict:
    """{version: sdist sha256}, scripts/vllm-releases.txt's lines in order."""
    out = {}
    for line in RELEASES_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            version, sha = line.split()
            out[version] = sha
    return out


RELEASES = list(pinned_releases())


def patch_path(release: str) -> Path:
    return FORK_DIR / release / "kvtrace-probes.patch"


def out_dir(release: str) -> Path:
    """What tests/fork/Makefile builds from that release's tree."""
    return WORK / "obj" / release


def sdist_path(release: str) -> Path:
    """The release's sdist, fetched and checked by scripts/vllm-sdist.sh."""
    r = subprocess.run([str(SDIST_SCRIPT), release], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip()).parent / f"vllm-{release}.tar.gz"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def patched_tree(release: str) -> Path:
    """The release's patched vLLM tree, made (or reused) by the build script."""
    r = subprocess.run([str(BUILD_SCRIPT), "source", release, str(WORK)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def nvcc():
    return shutil.which("nvcc") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


def patch_files(release: str) -> dict:
    """{path: 'added' | 'modified' | 'deleted'} for every file in the patch."""
    files = {}
    current = None
    for line in patch_path(release).read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            files[current] = "modified"
        elif line.startswith("new file mode") and current:
            files[current] = "added"
        elif line.startswith("deleted file mode") and current:
            files[current] = "deleted"
    return files
