"""The patched vLLM sources compiled here (no GPU), for every release of
scripts/vllm-releases.txt: whole translation units by nvcc and g++, their
probes as `kvtrace-bpf probes` reads them, and a driver that calls the
fork's probe sites, traced for real against the driver's own ground truth.
tests/fork/Makefile says what is compiled how.

What needs only g++ (the CPU op, the CUDA sites' host code, the driver and
its real-BPF trace) is built and tested wherever g++ is: `make setup` brings
g++ and the torch headers.  Only the three nvcc checks (the whole
cache_kernels.cu, the nvcc build of the sites, the bare nvcc) need the CUDA
toolkit, which `make setup` does not install: they skip without nvcc, and
say so."""

import json
import re
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from conftest import assert_matches_truth, run_kvtrace
from fork import DEPS, DRIVER_DIR, RELEASES, nvcc, out_dir, patched_tree

pytestmark = pytest.mark.slow

# The probe ABI (bpf/kvtrace_probes.h): argument sizes, signed < 0.
SLOT_ARGS = [8, -8, -8, 8, -8]      # slots*, num_tokens, block_size, cache_id, num_blocks
ARG_SIZES = {
    "reshape_and_cache": SLOT_ARGS,
    "reshape_and_cache_flash": SLOT_ARGS,
    "concat_and_cache_mla": SLOT_ARGS,
    "cpu_attn_reshape_and_cache": SLOT_ARGS,
    "copy_blocks": [8, -8, -8, 8],          # pairs*, num_pairs, bytes_per_block, cache_id
    "swap_blocks": [8, -8, -8, -8, 8],      # ... direction, cache_id
    "swap_blocks_batch": [8, 8, 8, -8],     # src*, dst*, sizes*, count
    # table*, row_stride, num_reqs, seq_lens*, block_size, group_id, num_blocks, layer_id
    "block_table": [8, -8, -8, 8, -8, 8, -8, 8],
}
CUDA_OPS = {"reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
            "copy_blocks", "swap_blocks", "swap_blocks_batch"}
LINE = re.compile(r"^\s+vllm:(\w+)\s+(0x[0-9a-f]+)\s+(sem (0x[0-9a-f]+)|no semaphore)\s+(.*)$")


def make_fork(release, target, nvcc_path="nvcc-not-used"):
    """tests/fork/Makefile's target for one release (minutes the first time)."""
    assert (DEPS / "torch-cpu").is_dir(), "run make setup (it unpacks the torch headers)"
    tree = patched_tree(release)
    out = out_dir(release)
    r = subprocess.run(["make", "-j2", "-C", str(DRIVER_DIR), f"SRC={tree}", f"DEPS={DEPS}",
                        f"OUT={out}", f"NVCC={nvcc_path}", target],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.fixture(scope="module")
def built_cpu(release):
    """What needs only g++: never skipped (a missing g++ or header fails)."""
    return make_fork(release, "cpu")


@pytest.fixture(scope="module")
def built(release, built_cpu):
    """Everything, the nvcc builds included."""
    if nvcc() is None:
        pytest.skip("nvcc not found: the CUDA toolkit is not installed by make setup "
                    "(the g++ builds and the traced driver run without it)")
    return make_fork(release, "all", nvcc())


def listed_probes(path):
    """`kvtrace-bpf probes PATH`, parsed: [(name, offset, sem_offset, args)]."""
    r = run_kvtrace("probes", path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(path)
    probes = []
    for line in lines[1:]:
        m = LINE.match(line)
        assert m, f"unexpected line {line!r}"
        assert "cannot decode" not in line, line
        probes.append((m[1], int(m[2], 16), int(m[4], 16) if m[4] else None, m[5].split()))
    return probes


def semaphore_file_offsets(path):
    """vllm_*_semaphore symbols, as file offsets, from the symbol table."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        segs = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        out = {}
        for sym in elf.get_section_by_name(".symtab").iter_symbols():
            m = re.fullmatch(r"vllm_(\w+)_semaphore", sym.name)
            if m:
                seg = next(s for s in segs
                           if s["p_vaddr"] <= sym["st_value"] < s["p_vaddr"] + s["p_memsz"])
                out[m[1]] = sym["st_value"] - seg["p_vaddr"] + seg["p_offset"]
        return out


def containing_function(path, offset):
    """The demangled name of the function whose code holds file offset."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        seg = next(s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"
                   and s["p_offset"] <= offset < s["p_offset"] + s["p_filesz"])
        vaddr = offset - seg["p_offset"] + seg["p_vaddr"]
        names = [s.name for s in elf.get_section_by_name(".symtab").iter_symbols()
                 if s["st_info"]["type"] == "STT_FUNC"
                 and s["st_value"] <= vaddr < s["st_value"] + s["st_size"]]
    assert len(names) == 1, (offset, names)
    return subprocess.run(["c++filt"], input=names[0], capture_output=True, text=True,
                          check=True).stdout.strip()


def check_probes(path, want_ops):
    probes = listed_probes(path)
    assert {name for name, *_ in probes} == want_ops
    sems = semaphore_file_offsets(path)
    for name, _, sem, args in probes:
        assert sem == sems[name], f"{name}: semaphore is not vllm_{name}_semaphore"
        assert [int(a.split("@")[0]) for a in args] == ARG_SIZES[name], (name, args)
    return probes


def test_bare_nvcc_needs_the_cmake_defines(built):
    """A bare nvcc of cache_kernels.cu with the include paths finds every
    header and stops only at what vLLM's CMake defines: the C shim's CUDA
    stream API (USE_CUDA) and the fp8 conversions (ENABLE_FP8)."""
    log = (built / "bare-nvcc.log").read_text()
    assert not log.rstrip().endswith("exit 0"), log
    errors = [l for l in log.splitlines() if ": error" in l]
    assert errors, log
    assert not [l for l in log.splitlines() if "cannot open source file" in l], log
    shim = [l for l in errors if "aoti_torch_get_current_cuda_stream" in l
            or "torch_get_current_cuda_blas_handle" in l]
    fp8 = [l for l in errors if "fp8::scaled_vec_conversion" in l or '"vllm::fp8"' in l]
    assert shim and fp8, errors
    # the rest are follow-on errors of the same fp8 call (same file and line)
    fp8_lines = {l.split(": error")[0] for l in fp8}
    assert all(l in shim or l.split(": error")[0] in fp8_lines for l in errors), errors


def test_cache_kernels_probes(built):
    """The whole cache_kernels.cu, compiled by nvcc: the six CUDA-side probes,
    each with its own semaphore and the ABI's argument sizes."""
    lib = built / "libvllm_cache_kernels.so"
    probes = check_probes(lib, CUDA_OPS)
    # one site per probe: the slot ops' sites are shared by their launch paths
    assert sorted(name for name, *_ in probes) == sorted(CUDA_OPS)
    # each site lies in the patch's site function (kvtrace_cuda_sites.h), the
    # code the driver runs, or, inlined, in the op's own host function
    for name, offset, *_ in probes:
        helper = "swap_blocks" if name == "copy_blocks" else name
        func = containing_function(lib, offset)
        assert (func.startswith(f"void kvtrace::{helper}<torch::stable::Tensor>(")
                or func.startswith(f"kvtrace::{helper}(")  # not a template: no return type
                or func.startswith(f"{helper}(torch::stable::Tensor")), (name, func)


def test_cpu_attn_probes(built_cpu):
    """The whole cpu_attn.cpp, compiled by g++ as vLLM's CPU build does: the
    write probe and the read probe, each in its op's host function."""
    lib = built_cpu / "libvllm_cpu_attn.so"
    sites = {name: offset for name, offset, *_ in
             check_probes(lib, {"cpu_attn_reshape_and_cache", "block_table"})}
    assert containing_function(lib, sites["cpu_attn_reshape_and_cache"]).startswith(
        "cpu_attn_reshape_and_cache(at::Tensor")
    assert containing_function(lib, sites["block_table"]).startswith(
        "cpu_attention_with_kv_cache(at::Tensor")


def test_cuda_sites_probes(built):
    check_probes(built / "libfork_cuda_sites.so", CUDA_OPS)


def test_cuda_sites_host_build_probes(built_cpu):
    """The same sites' host code by g++ (what the driver calls): the six
    probes, their semaphores and argument sizes, without a CUDA toolkit."""
    check_probes(built_cpu / "libfork_cuda_sites_host.so", CUDA_OPS)


def test_driver_untraced_writes_the_cache(built_cpu, tmp_path):
    """Without a tracer the probes stay off and vLLM's CPU op still works."""
    truth = tmp_path / "truth.json"
    r = subprocess.run([str(built_cpu / "fork_driver"), "--truth", str(truth)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(truth.read_text())
    assert doc["kv_checksum_ok"] is True
    assert doc["ops"]["cpu_attn_reshape_and_cache"]["slots"] > 0


def test_driver_traced_matches_truth(built_cpu, tmp_path, no_leftovers):
    """Real BPF, a real process: every per-block count of the seven probes
    against the driver's own ground truth."""
    out = tmp_path / "agg.json"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", built_cpu / "fork_driver",
                    "--truth", truth_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "target exited"
    assert doc["target_exit_status"] == 0   # the real CPU op wrote the KV values
    truth = json.loads(truth_path.read_text())
    assert all(o["calls"] > 0 for o in truth["ops"].values()), truth["ops"]
    assert_matches_truth(doc, truth)
