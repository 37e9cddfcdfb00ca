"""Trace files (tracer/tracefile.py): round trip, damage, versions, the CLI's
one-line errors.  Pure Python: files are written with TraceWriter from
records built here in the layouts of bpf/kvtrace.h."""

import json
import mmap
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from conftest import ROOT, assert_one_line_error, run_kvtrace
from tracer import abi
from tracer.analysis import occupancy
from tracer.trace import stream, tracefile
from tracer.kernel import records
from tracer.errors import DataError

EXIT_DATA = 4
PID, CACHE_ID, BS = 4242, 99, 16


def synthetic_ops(nops, per_op, blocks, t0=10**9, seq0=0, op="reshape_and_cache",
                  cache_id=CACHE_ID, slot0=None):
    """nops write ops of per_op slots each, slots cycling through `blocks`
    blocks in order from slot0 (default: where op seq0 of one stream of
    such ops would be), as raw records (vectorized: no loop per chunk)."""
    ev = np.zeros(nops, records.EVENT)
    nch = -(-per_op // abi.CHUNK)
    ev["type"], ev["seq"] = records.REC_OP, seq0 + np.arange(nops)
    ev["ts_ns"] = t0 + 1000 * np.arange(nops)
    ev["pid"], ev["tid"], ev["op"], ev["cache_id"] = PID, PID, abi.OPS[op], cache_id
    ev["items"] = ev["slots"] = per_op
    ev["chunks"], ev["stack_id"] = nch, -1
    hdr = np.zeros(nops * nch, records.CHUNK_HDR)
    hdr["type"], hdr["seq"] = records.REC_CHUNK, np.repeat(ev["seq"], nch)
    off = np.tile(np.arange(nch) * abi.CHUNK, nops)
    hdr["offset"], hdr["count"] = off, np.minimum(abi.CHUNK, per_op - off)
    first = seq0 * per_op if slot0 is None else slot0
    slots = (first + np.arange(nops * per_op, dtype=np.int64)) % (blocks * BS)
    return records.RawBatch(ev.tobytes(), hdr.tobytes(), slots.tobytes())


def write_trace(path, batches, blocks=512, end=True, cache_ids=(CACHE_ID,)):
    """A trace of pid PID whose caches (layers 0, 1, ... in the order of
    cache_ids) have block size BS."""
    w = tracefile.TraceWriter(str(path), tracefile.trace_meta({"pid": PID}))
    w.meta("process", {"pid": PID, "comm": "synthetic", "cmdline": [], "probe_files": [
        {"path": "/x/libkvsim_ops.so", "build_id": "ab" * 20}]})
    w.meta("caches", {"caches": [{"pid": PID, "cache_id": c, "index": i,
                                  "op": "reshape_and_cache", "block_size": BS,
                                  "num_blocks": blocks} for i, c in enumerate(cache_ids)]})
    for b in batches:
        w.batch(b)
    if end:
        w.end({"aggregate": {"lost_records": 0, "inexact_reasons": [], "duration_s": 1.0},
               "stacks": {}, "records": {}})
    w.close()
    return path


@pytest.fixture
def trace_path(tmp_path):
    # 40 ops of 100 slots in four batches
    return write_trace(tmp_path / "t.kvt", [synthetic_ops(10, 100, 512, seq0=10 * i)
                                            for i in range(4)])


def test_round_trip(trace_path):
    assert oct(os.stat(trace_path).st_mode & 0o777) == "0o600"
    t = tracefile.read(str(trace_path))
    assert t.complete and t.damage is None
    assert t.meta["version"] == tracefile.VERSION and t.meta["host"]
    assert t.processes[PID]["probe_files"][0]["build_id"] == "ab" * 20
    assert t.block_sizes() == {(PID, CACHE_ID): BS} and t.layers() == {(PID, CACHE_ID): 0}
    ops = t.ops
    assert len(ops.ops) == 40 and ops.complete and ops.values_decoded == 4000
    assert np.array_equal(_values_in_order(ops), np.arange(4000) % (512 * BS))
    (key, g), = occupancy.trace_generations(t, PID).items()  # 4000 slots: 250 full blocks
    assert key == (PID, 0) and len(g) == 250 and set(g.fill.tolist()) == {BS}
    assert occupancy.trace_generations(t, PID + 1) == {}


def _values_in_order(ops):
    """Every op's values, op after op (op i's are values[start:stop])."""
    o = ops.ops
    return stream.gather(ops.values, o["start"], o["stop"] - o["start"])


def _split(batch, at_chunk):
    """batch as two batches, its chunk records cut before chunk at_chunk:
    an op whose chunks straddle the cut is split between them, as a poll
    that comes while a program run is sending its records splits it."""
    h = np.frombuffer(batch.chunk_hdrs, records.CHUNK_HDR)
    v = np.frombuffer(batch.values, np.int64)
    cut = int(h["count"][:at_chunk].sum())
    return [records.RawBatch(batch.ops, h[:at_chunk].tobytes(), v[:cut].tobytes()),
            records.RawBatch(b"", h[at_chunk:].tobytes(), v[cut:].tobytes())]


def _three_chunk_ops(tmp_path, name):
    """A trace of 20 ops of three chunks each, op 1's chunks split between
    two batches, and what each op's values must be."""
    per_op = 3 * abi.CHUNK - 5
    batches = _split(synthetic_ops(10, per_op, 512), 4) + \
        [synthetic_ops(10, per_op, 512, seq0=10, t0=2 * 10**9)]
    expected = np.arange(20 * per_op) % (512 * BS)
    write_trace(tmp_path / name, batches)
    return tmp_path / name, expected


def test_values_are_taken_where_they_lie_in_the_file(tmp_path):
    """The writer puts every batch's values at a multiple of 8 in the file
    (its documents padded with JSON's whitespace), and decode leaves them
    there: the ops' values are a view of the file's mapping, not a copy.
    The op that two batches split is copied just past the file, and every
    op's values are what was written."""
    path, expected = _three_chunk_ops(tmp_path, "t.kvt")
    t = tracefile.read(str(path))
    assert all(b.values_at % 8 == 0 for b in t.batches)
    ops = t.ops
    assert ops.complete and len(ops.ops) == 20
    assert np.array_equal(_values_in_order(ops), expected)
    assert not ops.values.flags.owndata and not ops.values.flags.writeable
    in_file = ops.ops["stop"] * 8 <= len(t.data)
    assert in_file.tolist() == [i != 1 for i in range(20)]  # op 1, split, lies past the file
    assert ops.values_decoded == len(expected)


def test_letting_go_of_the_files_pages_loses_no_value(tmp_path):
    """let_go_of_pages drops the file's mapped pages (a read maps them again
    from the page cache) but not the room past the file, where the split
    op's values were copied: every op's values stay what was written."""
    path, expected = _three_chunk_ops(tmp_path, "t.kvt")
    t = tracefile.read(str(path))
    ops = t.ops
    assert len(t.data) > 4 * mmap.PAGESIZE and ops.ops["stop"][1] * 8 > len(t.data)
    t.let_go_of_pages()
    assert np.array_equal(_values_in_order(ops), expected)


def test_a_file_with_values_off_the_8_byte_grid_is_copied(tmp_path, monkeypatch):
    """An older trace (documents not padded: its values lie off multiples
    of 8) is decoded by copying, to the same values."""
    def unpadded(doc):
        text = json.dumps(doc).encode()
        return text + b" " * ((1 - len(text)) % 8)  # one byte past a multiple of 8
    monkeypatch.setattr(tracefile, "_doc_bytes", unpadded)
    path, expected = _three_chunk_ops(tmp_path, "old.kvt")
    t = tracefile.read(str(path))
    assert all(b.values_at % 8 for b in t.batches)
    ops = t.ops
    assert ops.values.flags.owndata and len(ops.values) == len(expected)
    assert ops.complete and np.array_equal(_values_in_order(ops), expected)


def _cut(path, at):
    data = path.read_bytes()
    path.write_bytes(data[:at])
    return len(data)


def _frame_offsets(path):
    """Start of every frame (from the frame headers' lengths)."""
    data, pos, out = path.read_bytes(), 16, []
    while pos < len(data):
        out.append(pos)
        _, _, length, _ = struct.unpack_from("<4sIQI", data, pos)
        pos += 24 + length
    return out


def test_truncated_file_keeps_its_intact_prefix(trace_path):
    frames = _frame_offsets(trace_path)
    # cut in the middle of the 3rd batch (frames: trace, process, caches, 4 batches, end)
    _cut(trace_path, frames[5] + 100)
    t = tracefile.read(str(trace_path))
    assert "truncated" in t.damage
    assert len(t.batches) == 2 and len(t.ops.ops) == 20 and t.ops.complete
    with pytest.raises(DataError, match="truncated.*--partial"):
        tracefile.load(str(trace_path))
    warned = []
    assert len(tracefile.load(str(trace_path), partial=True, warn=warned.append).ops.ops) == 20
    assert warned and "truncated" in warned[0]


def test_cut_at_a_frame_boundary_says_the_end_is_missing(trace_path):
    frames = _frame_offsets(trace_path)
    _cut(trace_path, frames[-1])  # drop exactly the end frame
    t = tracefile.read(str(trace_path))
    assert "no end record" in t.damage and len(t.ops.ops) == 40


@pytest.mark.parametrize("where", ["payload", "header"])
def test_flipped_bytes_are_caught(trace_path, where):
    frames = _frame_offsets(trace_path)
    data = bytearray(trace_path.read_bytes())
    at = frames[4] + (200 if where == "payload" else 10)  # in the 2nd batch
    data[at] ^= 0x40
    trace_path.write_bytes(bytes(data))
    t = tracefile.read(str(trace_path))
    assert "damaged" in t.damage and str(frames[4]) in t.damage
    assert len(t.batches) == 1 and len(t.ops.ops) == 10


def test_wrong_version_and_not_a_trace(tmp_path, trace_path):
    data = bytearray(trace_path.read_bytes())
    struct.pack_into("<I", data, 8, tracefile.VERSION + 1)
    trace_path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"version {tracefile.VERSION + 1}"):
        tracefile.read(str(trace_path))
    other = tmp_path / "other"
    other.write_bytes(b"{}\n")
    with pytest.raises(DataError, match="not a kvtrace-bpf trace file"):
        tracefile.read(str(other))
    short = tmp_path / "short"
    short.write_bytes(tracefile.MAGIC[:5])
    with pytest.raises(DataError, match="truncated trace file"):
        tracefile.read(str(short))
    with pytest.raises(DataError, match="cannot read"):
        tracefile.read(str(tmp_path / "missing"))


@pytest.mark.parametrize("cmd", [("report",), ("export", "--folded")])
def test_cli_damaged_files_one_line_error_exit_4(tmp_path, trace_path, cmd):
    frames = _frame_offsets(trace_path)
    _cut(trace_path, frames[5] + 100)
    assert_one_line_error(run_kvtrace(*cmd, trace_path), EXIT_DATA, "truncated", "--partial")
    r = run_kvtrace(*cmd, trace_path, "--partial")
    assert r.returncode == 0, r.stderr
    assert "truncated" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "v9.kvt"
    data = bytearray(write_trace(tmp_path / "v.kvt", [synthetic_ops(2, 10, 8)]).read_bytes())
    struct.pack_into("<I", data, 8, 9)
    bad.write_bytes(bytes(data))
    assert_one_line_error(run_kvtrace(*cmd, bad), EXIT_DATA, "version 9")
    assert_one_line_error(run_kvtrace(*cmd, tmp_path / "nope"), EXIT_DATA, "cannot read")


def _reframe(kind, payload):
    """A frame with correct checksums around any payload (docs/trace-format.md)."""
    head = struct.pack("<4sIQI", b"KVTF", kind, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.mark.parametrize("bad,words", [
    # chunk headers that promise more values than the batch holds
    (lambda b: b[:24 + int.from_bytes(b[:8], "little") + 4] + (600).to_bytes(4, "little")
     + b[24 + int.from_bytes(b[:8], "little") + 8:], "impossible value count"),
    (lambda b: b"\x01" + b"\x00" * 23, "batch lengths disagree"),
    (lambda b: b"{\"kind\": \"caches\", \"caches\": [{\"pid\": 1}]}", "cache: 'cache_id'"),
    (lambda b: b"[" * 100000, "nested too deeply"),
    (lambda b: b"{\"kind\": \"\xff\"}", "not UTF-8"),
])
def test_checksummed_nonsense_stops_the_reader_at_its_frame(trace_path, bad, words):
    """A frame that passes its checksums but breaks what the writer guarantees
    is damage at that frame: the frames before it stay readable."""
    frames = _frame_offsets(trace_path)
    data = trace_path.read_bytes()
    at, nxt = frames[4], frames[5]  # the 2nd batch
    kind = tracefile.KIND_BATCH if words.startswith(("impossible", "batch")) else \
        tracefile.KIND_META
    trace_path.write_bytes(data[:at] + _reframe(kind, bad(data[at + 24:nxt])) + data[nxt:])
    t = tracefile.read(str(trace_path))
    assert t.damage.startswith(f"bad frame at byte {at}") and words in t.damage, t.damage
    assert len(t.batches) == 1 and len(t.ops.ops) == 10 and t.ops.complete
    with pytest.raises(DataError, match="--partial"):
        tracefile.load(str(trace_path))


def test_data_after_the_end_record_is_damage(trace_path):
    data = trace_path.read_bytes()
    trace_path.write_bytes(data + _reframe(tracefile.KIND_META, b"{\"kind\": \"caches\", "
                                                                b"\"caches\": []}"))
    t = tracefile.read(str(trace_path))
    assert t.damage == f"unexpected data after the end record at byte {len(data)}"
    assert t.end is not None and len(t.ops.ops) == 40


def test_empty_files(tmp_path):
    empty = tmp_path / "empty.kvt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty file, not a trace"):
        tracefile.read(str(empty))
    empty.write_bytes(struct.pack("<8sII", tracefile.MAGIC, tracefile.VERSION, 0))
    with pytest.raises(DataError, match="empty trace file"):
        tracefile.read(str(empty))


def test_garbage_block_numbers_are_left_out_and_said(tmp_path):
    """A target may pass any slot number: one far beyond any layer size is
    counted out of range, sizes no per-block array, and is said."""
    b = synthetic_ops(4, 20, 8)
    values = np.frombuffer(b.values, np.int64).copy()
    values[5] = 2**60  # op 0's 6th slot
    path = write_trace(tmp_path / "g.kvt", [records.RawBatch(b.ops, b.chunk_hdrs,
                                                            values.tobytes())], blocks=8)
    r = run_kvtrace("report", path, "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (layer,) = doc["blocks"]["processes"][0]["layers"]
    assert layer["out_of_range"] == 1 and layer["num_blocks"] == 8
    assert sum(n for _, n in layer["writes"]) == 4 * 20 - 1
    assert doc["blocks"]["exact"] is False
    assert any("out of range" in x or "left out" in x for x in doc["blocks"]["inexact_reasons"])
    r = run_kvtrace("export", "--folded", path, "--by", "block")
    assert r.returncode == 0, r.stderr
    assert "1 block numbers from" in r.stderr
    assert sum(int(line.rsplit(" ", 1)[1]) for line in r.stdout.splitlines()) == 4 * 20 - 1


def test_a_trace_from_before_reads_still_reads():
    """tests/data/before-reads.kvt was recorded (kvsim --workload mla) by the
    tracer as it was before reads (commit 6ac4b6c): its op records lack rows
    and held_tokens and it has no groups.  report and export still read it,
    and its counts are that kvsim's own truth (before-reads.truth.json)."""
    data = os.path.join(os.path.dirname(__file__), "data")
    truth = json.load(open(os.path.join(data, "before-reads.truth.json")))
    trace = tracefile.read(os.path.join(data, "before-reads.kvt"))
    assert trace.complete and "rows" not in trace.meta["layouts"]["event"]["names"]
    assert trace.groups == []
    r = run_kvtrace("report", os.path.join(data, "before-reads.kvt"), "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["access"] == [] and doc["blocks"]["exact"]
    ops = doc["blocks"]["ops"]
    assert {op: {"calls": v["calls"], "slots": v["slots"]} for op, v in ops.items()} == \
        truth["ops"]
    r = run_kvtrace("export", "--folded", os.path.join(data, "before-reads.kvt"),
                    "--by", "block")
    assert r.returncode == 0, r.stderr
    assert sum(int(line.rsplit(" ", 1)[1]) for line in r.stdout.splitlines()) == \
        truth["slots_written"]


@pytest.mark.parametrize("env, advised", [(None, False), ("1", True), ("0", False)])
def test_loading_a_trace_stops_numpys_huge_page_advice_unless_the_user_chose(
        trace_path, env, advised):
    """tracefile.load() turns numpy's MADV_HUGEPAGE off for the offline
    commands (no_huge_page_advice), but a NUMPY_MADVISE_HUGEPAGE the user
    set is theirs to keep.  In a child: the setting is process-wide."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        environ["NUMPY_MADVISE_HUGEPAGE"] = env
    code = ("import sys; from numpy._core.multiarray import _get_madvise_hugepage as get\n"
            "from tracer.trace import tracefile\n"
            "before = get(); tracefile.load(sys.argv[1]); print(before, get())")
    r = subprocess.run([sys.executable, "-c", code, str(trace_path)], env=environ,
                       cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = r.stdout.split()
    assert after == str(advised), r.stdout
    if env is not None:  # numpy read the user's choice at import; load kept it
        assert before == after
