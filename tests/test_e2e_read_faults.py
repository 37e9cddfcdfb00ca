"""A slot array that the BPF program cannot wholly read: its tail lies in a
page the target has not touched yet, which bpf_probe_read_user() cannot
fault in.  The slot stages read a record's chunks in one call; when that
faults they read chunk by chunk, so every whole chunk ahead of the fault
is counted and the op is marked a read error (docs/design.md).  The target
is libkvsim_ops.so driven through ctypes, so the test places the array."""

import ctypes
import mmap
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

pytestmark = pytest.mark.usefixtures("no_leftovers")

LIB = ROOT / "tests" / "target" / "libkvsim_ops.so"
CHUNK = 64  # values per chunk read (bpf/kvtrace.h KVTRACE_CHUNK)

# The target: one layer of 64 blocks of 16 slots; n slot numbers placed so
# that the first `readable` lie at the end of a touched page and the rest in
# the next page, never touched before the op.  It prints the slots of the
# touched page, waits for a line, runs the op, then waits for EOF.
TARGET = r"""
import ctypes, mmap, sys
readable, n = int(sys.argv[2]), int(sys.argv[3])
lib = ctypes.CDLL(sys.argv[1])
class Layer(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_void_p), ("block_size", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("kv_bytes_per_token", ctypes.c_int64)]
kv = ctypes.create_string_buffer(64 * 16 * 8)
layer = Layer(ctypes.addressof(kv), 16, 64, 8)
pages = mmap.mmap(-1, 2 * mmap.PAGESIZE)  # private, anonymous: no page present yet
base = ctypes.addressof(ctypes.c_char.from_buffer(pages))
start = base + mmap.PAGESIZE - 8 * readable
slots = [(7 * i + 3) % (64 * 16) for i in range(readable)]
ctypes.memmove(start, (ctypes.c_int64 * readable)(*slots), 8 * readable)  # page 1 only
values = (ctypes.c_uint64 * n)()
print(" ".join(map(str, slots)), flush=True)
sys.stdin.readline()
lib.kv_write_slots(0, ctypes.byref(layer), ctypes.c_void_p(start), ctypes.c_int64(n), values)
print("done", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("readable, n", [(300, 600), (700, 800)])
def test_chunks_ahead_of_a_fault_count_and_the_op_is_a_read_error(readable, n):
    from tracer.probes import discover
    from tracer.kernel.session import Tracer

    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(LIB), str(readable), str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tracer = None
    try:
        slots = [int(s) for s in proc.stdout.readline().split()]
        assert len(slots) == readable
        tracer = Tracer(max_procs=4)
        assert tracer.attach(proc.pid, discover.process_probe_files(proc.pid, stock=False))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        tracer.detach()
        tracer.drain()
        raw = tracer.read_maps()
    finally:
        if tracer is not None:
            tracer.close()
        proc.kill()
        proc.wait()
    counted = readable // CHUNK * CHUNK  # the whole chunks in the touched page
    expected = np.bincount(np.array(slots[:counted]) // 16, minlength=64)
    (layer,) = [c for c in raw["caches"] if c["pid"] == proc.pid]
    assert layer["writes"][:64].tolist() == expected.tolist()
    assert layer["writes"][64:].sum() == 0
    stats = raw["op_stats"][(proc.pid, "reshape_and_cache")]
    assert (stats["calls"], stats["read_errors"], stats["slots"]) == (1, 1, counted)
