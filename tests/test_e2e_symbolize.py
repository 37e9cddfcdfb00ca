"""Stack symbolization through bcc's symbolizer in a child process
(tracer/symbolize.py): bcc 0.26 closes a file descriptor it never opened
while it builds a process's symbol cache, and in the tracer that was
stderr.  Addresses are checked against the ELF file's own symbols, read
here with pyelftools."""

import os

import pytest
from elftools.elf.elffile import ELFFile

from conftest import Kvsim
from tracer.kernel.symbolize import Symbolizer

LIB = "libkvsim_ops.so"


def address_of(pid: int, name: str) -> int:
    """Where function `name` of LIB is in pid's memory: its symbol's address,
    moved by where the file's first mapping lies (the library's load base)."""
    with open(f"/proc/{pid}/maps") as f:
        maps = [line.split() for line in f]
    mine = [m for m in maps if len(m) >= 6 and os.path.basename(m[5]) == LIB]
    path, base = mine[0][5], min(int(m[0].split("-")[0], 16) for m in mine)
    with open(path, "rb") as f:
        [sym] = ELFFile(f).get_section_by_name(".dynsym").get_symbol_by_name(name)
        return base + sym["st_value"]


@pytest.fixture
def sim(tmp_path):
    s = Kvsim(tmp_path, "default")
    yield s
    s.kill()


def test_names_functions_as_the_elf_file_does(sim):
    symbolizer = Symbolizer()
    try:
        for name in ("kv_attention", "kv_copy_blocks", "kv_block_event"):
            addr = address_of(sim.pid, name)
            assert symbolizer.sym(addr, sim.pid, show_module=True) == \
                f"{name} [{LIB}]".encode()
            assert symbolizer.sym(addr + 4, sim.pid) == name.encode()  # inside it
        assert symbolizer.sym(8, sim.pid) == b"[unknown]"  # mapped by nothing
        child = symbolizer._child
        assert os.getsid(child.pid) != os.getsid(0)  # Ctrl-C to the tracer spares it
    finally:
        symbolizer.close()
    assert child.poll() is not None  # gone with its input


def test_a_symbolizer_that_died_leaves_the_rest_unknown(sim):
    symbolizer = Symbolizer()
    try:
        addr = address_of(sim.pid, "kv_attention")
        assert symbolizer.sym(addr, sim.pid) == b"kv_attention"
        symbolizer._child.kill()
        symbolizer._child.wait()
        assert symbolizer.sym(addr, sim.pid) == b"[unknown]"
        assert symbolizer.sym(addr, sim.pid) == b"[unknown]"  # and it stays so
    finally:
        symbolizer.close()
