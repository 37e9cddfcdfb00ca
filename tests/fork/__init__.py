"""Paths and helpers shared by the vLLM fork tests (tests/test_fork_*.py); the
fork's driver and its Makefile live beside this file."""

import hashlib
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORK_DIR = ROOT / "scripts" / "vllm-fork"
BUILD_SCRIPT = ROOT / "scripts" / "build-vllm-fork.sh"
PATCH = FORK_DIR / "kvtrace-probes.patch"
PROBES_H = ROOT / "bpf" / "kvtrace_probes.h"
WORK = ROOT / "build" / "vllm-fork"      # what `make setup` fetched and unpacked
DEPS = WORK / "deps"
OUT = WORK / "obj"                       # what tests/fork/Makefile builds
DRIVER_DIR = ROOT / "tests" / "fork"


def sdist_env() -> dict:
    """scripts/vllm-fork/sdist.env: VLLM_VERSION, SDIST_FILE, SDIST_SHA256."""
    env = {}
    for line in (FORK_DIR / "sdist.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def sdist_path() -> Path:
    return WORK / sdist_env()["SDIST_FILE"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def patched_tree() -> Path:
    """The patched vLLM tree, made (or reused) by the build script."""
    r = subprocess.run([str(BUILD_SCRIPT), "source", str(WORK)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def nvcc():
    return shutil.which("nvcc") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


def patch_files() -> dict:
    """{path: 'added' | 'modified' | 'deleted'} for every file in the patch."""
    files = {}
    current = None
    for line in PATCH.read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            files[current] = "modified"
        elif line.startswith("new file mode") and current:
            files[current] = "added"
        elif line.startswith("deleted file mode") and current:
            files[current] = "deleted"
    return files
