"""tracer/stream.py: raw perf records -> ops with their index values (pure logic).

The records are built here with the layouts of bpf/kvtrace.h, as the BPF
program sends them: chunk records of up to KVTRACE_RECORD_CHUNKS x
KVTRACE_CHUNK values (shorter ones here by default, to make many), then the
op record.
"""

import re
import subprocess

import numpy as np
import pytest

from tracer import abi
from tracer.trace import stream
from tracer.kernel import records


class Wire:
    """Builds raw records the way the BPF program sends them."""

    def __init__(self, per=abi.CHUNK):
        self.ops, self.hdrs, self.values = [], [], []
        self.seq = 0
        self.per = per  # values per chunk record

    def op(self, name, values=(), items=None, flags=0, drop_chunks=(), pid=7, cache_id=99,
           send_op=True, ts=None, fields=None):
        values = np.asarray(values, dtype=np.int64)
        seq = self.seq
        self.seq += 1
        sent = 0
        for n, at in enumerate(range(0, len(values), self.per)):
            part = values[at:at + self.per]
            if n in drop_chunks:
                flags |= abi.EV_CHUNKS_LOST
                continue
            h = np.zeros(1, records.CHUNK_HDR)
            h["type"], h["count"], h["seq"], h["offset"] = records.REC_CHUNK, len(part), seq, at
            self.hdrs.append(h.tobytes())
            self.values.append(part.tobytes())
            sent += 1
        if items is None:
            items = len(values) // (2 if name in ("copy_blocks", "swap_blocks") else 1)
        e = np.zeros(1, records.EVENT)
        e["type"], e["seq"], e["op"], e["items"] = records.REC_OP, seq, abi.OPS[name], items
        e["chunks"], e["flags"], e["pid"], e["cache_id"] = sent, flags, pid, cache_id
        e["ts_ns"] = 1000 * seq if ts is None else ts
        e["slots"] = int((values >= 0).sum()) if name in abi.WRITE_OPS else 0
        for k, v in (fields or {}).items():  # the op's other fields (step_rows')
            e[k] = v
        if send_op:
            self.ops.append(e.tobytes())
        return seq

    def batch(self):
        return records.RawBatch(b"".join(self.ops), b"".join(self.hdrs), b"".join(self.values))


def c_layouts(structs: dict, tmp_path) -> dict:
    """{struct: (sizeof, {field: (offsetof, sizeof)})} as gcc lays out
    bpf/kvtrace.h on this machine: a tiny C program prints them."""
    lines = []
    for name, fields in structs.items():
        lines.append(f'\tprintf("%s %zu\\n", "{name}", sizeof(struct {name}));')
        lines += [f'\tprintf("%s.%s %zu %zu\\n", "{name}", "{f}", '
                  f"offsetof(struct {name}, {f}), sizeof(((struct {name} *)0)->{f}));"
                  for f in fields]
    src = tmp_path / "layout.c"
    src.write_text("#include <linux/types.h>\n#include <stddef.h>\n#include <stdio.h>\n"
                   f'#include "{abi.SHARED_HEADER}"\n\nint main(void)\n{{\n'
                   + "\n".join(lines) + "\n\treturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", "-o", exe, src], check=True,
                   capture_output=True, text=True)
    out = {}
    for line in subprocess.run([exe], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        key, *nums = line.split()
        if "." in key:
            name, field = key.split(".")
            out[name][1][field] = tuple(map(int, nums))
        else:
            out[key] = (int(nums[0]), {})
    return out


def test_layouts_are_the_c_compilers(tmp_path):
    """Every struct of bpf/kvtrace.h that abi.struct_dtype reads (the
    scalar-only ones): its size and every field's offset and size equal
    gcc's, so a record decoded in Python is the record the BPF side wrote."""
    names = re.findall(r"^struct\s+(\w+)\s*\{", abi.SHARED_HEADER.read_text(), re.M)
    handled = {}
    for name in names:
        try:
            handled[name] = abi.struct_dtype(name)
        except RuntimeError:  # arrays or nested structs: bcc's ctypes read those
            continue
    # the records user space decodes without bcc are among them
    assert {"kvtrace_event", "kvtrace_chunk_hdr"} <= set(handled), sorted(handled)
    c = c_layouts({n: dt.names for n, dt in handled.items()}, tmp_path)
    assert set(c) == set(handled)
    for name, dt in handled.items():
        size, fields = c[name]
        assert dt.itemsize == size, name
        assert list(fields) == list(dt.names), name
        for f, (offset, fsize) in fields.items():
            assert (dt.fields[f][1], dt.fields[f][0].itemsize) == (offset, fsize), (name, f)
    assert records.EVENT == handled["kvtrace_event"]
    assert records.CHUNK_HDR == handled["kvtrace_chunk_hdr"]


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


@pytest.mark.parametrize("parallel", [False, True])
def test_interleaved_cpus_and_batches(parallel, monkeypatch):
    """Records of different CPUs arrive interleaved, and an op's chunks may
    be split across batches (polls): order by seq and offset, not arrival.
    parallel: the batches copied on several CPUs, as a large trace's are."""
    monkeypatch.setattr(stream, "_PARALLEL_VALUES", 0 if parallel else 1 << 62)
    w = Wire()
    a = np.arange(130)
    b = np.arange(1000, 1070)
    w.op("reshape_and_cache", a)
    w.op("reshape_and_cache", b)
    # shuffle: chunks of b first, then a's last chunk, op records reversed
    hdrs, vals = w.hdrs, w.values
    first = records.RawBatch(w.ops[1], hdrs[3] + hdrs[4] + hdrs[2], vals[3] + vals[4] + vals[2])
    second = records.RawBatch(w.ops[0], hdrs[1] + hdrs[0], vals[1] + vals[0])
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
    c = records.Collector()
    raw = [w.hdrs[0] + w.values[0], w.hdrs[1] + w.values[1], w.ops[0],
           b"\x09\x00\x00\x00" + b"\x00" * 20]  # an unknown type
    for rec in raw:
        buf = ctypes.create_string_buffer(rec + b"\0\0\0\0")  # perf pads to 8 bytes
        c.add(ctypes.addressof(buf), len(rec) + 4)
    assert (c.op_records, c.chunk_records, c.unknown_records) == (1, 2, 1)
    s = stream.decode(c.take())
    assert np.array_equal(s.values_of(0), np.arange(70))
    assert c.take().empty


def test_collector_takes_records_as_large_as_the_program_sends():
    import ctypes

    w = Wire(per=abi.RECORD_VALUES)
    w.op("reshape_and_cache", np.arange(abi.RECORD_VALUES + 5))
    too_big = np.zeros(1, records.CHUNK_HDR)
    too_big["type"], too_big["count"] = records.REC_CHUNK, abi.RECORD_VALUES + 1
    c = records.Collector()
    for rec in (w.hdrs[0] + w.values[0], w.hdrs[1] + w.values[1], w.ops[0],
                too_big.tobytes() + b"\0" * 8 * (abi.RECORD_VALUES + 1)):
        buf = ctypes.create_string_buffer(rec)
        c.add(ctypes.addressof(buf), len(rec))
    assert (c.op_records, c.chunk_records, c.unknown_records) == (1, 2, 1)
    assert c.pending_bytes > 0
    s = stream.decode(c.take())
    assert s.complete and np.array_equal(s.values_of(0), np.arange(abi.RECORD_VALUES + 5))
    assert c.pending_bytes == 0


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
        stream.decode(records.RawBatch(b.ops, b.chunk_hdrs, b.values[:-8]))


def test_chunks_cover_every_item_whole_in_order():
    # first values 0 2 2 5 14 14 15 16 20: a span begins at the first item
    # starting at or past each multiple of 5 (0, 5, 10, 15), so the 9-value
    # item 3 is a span alone and nothing is split or left out
    lengths = [2, 0, 3, 9, 0, 1, 1, 4, 0]
    assert stream.chunks(lengths, 5) == [(0, 3), (3, 4), (4, 6), (6, 9)]
    assert stream.chunks(lengths, 100) == [(0, 9)]
    assert stream.chunks([0, 0], 5) == [] and stream.chunks([], 5) == []


@pytest.mark.parametrize("mean", [1, 63, 64, 700])
def test_gather_is_the_ranges_values_whichever_way_it_takes(mean):
    # short ranges go through an index, long ones through slices (mean
    # length 64 and up): both must give each range's values in order,
    # empty ranges and ranges out of order included
    rng = np.random.default_rng(mean)
    values = rng.integers(-5, 1 << 40, 200_000, dtype=np.int64)
    lengths = rng.integers(0, 2 * mean + 1, 100)
    lengths[::7] = 0
    starts = rng.integers(0, len(values) - lengths.max(), 100).astype(np.uint64)
    want = np.array([v for a, n in zip(starts.tolist(), lengths.tolist())
                     for v in values[a:a + n].tolist()], np.int64)
    got = stream.gather(values, starts, lengths)
    assert got.dtype == values.dtype and got.tolist() == want.tolist()
    assert len(stream.gather(values, starts[:0], lengths[:0])) == 0
    assert stream.gather(values, starts[:3], [0, 0, 0]).tolist() == []


def test_order_by_is_lexsorts_order():
    # packed into one key where the keys fit (any order at a tie unless
    # stable), lexsort itself where one is negative or they do not fit
    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, m, 5000) for m in (7, 50, 3))
    want = np.lexsort((np.arange(5000), c, b, a))  # ties in their order
    assert stream.order_by(a, b, c, stable=True).tolist() == want.tolist()
    got = stream.order_by(a, b, c)
    keys = np.stack([a, b, c], axis=1)
    assert (keys[got] == keys[want]).all()  # sorted alike, ties in any order
    neg = b - 25
    assert stream.order_by(a, neg, stable=True).tolist() == \
        np.lexsort((np.arange(5000), neg, a)).tolist()
    big = rng.integers(0, 1 << 40, 5000)
    assert stream.order_by(big, big[::-1].copy(), stable=True).tolist() == \
        np.lexsort((np.arange(5000), big[::-1], big)).tolist()
    assert len(stream.order_by(np.zeros(0, np.int64))) == 0
    # a key of one value throughout (an address) orders nothing, and is left
    # out of the packing; keys that all hold one value leave the order as it is
    address = np.full(5000, 140523659390992)
    assert stream.order_by(address, b, big, stable=True).tolist() == \
        np.lexsort((np.arange(5000), big, b)).tolist()
    assert stream.order_by(address, address[:1].repeat(5000), stable=True).tolist() == \
        list(range(5000))


def step_rows_values(rows, tail):
    """A step_rows op's stream: the 5-int64 records, then the tail's int32
    entries two to a word, padded to a whole word (bpf/kvtrace_probes.h)."""
    t = np.asarray(list(tail) + [0] * (len(tail) % 2), dtype="<i4")
    return np.concatenate([np.asarray(rows, dtype=np.int64).reshape(-1),
                           t.view("<i8")]).astype(np.int64)


def test_step_rows_decode_records_and_tails():
    """Two steps of group 1 and one of another process: the records and
    each row's tail, the ops' headers; an op with a lost chunk and one
    whose tails do not add up to its tail count bring no rows."""
    A, B = 0xFFFF_0000_0000_0001, 7  # a hash above 2^63 survives
    w = Wire(per=4)
    f = {"rows": 16, "held_tokens": 1000, "slots": 3}
    w.op("reshape_and_cache", [1, 2])
    w.op("step_rows", step_rows_values([[A - 2**64, 40, 40, 3, 0]], [5, 6, 7]),
         items=1, cache_id=1, fields=f)
    w.op("step_rows", step_rows_values([[A - 2**64, 41, 1, 3, 3], [B, 16, 16, 1, 0]], [9]),
         items=2, cache_id=1, fields={**f, "slots": 1})
    w.op("step_rows", step_rows_values([[B, 5, 5, 2, 0]], [3, 4]), items=1, cache_id=1,
         pid=8, fields={**f, "slots": 2})
    # a chunk lost; and tails of 2 entries where the record says 3
    w.op("step_rows", step_rows_values([[B, 17, 1, 2, 1]] * 3, [8, 8]), items=3,
         cache_id=1, drop_chunks=(1,), fields={**f, "slots": 2})
    w.op("step_rows", step_rows_values([[B, 17, 1, 4, 1]], [8, 9]), items=1, cache_id=1,
         fields={**f, "slots": 2})
    s = stream.decode(w.batch())
    sr = stream.step_rows(s)
    assert list(sr.pos) == [1, 2, 3, 4, 5]
    assert list(sr.complete) == [True, True, True, False, False]
    assert list(sr.lo) == [0, 1, 3, 4, 4, 4]
    assert list(sr.pid) == [7, 7, 8, 7, 7] and list(sr.group) == [1] * 5
    assert list(sr.block_size) == [16] * 5 and list(sr.num_blocks) == [1000] * 5
    assert list(sr.req) == [A, A, B, B] and sr.req.dtype == np.uint64
    assert list(sr.seq_len) == [40, 41, 16, 5] and list(sr.new_tokens) == [40, 1, 16, 5]
    assert list(sr.row_len) == [3, 3, 1, 2] and list(sr.tail_from) == [0, 3, 0, 0]
    assert list(sr.tail_lo) == [0, 3, 3, 4, 6]
    assert sr.tail.dtype == np.int32 and list(sr.tail) == [5, 6, 7, 9, 3, 4]


def test_step_rows_of_a_stream_without_any():
    w = Wire()
    w.op("reshape_and_cache", [1, 2])
    sr = stream.step_rows(stream.decode(w.batch()))
    assert len(sr.pos) == len(sr.req) == len(sr.tail) == 0
    assert list(sr.lo) == [0] and list(sr.tail_lo) == [0]
