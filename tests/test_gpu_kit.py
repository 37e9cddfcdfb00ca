"""The GPU kit (scripts/gpu-kit/README.md), built and rehearsed here without
a GPU: its ops library carries the fork's probes, its compiled BPF entry
loads through its own libbcc_bpf in a clean environment without network,
and the traced CPU path of its driver matches the driver's own truth; the
kit and the repository fit what one device call carries (64 MiB).

The build needs nvcc (the ops library is CUDA code): these tests skip
without it, as the fork's nvcc tests do (make setup does not install the
CUDA toolkit)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, run_kvtrace
from fork import nvcc
from test_fork_build import check_probes

KIT_DIR = ROOT / "scripts" / "gpu-kit"
DEVICE_CARRY_LIMIT = 64 << 20


@pytest.fixture(scope="module")
def kit(tmp_path_factory, bpf_env):
    if nvcc() is None:
        pytest.skip("nvcc not found: the CUDA toolkit is not installed by make setup")
    out = tmp_path_factory.mktemp("gpu-kit")
    r = subprocess.run([str(KIT_DIR / "build.sh"), str(out)], capture_output=True,
                       text=True, timeout=900,
                       env=dict(os.environ, NVCC=nvcc(), PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out


def test_ops_library_carries_the_fork_probes(kit):
    """reshape_and_cache_flash, copy_blocks and swap_blocks, each with its
    own semaphore and the probe ABI's argument sizes."""
    check_probes(kit / "libkvtrace_kit_ops.so",
                 {"reshape_and_cache_flash", "copy_blocks", "swap_blocks"})


def test_kernel_is_the_forks(kit):
    """The kernel compiled is the patched cache_kernels.cu's text."""
    tree = ROOT / "build" / "vllm-fork" / "vllm-0.34.0" / "csrc" / "cache_kernels.cu"
    assert (kit / "src" / "kit_kernel.inc").read_text() in tree.read_text()


def test_rehearsal_matches_truth(kit):
    """No network, the system's bcc libraries hidden: the kit's entry loads
    with the kit's libbcc_bpf, and every per-block count of the traced CPU
    path equals the driver's truth (driver.py compares; the verdict line)."""
    r = subprocess.run([str(KIT_DIR / "rehearse.sh"), str(kit)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    verdict = [l for l in r.stdout.splitlines() if l.startswith("verdict:")]
    assert verdict and verdict[0].startswith("verdict: PASS on the CPU path"), r.stdout
    assert f"BPF program from {kit / 'bpf-entry.json'}" in r.stderr, r.stderr
    assert "3 USDT probes in libkvtrace_kit_ops.so" in r.stderr, r.stderr


def test_kit_fits_one_device_call(kit):
    """The repository's tracked files and the kit under the 64 MiB a call carries."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.split(b"\0")
    repo = sum((ROOT / p.decode()).stat().st_size for p in tracked
               if p and (ROOT / p.decode()).is_file())
    manifest = {line.split()[1]: int(line.split()[0])
                for line in (kit / "MANIFEST").read_text().splitlines()}
    on_disk = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file()) - \
        (kit / "MANIFEST").stat().st_size
    assert sum(manifest.values()) == on_disk
    assert repo + on_disk < DEVICE_CARRY_LIMIT, (repo, on_disk)


@pytest.mark.parametrize("field,value,says", [
    ("cflags", ["-DKVTRACE_MAX_BLOCKS=64"], "compiled for other options"),
    ("kernel", "6.1.0-fc", "compiled for kernel 6.1.0-fc"),
    ("bpf", "0" * 64, "another bpf/"),
])
def test_pinned_entry_checked(kit, tmp_path, field, value, says):
    """An entry made for other flags, another kernel version or another
    program is refused with one line (exit 2), never loaded."""
    entry = json.loads((kit / "bpf-entry.json").read_text())
    entry["built_for"][field] = value
    bad = tmp_path / "entry.json"
    bad.write_text(json.dumps(entry))
    r = run_kvtrace("attach", "-q", "--", "true",
                    env=dict(os.environ, KVTRACE_PROGRAM_ENTRY=str(bad)))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "KVTRACE_PROGRAM_ENTRY" in lines[0] and says in lines[0], lines


def test_pinned_entry_writable_by_others(kit, tmp_path):
    bad = tmp_path / "entry.json"
    bad.write_bytes((kit / "bpf-entry.json").read_bytes())
    bad.chmod(0o666)
    r = run_kvtrace("attach", "-q", "--", "true",
                    env=dict(os.environ, KVTRACE_PROGRAM_ENTRY=str(bad)))
    assert r.returncode == 2, r.stderr
    assert "writable by others" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pinned_entry_not_a_program(tmp_path, bpf_env):
    bad = Path(tmp_path / "entry.json")
    bad.write_text('{"format": 3}')
    r = run_kvtrace("attach", "-q", "--", "true",
                    env=dict(os.environ, KVTRACE_PROGRAM_ENTRY=str(bad)))
    assert r.returncode == 2, r.stderr
    assert "is not a compiled program" in r.stderr and len(r.stderr.strip().splitlines()) == 1
