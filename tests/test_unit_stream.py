"""tracer/stream.py: raw perf records -> ops with their index values (pure logic).

The records are built here with the layouts of bpf/kvtrace.h, as the BPF
program sends them: chunks of up to KVTRACE_CHUNK values, then the op record.
"""

import numpy as np
import pytest

from tracer import abi, stream


class Wire:
    """Builds raw records the way the BPF program sends them."""

    def __init__(self):
        self.ops, self.hdrs, self.values = [], [], []
        self.seq = 0

    def op(self, name, values=(), items=None, flags=0, drop_chunks=(), pid=7, cache_id=99,
           send_op=True, ts=None):
        values = np.asarray(values, dtype=np.int64)
        seq = self.seq
        self.seq += 1
        sent = 0
        for n, at in enumerate(range(0, len(values), abi.CHUNK)):
            part = values[at:at + abi.CHUNK]
            if n in drop_chunks:
                flags |= abi.EV_CHUNKS_LOST
                continue
            h = np.zeros(1, stream.CHUNK_HDR)
            h["type"], h["count"], h["seq"], h["offset"] = stream.REC_CHUNK, len(part), seq, at
            self.hdrs.append(h.tobytes())
            self.values.append(part.tobytes())
            sent += 1
        if items is None:
            items = len(values) // (2 if name in ("copy_blocks", "swap_blocks") else 1)
        e = np.zeros(1, stream.EVENT)
        e["type"], e["seq"], e["op"], e["items"] = stream.REC_OP, seq, abi.OPS[name], items
        e["chunks"], e["flags"], e["pid"], e["cache_id"] = sent, flags, pid, cache_id
        e["ts_ns"] = 1000 * seq if ts is None else ts
        e["slots"] = int((values >= 0).sum()) if name in abi.WRITE_OPS else 0
        if send_op:
            self.ops.append(e.tobytes())
        return seq

    def batch(self):
        return stream.RawBatch(b"".join(self.ops), b"".join(self.hdrs), b"".join(self.values))


def test_layouts_come_from_the_header():
    # the C compiler's layout: 8-byte fields aligned, the record type first
    assert stream.EVENT.names[0] == "type" and stream.CHUNK_HDR.names[0] == "type"
    assert stream.EVENT.itemsize % 8 == 0
    assert stream.CHUNK_HDR.itemsize == 24
    assert stream.EVENT.fields["seq"][1] == 8


def test_values_are_reassembled_per_op_in_order():
    w = Wire()
    big = np.arange(200) - 3  # four chunks, three padding values at the front
    w.op("reshape_and_cache", big)
    w.op("copy_blocks", [5, 6, 7, 8])
    w.op("swap_blocks_batch", items=3)  # no index values streamed
    w.op("reshape_and_cache_flash", [10, -1])
    s = stream.decode(w.batch())
    assert s.complete and s.orphan_chunks == 0
    assert list(s.ops["seq"]) == [0, 1, 2, 3]
    assert np.array_equal(s.values_of(0), big)
    assert list(s.values_of(1)) == [5, 6, 7, 8]
    assert len(s.values_of(2)) == 0
    assert list(s.values_of(3)) == [10, -1]


def test_interleaved_cpus_and_batches():
    """Records of different CPUs arrive interleaved, and an op's chunks may
    be split across batches (polls): order by seq and offset, not arrival."""
    w = Wire()
    a = np.arange(130)
    b = np.arange(1000, 1070)
    w.op("reshape_and_cache", a)
    w.op("reshape_and_cache", b)
    # shuffle: chunks of b first, then a's last chunk, op records reversed
    hdrs, vals = w.hdrs, w.values
    first = stream.RawBatch(w.ops[1], hdrs[3] + hdrs[4] + hdrs[2], vals[3] + vals[4] + vals[2])
    second = stream.RawBatch(w.ops[0], hdrs[1] + hdrs[0], vals[1] + vals[0])
    s = stream.decode([first, second])
    assert s.complete
    assert np.array_equal(s.values_of(0), a) and np.array_equal(s.values_of(1), b)


def test_lost_chunks_mark_the_op_incomplete():
    w = Wire()
    w.op("reshape_and_cache", np.arange(300), drop_chunks=(2,))
    w.op("reshape_and_cache", np.arange(10))
    s = stream.decode(w.batch())
    assert list(s.ops["complete"]) == [False, True]
    assert not s.complete


def test_a_chunk_missing_without_the_kernel_flag_is_still_caught():
    """Belt and braces: the values that arrived must add up to the items."""
    w = Wire()
    w.op("reshape_and_cache", np.arange(100))
    w.hdrs.pop(1)
    w.values.pop(1)
    s = stream.decode(w.batch())
    assert not s.ops["complete"][0]


def test_truncated_and_unreadable_ops_are_incomplete():
    w = Wire()
    w.op("reshape_and_cache", np.arange(10), items=20, flags=abi.EV_TRUNCATED)
    w.op("reshape_and_cache", [], items=5, flags=abi.EV_READ_ERROR)
    assert not stream.decode(w.batch()).ops["complete"].any()


def test_chunks_of_a_lost_op_record_are_orphans():
    w = Wire()
    w.op("reshape_and_cache", np.arange(70), send_op=False)
    w.op("reshape_and_cache", np.arange(5))
    s = stream.decode(w.batch())
    assert len(s.ops) == 1 and s.ops["complete"][0]
    assert s.orphan_chunks == 2 and s.orphan_values == 70
    assert not s.complete


def test_collector_sorts_raw_records():
    import ctypes

    w = Wire()
    w.op("reshape_and_cache", np.arange(70))
    c = stream.Collector()
    records = [w.hdrs[0] + w.values[0], w.hdrs[1] + w.values[1], w.ops[0],
               b"\x09\x00\x00\x00" + b"\x00" * 20]  # an unknown type
    for rec in records:
        buf = ctypes.create_string_buffer(rec + b"\0\0\0\0")  # perf pads to 8 bytes
        c.add(ctypes.addressof(buf), len(rec) + 4)
    assert (c.op_records, c.chunk_records, c.unknown_records) == (1, 2, 1)
    s = stream.decode(c.take())
    assert np.array_equal(s.values_of(0), np.arange(70))
    assert c.take().empty


def test_step_numbers_count_write_ops_before():
    w = Wire()
    for name in ("swap_blocks", "reshape_and_cache", "reshape_and_cache", "copy_blocks",
                 "reshape_and_cache"):
        w.op(name, [1, 2] if name.endswith("blocks") else [3])
    s = stream.decode(w.batch())
    assert list(stream.step_numbers(s.ops)) == [0, 0, 1, 2, 2]


def test_inconsistent_input_is_refused():
    w = Wire()
    w.op("reshape_and_cache", np.arange(10))
    b = w.batch()
    with pytest.raises(ValueError):
        stream.decode(stream.RawBatch(b.ops, b.chunk_hdrs, b.values[:-8]))
