"""Unit tests of tracer/probes/sdt.py and discover.py: SDT argument decoding and USDT note
reading.  No BPF, no root.

Expected probe locations come from binutils (readelf, nm), never from
pyelftools through the code under test.
"""

import os
import re
import shutil
import subprocess

import pytest

from tracer import abi
from tracer.probes import discover, sdt
from tracer.errors import TargetError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_DIR = os.path.join(REPO, "tests", "target")
LIB = os.path.join(TARGET_DIR, "libkvsim_ops.so")
LIB_NOPROBES = os.path.join(TARGET_DIR, "libkvsim_ops-noprobes.so")

ALL_PROBES = {"reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
              "cpu_attn_reshape_and_cache", "copy_blocks", "swap_blocks",
              "swap_blocks_batch", "block_table",
              # the plugin tier's, which kvsim fires from its scheduler
              "block_alloc", "block_hit", "block_cache", "block_free", "block_evict",
              "request", "req_preempt", "req_finish", "step_reqs", "step_rows"}

# The kernel's x86_64 struct pt_regs (arch/x86/include/asm/ptrace.h), in
# order, 8 bytes each: the BPF side reads argument registers at these offsets.
PT_REGS_FIELDS = ["r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8",
                  "ax", "cx", "dx", "si", "di", "orig_ax", "ip", "cs", "flags",
                  "sp", "ss"]
PT_REGS = {name: 8 * i for i, name in enumerate(PT_REGS_FIELDS)}

U64 = 2**64
CONST, REG, DEREF, TENSOR_DATA, TENSOR_SIZE = 0, 1, 2, 3, 4  # enum kvtrace_arg_kind
TENSOR_STRIDE, STACK_DATA, STACK_SIZE, STACK_STRIDE = 5, 6, 7, 8


# -- parse_sdt_arg -----------------------------------------------------------

def test_arg_kind_values_match_header():
    # the numbers below are the ones in bpf/kvtrace.h, written by hand
    assert abi.ARG_KINDS == {"const": CONST, "reg": REG, "reg_deref": DEREF,
                             "tensor_data": TENSOR_DATA, "tensor_size": TENSOR_SIZE,
                             "tensor_stride": TENSOR_STRIDE, "stack_tensor_data": STACK_DATA,
                             "stack_tensor_size": STACK_SIZE,
                             "stack_tensor_stride": STACK_STRIDE}
    # the BPF side maps a stack kind to its register twin by subtraction
    assert STACK_DATA - TENSOR_DATA == STACK_SIZE - TENSOR_SIZE == STACK_STRIDE - TENSOR_STRIDE


@pytest.mark.parametrize("reg,field", [
    ("rax", "ax"), ("eax", "ax"), ("ax", "ax"), ("al", "ax"),
    ("rbx", "bx"), ("ebx", "bx"), ("bl", "bx"),
    ("rcx", "cx"), ("ecx", "cx"), ("cl", "cx"),
    ("rdx", "dx"), ("edx", "dx"), ("dx", "dx"),
    ("rsi", "si"), ("esi", "si"), ("si", "si"), ("sil", "si"),
    ("rdi", "di"), ("edi", "di"), ("di", "di"), ("dil", "di"),
    ("rbp", "bp"), ("ebp", "bp"), ("rsp", "sp"),
    ("r8", "r8"), ("r8d", "r8"), ("r8w", "r8"), ("r8b", "r8"),
    ("r9", "r9"), ("r10d", "r10"), ("r11", "r11"), ("r12", "r12"),
    ("r13w", "r13"), ("r14", "r14"), ("r15b", "r15"),
])
def test_register_operand(reg, field):
    spec = sdt.parse_sdt_arg(f"8@%{reg}")
    assert (spec.kind, spec.reg_off, spec.val_off) == (REG, PT_REGS[field], 0)


@pytest.mark.parametrize("text,size,signed,bitshift", [
    ("8@%rax", 8, False, 0),
    ("-8@%rax", 8, True, 0),
    ("4@%eax", 4, False, 32),
    ("-4@%eax", 4, True, 32),
    ("2@%ax", 2, False, 48),
    ("1@%al", 1, False, 56),
    ("-1@%al", 1, True, 56),
])
def test_size_and_signedness(text, size, signed, bitshift):
    spec = sdt.parse_sdt_arg(text)
    # bitshift = 64 - 8 * size: the BPF side shifts left then right by it
    assert (spec.size, spec.is_signed, spec.bitshift) == (size, signed, bitshift)


@pytest.mark.parametrize("text,value,size,signed", [
    ("4@$5", 5, 4, False),
    ("-4@$-3", U64 - 3, 4, True),  # stored two's complement in a u64
    ("8@$0", 0, 8, False),
    ("8@$0x10", 16, 8, False),
])
def test_immediate(text, value, size, signed):
    spec = sdt.parse_sdt_arg(text)
    assert (spec.kind, spec.reg_off, spec.val_off, spec.size, spec.is_signed) == \
        (CONST, 0, value, size, signed)


@pytest.mark.parametrize("text,field,disp", [
    ("8@-24(%rbp)", "bp", U64 - 24),
    ("8@(%rsi)", "si", 0),
    ("8@0x10(%rax)", "ax", 16),
    ("-4@8(%rsp)", "sp", 8),
    ("8@-0x18(%r12)", "r12", U64 - 0x18),
])
def test_memory_operand(text, field, disp):
    spec = sdt.parse_sdt_arg(text)
    assert (spec.kind, spec.reg_off, spec.val_off) == (DEREF, PT_REGS[field], disp)


@pytest.mark.parametrize("text", [
    "8@0x10(%rip)",          # rip-relative: needs the load address
    "8@foo(%rip)",           # symbolic rip-relative
    "8@(%rax,%rbx,8)",       # scaled index
    "8@16(%rax,%rcx,4)",
    "8@%fs:0x28",            # segment override
    "8@%xmm0",               # not a general-purpose register
    "8@%r7",                 # no such register
    "3@%rax",                # no such size
    "%rax",                  # no size at all
    "8@$sym",                # symbolic immediate
    "",
    "garbage",
])
def test_unsupported_forms_rejected(text):
    with pytest.raises(ValueError):
        sdt.parse_sdt_arg(text)


@pytest.mark.parametrize("reg", ["ah", "bh", "ch", "dh"])
def test_high_byte_registers_rejected(reg):
    # bits 8..15 cannot be expressed as (reg_off, bitshift): must be refused
    with pytest.raises(ValueError):
        sdt.parse_sdt_arg(f"1@%{reg}")


# -- independent view of an ELF file: binutils -------------------------------

def _run(*argv):
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C"}).stdout


def _need(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")


def _load_segments(path):
    """[(offset, vaddr, filesz)] of PT_LOAD, from `readelf -lW`."""
    segs = []
    for line in _run("readelf", "-lW", path).splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    assert segs, f"readelf found no LOAD segment in {path}"
    return segs


def _file_offset(segs, vaddr):
    hits = [off + vaddr - va for off, va, size in segs if va <= vaddr < va + size]
    assert len(hits) == 1, f"{vaddr:#x} in {len(hits)} segments"
    return hits[0]


def _readelf_notes(path):
    """{name: (pc, semaphore, args)} of provider vllm, from `readelf -n`;
    pc adjusted by .stapsdt.base as the SystemTap note format specifies."""
    text = _run("readelf", "-n", path)
    base_addr = None
    for line in _run("readelf", "-SW", path).splitlines():
        m = re.search(r"\]\s+\.stapsdt\.base\s+\S+\s+([0-9a-f]+)", line)
        if m:
            base_addr = int(m.group(1), 16)
    notes = {}
    for prov, name, loc, base, sem, args in re.findall(
            r"Provider: (\S+)\s+Name: (\S+)\s+Location: (0x[0-9a-f]+), "
            r"Base: (0x[0-9a-f]+), Semaphore: (0x[0-9a-f]+)\s+Arguments: ?([^\n]*)", text):
        if prov != "vllm":
            continue
        pc = int(loc, 16)
        if base_addr is not None and int(base, 16):
            pc += base_addr - int(base, 16)
        notes[name] = (pc, int(sem, 16), args.strip())
    return notes


def _nm_semaphores(path):
    """{probe name: address of vllm_<name>_semaphore}, from `nm`."""
    out = {}
    for line in _run("nm", "--defined-only", path).splitlines():
        m = re.fullmatch(r"([0-9a-f]+) \w vllm_(\w+)_semaphore", line.strip())
        if m:
            out[m.group(2)] = int(m.group(1), 16)
    return out


def _check_against_binutils(path, expected_names):
    _need("readelf")
    _need("nm")
    notes = _readelf_notes(path)
    sems = _nm_semaphores(path)
    segs = _load_segments(path)
    assert set(notes) == expected_names  # the test's own premise

    probes = sdt.read_probes(path)
    assert sorted(p.name for p in probes) == sorted(expected_names)
    for p in probes:
        pc, sem, args = notes[p.name]
        assert p.provider == "vllm" and p.path == path
        assert p.vaddr == pc
        assert p.offset == _file_offset(segs, pc)
        assert p.sem_vaddr == sem == sems[p.name]  # note and symbol agree
        assert p.sem_offset == _file_offset(segs, sems[p.name])
        assert p.args == args
        assert p.arg_error == ""
        assert len(p.arg_specs) == len(args.split())


@pytest.fixture(scope="module")
def kvsim_lib():
    if not (os.path.exists(LIB) and os.path.exists(LIB_NOPROBES)):
        r = subprocess.run(["make", "-s", "-C", TARGET_DIR], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot build tests/target: {r.stderr.strip()[-300:]}")
    return LIB


def test_read_probes_kvsim_lib(kvsim_lib):
    _check_against_binutils(kvsim_lib, ALL_PROBES)


def test_read_probes_kvsim_lib_noprobes(kvsim_lib):
    assert sdt.read_probes(LIB_NOPROBES) == []


def test_read_probes_other_provider(kvsim_lib):
    assert sdt.read_probes(kvsim_lib, provider="not_vllm") == []


TINY_C = r"""
#include <stdint.h>
#include "kvtrace_probes.h"

int main(int argc, char **argv)
{
	int64_t slots[2] = {0, 17};
	int64_t pairs[2] = {1, 2};
	(void)slots; (void)pairs;
	if (KVTRACE_ENABLED(reshape_and_cache))
		KVTRACE_RESHAPE_AND_CACHE(slots, argc, 16, (uint64_t)(uintptr_t)argv, 8);
	if (KVTRACE_ENABLED(copy_blocks))
		KVTRACE_COPY_BLOCKS(pairs, argc, 4096, (uint64_t)(uintptr_t)argv);
	return 0;
}
"""


def _compile(tmp_path, name, *flags, source=TINY_C):
    _need("gcc")
    src = tmp_path / "tiny.c"
    src.write_text(source)
    out = tmp_path / name
    r = subprocess.run(["gcc", "-O2", f"-I{abi.BPF_DIR}", *flags, "-o", str(out), str(src)],
                       capture_output=True, text=True)
    if r.returncode:
        if "sdt.h" in r.stderr:
            pytest.skip("<sys/sdt.h> missing (systemtap-sdt-dev)")
        pytest.fail(f"gcc failed: {r.stderr}")
    return str(out)


# -no-pie: link-time addresses differ from file offsets (0x40xxxx vs 0x1xxx),
# so an identity "conversion" would be caught; -pie keeps them equal in .text.
@pytest.mark.parametrize("pie", ["-no-pie", "-pie"])
def test_read_probes_tiny_program(tmp_path, pie):
    path = _compile(tmp_path, "tiny", pie)
    _check_against_binutils(path, {"reshape_and_cache", "copy_blocks"})


def test_tiny_program_with_probes_disabled(tmp_path):
    path = _compile(tmp_path, "tiny-off", "-DKVTRACE_DISABLE_PROBES")
    _need("readelf")
    assert "stapsdt" not in _run("readelf", "-n", path)  # premise
    assert sdt.read_probes(path) == []


def test_elf_without_probes(tmp_path):
    path = _compile(tmp_path, "plain", source="int main(void) { return 0; }\n")
    assert sdt.read_probes(path) == []


@pytest.mark.parametrize("content", [b"", b"hello, not an ELF\n", b"\x7fELF",
                                     b"\x7fELF\x02\x01\x01" + b"\0" * 9])
def test_non_elf_raises_target_error(tmp_path, content):
    path = tmp_path / "junk"
    path.write_bytes(content)
    with pytest.raises(TargetError):
        sdt.read_probes(str(path))


def test_missing_file_raises_target_error(tmp_path):
    with pytest.raises(TargetError, match="no such file"):
        sdt.read_probes(str(tmp_path / "absent.so"))


def test_directory_raises_target_error(tmp_path):
    with pytest.raises(TargetError, match="directory"):
        sdt.read_probes(str(tmp_path))


def test_corrupt_note_raises_target_error(tmp_path, kvsim_lib):
    _need("readelf")
    data = bytearray(open(kvsim_lib, "rb").read())
    # the first stapsdt note's pc: section offset + 12-byte header + "stapsdt\0"
    m = re.search(r"\.note\.stapsdt\s+NOTE\s+[0-9a-f]+\s+([0-9a-f]+)",
                  _run("readelf", "-SW", kvsim_lib))
    pc_at = int(m.group(1), 16) + 12 + 8
    data[pc_at:pc_at + 8] = (0xDEAD0000).to_bytes(8, "little")
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    with pytest.raises(TargetError):
        sdt.read_probes(str(bad))


# -- entry_offset ------------------------------------------------------------

def test_entry_offset_bin_true():
    _need("readelf")
    exe = os.path.realpath("/bin/true")
    m = re.search(r"Entry point address:\s+(0x[0-9a-f]+)", _run("readelf", "-hW", exe))
    expected = _file_offset(_load_segments(exe), int(m.group(1), 16))
    assert sdt.entry_offset(exe) == expected


def test_entry_offset_non_elf(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    assert sdt.entry_offset(str(script)) is None


# -- runtime_address (pure arithmetic over parsed maps) -----------------------

def test_runtime_address():
    maps = [discover.Mapping(0x7f0000000000, 0x7f0000001000, "r--p", 0, 1, "/lib/a.so"),
            discover.Mapping(0x7f0000001000, 0x7f0000003000, "r-xp", 0x1000, 1, "/lib/a.so"),
            discover.Mapping(0x7f0000010000, 0x7f0000011000, "r-xp", 0x1000, 2, "/lib/b.so")]
    assert discover.runtime_address(maps, "/lib/a.so", 0x1328) == 0x7f0000001328
    assert discover.runtime_address(maps, "/lib/a.so", 0x10) == 0x7f0000000010
    assert discover.runtime_address(maps, "/lib/b.so", 0x1004) == 0x7f0000010004
    assert discover.runtime_address(maps, "/lib/a.so", 0x3000) is None  # past the end
    assert discover.runtime_address(maps, "/lib/c.so", 0x1000) is None
