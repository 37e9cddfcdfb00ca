"""Trace files: written while tracing (record, attach -o), read by report/export.

Format (docs/trace-format.md): a 16-byte file header, then frames appended
as tracing goes.  Each frame has its own header with a checksum of itself
and one of its payload, so a reader keeps every frame up to the first one
that is cut short or damaged, and says where and why it stopped.

    file header   b"KVTRACE\\0", u32 version, u32 0
    frame         b"KVTF", u32 kind, u64 length, u32 crc32(payload),
                  u32 crc32(the 20 header bytes before it), payload
    kinds         META (JSON), BATCH (raw stream records), END (JSON)

The first frame is the trace's META "trace" document (host, kernel, record
layouts...).  BATCH payloads are three u64 lengths followed by the raw op
records, chunk headers and int64 values exactly as tracer/stream.py's
Collector gathered them: slot chunks stay raw int64 arrays, never text.
"""

import ctypes
import json
import mmap
import os
import platform
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import orjson
# zlib-ng's crc32 is zlib's CRC-32 (the file format's checksum, unchanged)
# with the CPU's carry-less multiply: 1.5 -> 8.7 GB/s on this VM, where
# checking a 1.16 GB trace was 0.41 s of every report, on both CPUs,
# before anything else could start
from zlib_ng.zlib_ng import crc32

from .. import __version__, abi
from ..errors import DataError
from ..files import IsNotRegular, open_private, open_regular
from ..kernel import records
from . import stream

MAGIC = b"KVTRACE\0"
VERSION = 1
_FILE_HDR = struct.Struct("<8sII")
_FRAME_MAGIC = b"KVTF"
_FRAME = struct.Struct("<4sIQI")  # then u32 crc32 of these 20 bytes
_FRAME_SIZE = _FRAME.size + 4
_BATCH = struct.Struct("<QQQ")
KIND_META, KIND_BATCH, KIND_END = 1, 2, 3
_MAX_FRAME = 1 << 40


def dtype_doc(dt: np.dtype) -> dict:
    """A record layout as JSON, so that a file decodes by its own layout."""
    return {"names": list(dt.names), "formats": [dt.fields[n][0].str for n in dt.names],
            "offsets": [dt.fields[n][1] for n in dt.names], "itemsize": dt.itemsize}


def dtype_of(doc: dict) -> np.dtype:
    return np.dtype({k: doc[k] for k in ("names", "formats", "offsets", "itemsize")})


def build_id(path: str):
    """The GNU build-id of an ELF file, as hex; None if it has none."""
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            for sec in ELFFile(f).iter_sections():
                if sec.header.sh_type == "SHT_NOTE":
                    for note in sec.iter_notes():
                        if note["n_type"] == "NT_GNU_BUILD_ID":
                            return note["n_desc"]
    except Exception:  # not our file to judge: no build-id is an answer
        return None
    return None


def trace_meta(target: dict) -> dict:
    u = os.uname()
    return {
        "format": "kvtrace-bpf trace", "version": VERSION, "tracer_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_monotonic_ns": time.monotonic_ns(),  # the clock of ts_ns
        "host": socket.gethostname(), "kernel": f"{u.sysname} {u.release} {u.version}",
        "machine": platform.machine(), "target": target,
        "layouts": {"event": dtype_doc(records.EVENT), "chunk_hdr": dtype_doc(records.CHUNK_HDR)},
        "chunk_values": abi.CHUNK, "ops": {str(v): k for k, v in abi.OPS.items()},
        "event_flags": {"truncated": abi.EV_TRUNCATED, "read_error": abi.EV_READ_ERROR,
                        "chunks_lost": abi.EV_CHUNKS_LOST, "swap_out": abi.EV_SWAP_OUT,
                        "swap_in": abi.EV_SWAP_IN},
    }


def _doc_bytes(doc: dict) -> bytes:
    """A document frame's payload: its JSON, padded with spaces (JSON's own
    whitespace, which any reader skips) to a multiple of 8 bytes.  The file
    header, the frame headers and a batch's parts are multiples of 8 too, so
    every batch's values lie at a multiple of 8 in the file, and a reader
    takes them where they lie (stream.decode's lying_in): no copy."""
    text = json.dumps(doc).encode()
    return text + b" " * (-len(text) % 8)


class TraceWriter:
    """Appends frames to a new trace file (mode 0600), unbuffered: what was
    written survives the writer being killed."""

    def __init__(self, path: str, meta: dict):
        self.path = path
        self._f = open_private(path, binary=True)
        self.bytes = 0
        self._write(_FILE_HDR.pack(MAGIC, VERSION, 0))
        self.frame(KIND_META, _doc_bytes({"kind": "trace", **meta}))

    def _write(self, data: bytes):
        self._f.write(data)
        self.bytes += len(data)

    def frame(self, kind: int, *parts: bytes):
        """One frame whose payload is the parts, written without joining them."""
        crc = 0
        for p in parts:
            crc = crc32(p, crc)
        head = _FRAME.pack(_FRAME_MAGIC, kind, sum(len(p) for p in parts), crc)
        self._write(head + struct.pack("<I", crc32(head)))
        for p in parts:
            self._write(p)

    def meta(self, kind: str, doc: dict):
        self.frame(KIND_META, _doc_bytes({"kind": kind, **doc}))

    def batch(self, b: records.RawBatch):
        if not b.empty:
            self.frame(KIND_BATCH, _BATCH.pack(len(b.ops), len(b.chunk_hdrs), len(b.values)),
                       b.ops, b.chunk_hdrs, b.values)

    def end(self, doc: dict):
        self.frame(KIND_END, _doc_bytes({"kind": "end", **doc}))

    def close(self):
        self._f.close()


@dataclass
class Trace:
    """What a reader found in a trace file, up to its first damage."""

    path: str
    meta: dict
    metas: list = field(default_factory=list)  # META documents after the first
    batches: list = field(default_factory=list)  # records.RawBatch
    end: dict = None  # the END document, if the writer got that far
    damage: str = None  # why reading stopped early, if it did
    intact_bytes: int = 0
    data: object = None  # the file's bytes (its mapping), which the batches are views of
    room: object = None  # the mapping with room after the file (tracefile._map), if any
    _ops: stream.OpStream = None

    @property
    def ops(self) -> stream.OpStream:
        if self._ops is None:
            layouts = self.meta["layouts"]
            # the values where they lie in the file, where the writer put them
            # at multiples of 8 (every file of this writer; older ones are
            # copied)
            if self.room is not None:
                lying_in = np.frombuffer(self.room, stream.VALUE, len(self.room) // 8)
                room_at = len(self.room) // 2 // 8  # its second half (_map_with_room)
            else:
                lying_in = None if self.data is None else \
                    np.frombuffer(self.data, stream.VALUE, len(self.data) // 8)
                room_at = None
            self._ops = stream.decode(self.batches, dtype_of(layouts["event"]),
                                      dtype_of(layouts["chunk_hdr"]), lying_in, room_at)
        return self._ops

    def let_go_of_pages(self):
        """Drop this process's mapping of the file's pages (MADV_DONTNEED on
        the file's shared mapping; the room after it, private memory, is
        left as it is): a read after maps them again from the page cache, so
        nothing is lost.  For the end of a report, in a thread while the
        output is written: the kernel's unmapping of a large trace at exit
        was on the report's clock.  A no-op
        where the file is not mapped with room, or madvise fails."""
        if self.room is None or self.data is None:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            libc.madvise(_address_of(self.room), len(self.data) // mmap.PAGESIZE * mmap.PAGESIZE,
                         _MADV_DONTNEED)
        except (OSError, AttributeError, ValueError, BufferError):
            pass

    def latest(self, kind: str) -> list:
        return [m for m in self.metas if m["kind"] == kind]

    @property
    def caches(self) -> list:
        """Every cache (layer) seen: pid, cache_id, index, op, block_size, num_blocks."""
        seen = {}
        for m in self.latest("caches"):
            for c in m["caches"]:
                seen[(c["pid"], c["cache_id"])] = c
        return sorted(seen.values(), key=lambda c: (c["pid"], c["index"]))

    @property
    def processes(self) -> dict:
        """pid -> the latest "process" document (comm, cmdline, probe files)."""
        return {m["pid"]: m for m in self.latest("process")}

    @property
    def groups(self) -> list:
        """Every KV-cache group whose reads were seen: pid, group_id, index,
        block_size, num_blocks (none in a trace from before reads)."""
        seen = {}
        for m in self.latest("groups"):
            for g in m["groups"]:
                seen[(g["pid"], g["group_id"])] = g
        return sorted(seen.values(), key=lambda g: (g["pid"], g["index"]))

    def layers(self) -> dict:
        """(pid, cache_id) -> layer number: order of first appearance in the
        process, as in the live view and attach --json."""
        out, per_pid = {}, {}
        for c in self.caches:
            n = per_pid.get(c["pid"], 0)
            out[(c["pid"], c["cache_id"])] = n
            per_pid[c["pid"]] = n + 1
        return out

    def block_sizes(self) -> dict:
        return {(c["pid"], c["cache_id"]): c["block_size"] for c in self.caches
                if c["block_size"]}

    @property
    def complete(self) -> bool:
        return self.damage is None


def _map(f):
    """(the file's bytes, mapped rather than read; the mapping with room
    after them, or None).  Batches are views of the mapping (no copy), and
    the pages are the page cache's, not this process's heap.  A file that
    cannot be mapped (empty, or on a file system without mmap) is read whole.
    The pages are mapped as the checksums first read them, on every CPU
    (_checksums), not all at once by MAP_POPULATE in this thread, which
    was slower once the checksums ran on every CPU (with them on one CPU,
    MAP_POPULATE had been cheaper than a fault per page)."""
    try:
        return _map_with_room(f)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ), None
    except (ValueError, OSError):
        return f.read(), None


def _map_with_room(f):
    """_map()'s answer, the file mapped read-only at the start of a private
    anonymous mapping with as many bytes again after it (reserved, not
    committed: MAP_NORESERVE; only what is written is memory), so that decode
    can leave every op's values where they lie in the file and copy the few
    that two batches split to just after it (stream.decode's lying_in).
    Freeing the anonymous mapping (when nothing holds a view of it any more)
    unmaps the file too."""
    size = os.fstat(f.fileno()).st_size
    if not size:
        raise ValueError("an empty file")
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    room = mmap.mmap(-1, 2 * span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = _address_of(room)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    got = libc.mmap(addr, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED,
                    f.fileno(), 0)
    if got != addr:
        room.close()
        raise OSError(ctypes.get_errno(), "mmap MAP_FIXED failed")
    return memoryview(room)[:size], room


def _address_of(mapping: mmap.mmap) -> int:
    """Where a writable mmap lies in this process's memory (Python's mmap
    does not say): a ctypes view made only to learn it, and dropped, so
    that the mapping can still be closed."""
    anchor = ctypes.c_char.from_buffer(mapping)
    addr = ctypes.addressof(anchor)
    del anchor
    return addr


_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000  # Linux's; Python's mmap names neither
_MADV_DONTNEED = 4


def read(path: str) -> Trace:
    """Read a trace file.  A file that is not a trace, or of another version,
    raises DataError; a damaged or cut-short one is read up to the damage,
    which is described in Trace.damage.

    Checksums catch damage; what passes them is still checked against what
    the writer guarantees (the documents' fields and types, the records'
    lengths and bounds: _check_doc, _check_batch) before report or export
    computes anything from it, so that a made-up or mangled file is a
    DataError naming the frame, never a numpy or JSON exception later."""
    try:
        # a regular file only: a named pipe nobody writes to, or /dev/zero,
        # would never end (files.open_regular)
        with open_regular(path) as f:
            data, room = _map(f)
    except IsNotRegular as e:
        what = str(e)
        raise DataError(f"cannot read {path}: " + (
            "Is a directory" if what == "a directory" else f"{what}, not a trace file")) from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    except MemoryError:
        raise DataError(f"cannot read {path}: too large to hold in memory") from None
    if not data:
        raise DataError(f"{path}: empty file, not a trace")
    if len(data) < _FILE_HDR.size or data[:8] != MAGIC:
        if len(data) < _FILE_HDR.size and MAGIC.startswith(data[:8]):
            raise DataError(f"{path}: truncated trace file ({len(data)} bytes, no header)")
        raise DataError(f"{path}: not a kvtrace-bpf trace file")
    _, version, _ = _FILE_HDR.unpack_from(data)
    if version != VERSION:
        raise DataError(f"{path}: trace format version {version}; this kvtrace-bpf "
                        f"reads version {VERSION}")
    pos, trace, layouts = _FILE_HDR.size, None, None
    frames, after = _frames(data, memoryview(data), pos)
    for (pos, kind, payload, crc, nxt), got in zip(frames, _checksums(f[2] for f in frames)):
        if got != crc:
            problem = f"damaged frame at byte {pos} (checksum mismatch)"
            break
        if trace is None and kind != KIND_META:
            problem = f"first frame at byte {pos} is not the trace header"
            break
        try:
            if kind in (KIND_META, KIND_END):
                doc = _json(payload)
                if trace is None:
                    layouts = _check_doc(doc, "trace")
                else:
                    _check_doc(doc, None if kind == KIND_META else "end")
            elif kind == KIND_BATCH:
                batch = _check_batch(payload, *layouts)
                batch.values_at = nxt - len(batch.values)
            else:
                raise ValueError(f"unknown frame kind {kind}")
        except (ValueError, struct.error) as e:
            problem = f"bad frame at byte {pos} ({e})"
            break
        if trace is None:
            trace = Trace(path, doc, data=data, room=room)
        elif kind == KIND_META:
            if doc["kind"] == "trace":
                problem = f"bad frame at byte {pos} (a second trace header)"
                break
            trace.metas.append(doc)
        elif kind == KIND_BATCH:
            trace.batches.append(batch)
        elif kind == KIND_END:
            trace.end = doc
        pos = nxt
        if trace.end is not None and pos < len(data):
            problem = f"unexpected data after the end record at byte {pos}"
            break
    else:
        pos, problem = after
        if problem is None and (trace is None or trace.end is None):
            problem = f"no end record after byte {pos}: the writer stopped early (killed?)"
    if trace is None:
        if len(data) == _FILE_HDR.size:
            problem = "empty trace file (nothing after the file header)"
        raise DataError(f"{path}: {problem}")
    trace.damage, trace.intact_bytes = problem, pos
    return trace


# -- what a frame that passed its checksums must still hold ----------------------
#
# Bounds are those of the writer and the BPF program: the ops' clock is
# CLOCK_MONOTONIC in ns (2**62 ns is 146 years), `seq` counts ops from 0,
# one op streams at most 270336 values (bpf/kvtrace.h: 33 tail calls of
# 8192), one chunk record at most abi.RECORD_VALUES (offsets below 2**20
# keep occupancy's keys apart).  Some are limits of this reader, far beyond a
# real recording, that keep report's arithmetic and memory bounded: ops
# within 2**52 ns (52 days) of the trace's start, so that times x heatmap
# rows fit an int64; layers of at most 2**24 blocks (a per-block array of
# 128 MiB) and 2**20 tokens a block.
_MAX_NS = 1 << 62
_MAX_SEQ = 1 << 62  # a u64 counting ops from 0: one op a ns would take 146 years
MAX_SPAN_NS = 1 << 52
MAX_OP_VALUES = 1 << 20
MAX_BLOCKS = 1 << 24
MAX_BLOCK_SIZE = 1 << 20
_U32, _U64 = (0, (1 << 32) - 1), (0, (1 << 64) - 1)


def _json(payload) -> dict:
    try:
        # orjson first: a quarter of json's time.
        # What it refuses (NaN, an integer beyond 64 bits, a lone surrogate,
        # anything malformed) json reads, or names the fault of
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        doc = None
    try:
        doc = json.loads(bytes(payload)) if doc is None else doc
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("JSON that is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at {e.pos}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        raise ValueError("a JSON document without a kind")
    return doc


def _need(doc, key, types, what, bounds=None, optional=False):
    """doc[key], which must be of types (and within bounds, for numbers)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is not a JSON object")
    if key not in doc and optional:
        return None
    return _typed(doc.get(key), types, f"{what}: {key!r}", bounds)


def _typed(v, types, what, bounds=None):
    # NaN fails the bounds, as infinity does
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if ok and bounds and isinstance(v, (int, float)):
        ok = bounds[0] <= v <= bounds[1]
    if not ok:
        raise ValueError(f"{what} missing, of the wrong type or out of range")
    return v


def _list_of(v, check, what):
    if not isinstance(v, list):
        raise ValueError(f"{what} is not a list")
    for x in v:
        check(x)
    return v


def _check_doc(doc: dict, want: str = None):
    """That a META or END document has what report and export read from it.
    want: "trace" (the first frame), "end", or None (a later META).  For the
    trace header, returns what batches are checked against: the record
    layouts (event, chunk header dtypes) and the trace's start (ns)."""
    kind = doc["kind"]
    if want and kind != want:
        raise ValueError(f"a {kind!r} document where a {want!r} one belongs")
    if kind == "trace":
        _need(doc, "version", int, "trace header", (VERSION, VERSION))
        for key in ("host", "kernel", "created_utc"):
            _need(doc, key, str, "trace header")
        _need(doc, "target", dict, "trace header")
        created = _need(doc, "created_monotonic_ns", int, "trace header", (0, _MAX_NS))
        layouts = _need(doc, "layouts", dict, "trace header")
        return (_layout(layouts.get("event"), records.EVENT, "event"),
                _layout(layouts.get("chunk_hdr"), records.CHUNK_HDR, "chunk_hdr"), created)
    if kind == "process":
        _need(doc, "pid", int, "process", _U32)
        _need(doc, "comm", str, "process")
        _list_of(_need(doc, "cmdline", list, "process"),
                 lambda a: _typed(a, str, "process cmdline"), "cmdline")
        _list_of(_need(doc, "probe_files", list, "process"), lambda f: (
            _need(f, "path", str, "probe file"),
            _need(f, "build_id", (str, type(None)), "probe file")), "probe_files")
        # since parent, tier and probed_ops were added: optional
        _need(doc, "parent", int, "process", _U32, optional=True)
        _need(doc, "tier", str, "process", optional=True)
        _list_of(_need(doc, "probed_ops", list, "process", optional=True) or [],
                 lambda o: _typed(o, str, "probed op"), "probed_ops")
    elif kind == "caches":
        _list_of(_need(doc, "caches", list, "caches"), lambda c: (
            _need(c, "pid", int, "cache", _U32), _need(c, "cache_id", int, "cache", _U64),
            _need(c, "index", int, "cache", _U32), _need(c, "op", str, "cache"),
            _need(c, "block_size", int, "cache", (0, MAX_BLOCK_SIZE)),
            _need(c, "num_blocks", int, "cache", (0, MAX_BLOCKS))), "caches")
    elif kind == "groups":
        _list_of(_need(doc, "groups", list, "groups"), lambda g: (
            _need(g, "pid", int, "group", _U32), _need(g, "group_id", int, "group", _U64),
            _need(g, "index", int, "group", _U32),
            _need(g, "block_size", int, "group", (0, MAX_BLOCK_SIZE)),
            _need(g, "num_blocks", int, "group", (0, MAX_BLOCKS))), "groups")
    elif kind == "end":
        agg = _need(doc, "aggregate", dict, "end record", optional=True)
        if agg is not None:
            _need(agg, "lost_records", int, "end aggregate", _U64, optional=True)
            _need(agg, "duration_s", (int, float, type(None)), "end aggregate",
                  (0, _MAX_NS / 1e9), optional=True)
            _list_of(_need(agg, "inexact_reasons", list, "end aggregate", optional=True)
                     or [], lambda r: _typed(r, str, "inexact reason"),
                     "inexact_reasons")
        stacks = _need(doc, "stacks", dict, "end record", optional=True) or {}
        for frames in stacks.values():
            _list_of(frames, lambda f: _typed(f, str, "stack frame"), "a stack")
    # other kinds: written by a later tracer of the same version; not read


# Fields added to a record after files were written without them: such a
# file still reads (stream.decode leaves them 0; a file from before reads has
# no block_table op, whose fields they are).
_NEWER_FIELDS = {"event": ("rows", "held_tokens")}


def _layout(doc, ours: np.dtype, what: str) -> np.dtype:
    """A record layout from the file: a dtype with at least our fields, each
    an integer of the same kind and size as ours (their offsets may differ)."""
    try:
        dt = dtype_of(doc)
    except (TypeError, ValueError, KeyError, IndexError, RecursionError):
        raise ValueError(f"the {what} layout is not a record layout") from None
    for name in ours.names:
        if name not in (dt.names or ()) and name in _NEWER_FIELDS.get(what, ()):
            continue
        if name not in (dt.names or ()) or dt.fields[name][0] != ours.fields[name][0]:
            raise ValueError(f"the {what} layout lacks {name!r} as {ours.fields[name][0]}")
    if dt.itemsize <= 0 or dt.itemsize > 4096:
        raise ValueError(f"the {what} layout has {dt.itemsize} bytes a record")
    return dt


def _check_batch(payload, event_dt: np.dtype, chunk_dt: np.dtype,
                 created_ns: int) -> records.RawBatch:
    """The batch's three arrays, after checking them against the writer's
    guarantees: whole records of the file's layouts, record types, chunk
    value counts that add up to the values, offsets and times in bounds."""
    n_ops, n_hdr, n_val = _BATCH.unpack_from(payload)
    if _BATCH.size + n_ops + n_hdr + n_val != len(payload):
        raise ValueError("batch lengths disagree")
    if n_ops % event_dt.itemsize or n_hdr % chunk_dt.itemsize or n_val % 8:
        raise ValueError("a batch array is not a whole number of records")
    a, b = _BATCH.size + n_ops, _BATCH.size + n_ops + n_hdr
    # views of the file's mapping, not copies (read() keeps the mapping)
    batch = records.RawBatch(payload[_BATCH.size:a], payload[a:b], payload[b:])
    ev = np.frombuffer(batch.ops, dtype=event_dt)
    hdr = np.frombuffer(batch.chunk_hdrs, dtype=chunk_dt)
    if np.any(ev["type"] != records.REC_OP) or np.any(hdr["type"] != records.REC_CHUNK):
        raise ValueError("a record of the wrong type")
    if np.any(ev["seq"] >= _MAX_SEQ) or np.any(hdr["seq"] >= _MAX_SEQ):
        raise ValueError("an op sequence number beyond the counter's range")
    ts = ev["ts_ns"]
    if np.any(ts >= _MAX_NS) or np.any(np.abs(ts.astype(np.int64) - created_ns) >= MAX_SPAN_NS):
        raise ValueError(f"an op time {MAX_SPAN_NS // 10**9 // 86400} days or more from the "
                         "trace's start")
    count = hdr["count"].astype(np.int64)
    if np.any(count < 1) or np.any(count > abi.RECORD_VALUES):
        raise ValueError("a chunk record with an impossible value count")
    if np.any(hdr["offset"] > MAX_OP_VALUES - count.astype(np.uint64)):
        raise ValueError("a chunk offset beyond what one op can stream")
    if int(count.sum()) * 8 != n_val:
        raise ValueError("chunk headers and values disagree in length")
    return batch


def _frames(data, view, pos) -> tuple:
    """([(position, kind, payload, its checksum, next position)], (where
    they end, the problem there or None)): the frames whose headers are
    intact, from pos on; their payloads are not checked here."""
    frames = []
    while pos < len(data):
        if len(data) - pos < _FRAME_SIZE:
            return frames, (pos, f"truncated at byte {pos} (a frame header cut short)")
        magic, kind, length, crc = _FRAME.unpack_from(data, pos)
        (head_crc,) = struct.unpack_from("<I", data, pos + _FRAME.size)
        if magic != _FRAME_MAGIC or crc32(data[pos:pos + _FRAME.size]) != head_crc:
            return frames, (pos, f"damaged frame header at byte {pos}")
        start = pos + _FRAME_SIZE
        if length > _MAX_FRAME or start + length > len(data):
            return frames, (pos, f"truncated at byte {len(data)} (a frame of {length} bytes "
                                 f"at byte {pos} is cut short)")
        frames.append((pos, kind, view[start:start + length], crc, start + length))
        pos = start + length
    return frames, (pos, None)


def _checksums(payloads) -> list:
    """crc32 of each payload, in order, on every CPU the process may use:
    zlib-ng lets go of the GIL for a large buffer, as zlib does, and the
    checksums were most of reading a large trace."""
    return stream.on_cpus(crc32, payloads)


def reuse_freed_memory():
    """Have glibc's malloc keep freed memory and serve large arrays from it.

    Analysing a trace makes many temporaries of hundreds of MiB.  By
    default glibc gives each allocation over 32 MiB its own mmap and unmaps
    it when freed, so the next one faults in pages the kernel must zero
    again: clear_page was 30% of `report`'s time on a 1.1 GB trace, and
    system time 40%.  Taking every
    allocation from the heap, and trimming it only past 2 GiB free, lets a
    freed array's pages serve the next one.  For the short-lived offline
    commands only: the heap's high-water mark is held until exit.  A no-op
    where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # an int: a larger value would wrap
    mallopt(-4, 0)  # M_MMAP_MAX: no mmap'd chunks
    mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: keep up to 2 GiB free at the heap's top
    mallopt(-2, 1 << 30)  # M_TOP_PAD: grow the heap 1 GiB at a time
    # M_ARENA_MAX: every thread's arrays from that one heap.  A thread's own
    # arena is heaps of 64 MiB at most, which the settings above do not
    # reach: a large array there is a fresh mapping each time.  The report's
    # second side ran its passes 2-3 times slower than the main thread did
    # (a large trace's rows_of: 0.35 s in the main thread, 0.8-1.1 s
    # beside).  Set before any thread of the process
    # allocates: a thread takes its arena at its first malloc.
    mallopt(-8, 1)


def no_huge_page_advice():
    """Have numpy stop asking for transparent huge pages, unless the user
    chose (NUMPY_MADVISE_HUGEPAGE, numpy's documented switch, read only at
    its import).

    numpy madvises every array of 4 MiB or more MADV_HUGEPAGE.  Where THP
    is "madvise" (as on this VM), a first touch of such memory then
    takes a huge page, compacting memory for it first if none is free.  On
    this project's VM that costs more than it saves once memory is
    fragmented (after a few large runs): `report --format json` of a
    1.2 GB trace, with and without, alternated 3 times: system time
    15.5/10.6/11.2 -> 7.0/7.3/7.4 s, wall 43.1/38.9/43.7 -> 36.0/40.3/34.0 s,
    the same output; decoding alone 2.7-4.5 s -> 1.0 s in one such phase,
    about equal in another."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    try:  # numpy 2's place, then numpy 1's
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            return
    _set_madvise_hugepage(False)


def load(path: str, partial: bool = False, warn=None) -> Trace:
    """read(), for the CLI: damage is a DataError unless partial, in which
    case the intact prefix is used and warn(message) is told.  The process
    is one that analyses the trace and exits (reuse_freed_memory,
    no_huge_page_advice)."""
    reuse_freed_memory()
    no_huge_page_advice()
    trace = read(path)
    if trace.damage:
        what = (f"{path}: {trace.damage}; {len(trace.batches)} intact batches "
                f"({trace.intact_bytes} bytes) before it")
        if not partial:
            raise DataError(f"{what} (--partial reads them)")
        if warn:
            warn(f"{what}: using those")
    return trace


class Recorder:
    """The tracer's stream consumer that writes a trace file.

    tick() is called from the tracing loop: it takes what the perf callback
    collected and appends it, with any new layers or probe files first, so
    that a reader never sees an op before the cache it writes to.  It writes
    every flush_s, or as soon as flush_bytes are waiting: small, frequent
    writes keep the loop back at the perf buffer quickly (a 10 MiB batch
    held it long enough for the buffer to overflow under kvsim's stress
    workload)."""

    def __init__(self, path: str, tracer, target: dict, flush_s: float = 0.5,
                 flush_bytes: int = 1 << 20):
        self.tracer = tracer
        self.path = path
        # why the file stopped being written (a full disk, an I/O error), if
        # it did: the tracing goes on, what was written stays readable with
        # --partial, and the CLI names it at the end (exit 5)
        self.error = None
        self.writer = None
        self.flush_s, self.flush_bytes = flush_s, flush_bytes
        self._next = time.monotonic() + flush_s
        self._caches = {}
        self._groups = {}
        self._procs = {}
        self._guard(lambda: setattr(self, "writer", TraceWriter(path, trace_meta(target))))

    def _guard(self, fn):
        if self.error is not None:
            return
        try:
            fn()
        except OSError as e:
            self.error = f"cannot write {self.path}: {e.strerror or e}" + (
                f" (recording stopped after {self.writer.bytes / 2**20:.1f} MiB)"
                if self.writer else "")
            if self.writer is not None:
                try:
                    self.writer.close()
                except OSError:
                    pass

    def _describe(self):
        for pid, p in self.tracer.procs.items():
            files = sorted(p.probe_files)
            # parent, tier and probed ops too: report shows and writes them
            # as attach does (the END record's copy is lost with a killed
            # writer)
            what = (p.comm, files, p.parent, p.tier, p.probed_ops)
            if self._procs.get(pid) != what:
                self._procs[pid] = what
                self.writer.meta("process", {
                    "pid": pid, "comm": p.comm, "cmdline": _cmdline(pid),
                    "probe_files": [{"path": f, "build_id": build_id(f)} for f in files],
                    "parent": p.parent, "tier": p.tier, "probed_ops": what[4]})
        new = []
        for k, v in self.tracer.bpf["caches"].items():
            c = {"pid": k.pid, "cache_id": k.cache_id, "index": v.index,
                 "op": abi.OP_NAMES.get(v.op, str(v.op)), "block_size": v.block_size,
                 "num_blocks": v.num_blocks}
            if self._caches.get((k.pid, k.cache_id)) != c:
                self._caches[(k.pid, k.cache_id)] = c
                new.append(c)
        if new:
            self.writer.meta("caches", {"caches": new})
        new = []
        for k, v in self.tracer.bpf["groups"].items():
            g = {"pid": k.pid, "group_id": k.group_id, "index": v.index,
                 "block_size": v.block_size, "num_blocks": v.num_blocks,
                 "leader": v.leader}  # the layer (cache id) whose calls read
            if self._groups.get((k.pid, k.group_id)) != g:
                self._groups[(k.pid, k.group_id)] = g
                new.append(g)
        if new:
            self.writer.meta("groups", {"groups": new})

    def tick(self, force: bool = False):
        now = time.monotonic()
        if not force and now < self._next and \
                self.tracer.stream.pending_bytes < self.flush_bytes:
            return
        self._next = now + self.flush_s
        batch = self.tracer.stream.take()  # taken first: its caches exist by now
        if self.error is None:  # after a failed write, taken and dropped
            self._guard(lambda: (self._describe(), self.writer.batch(batch)))

    def finish(self, aggregate_doc: dict, stacks: dict):
        """After detach and drain: the rest, then the END document."""
        self.tick(force=True)
        c = self.tracer.stream
        self._guard(lambda: self.writer.end(
            {"aggregate": aggregate_doc, "stacks": stacks,
             "records": {"op": c.op_records, "chunk": c.chunk_records,
                         "unknown": c.unknown_records}}))
        self._guard(lambda: self.writer.close())


def _cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []
