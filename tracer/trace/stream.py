"""The per-op stream: raw perf records in, op records with their index arrays out.

The BPF program sends two kinds of record through one perf buffer, told apart
by their first field (bpf/kvtrace.h): one `struct kvtrace_event` per op, and,
with the index stream on, the op's raw index values (slot numbers, or block
pairs) in `struct kvtrace_chunk_hdr` records of up to KVTRACE_CHUNK int64s,
sent before the op record from the same CPU and tied to it by `seq`.

The perf callback's side, `Collector` (kernel/records.py), sorts records
into three flat byte arrays (op records, chunk headers, values) and
nothing more, so the callback stays cheap.  `decode()` here turns such
arrays into an `OpStream` with numpy only: no Python loop per value or per
chunk.

An op is `complete` when every value it should have sent arrived.  Ops whose
chunks were refused by the kernel (counted there, KVTRACE_EV_CHUNKS_LOST),
truncated or unreadable are marked incomplete, never used half.
"""

import math
import os
from dataclasses import dataclass

import numpy as np

from .. import abi
from ..kernel.records import CHUNK_HDR, EVENT, RawBatch

VALUE = np.dtype("<i8")

# ops whose index array is streamed, and how many int64s per item
WRITE_OP_IDS = frozenset(abi.OPS[o] for o in abi.WRITE_OPS)
PAIR_OP_IDS = frozenset((abi.OPS["copy_blocks"], abi.OPS["swap_blocks"]))
TABLE_OP_ID = abi.OPS["block_table"]
LIFE_OP_IDS = frozenset(abi.OPS[o] for o in abi.LIFE_OPS)  # the plugin's block ids
STEP_REQS_OP_ID = abi.OPS["step_reqs"]  # streams requests, then their new tokens
STEP_ROWS_OP_ID = abi.OPS["step_rows"]  # streams row records, then the tails' int32 words
_BAD_FLAGS = abi.EV_TRUNCATED | abi.EV_READ_ERROR | abi.EV_CHUNKS_LOST

# the decoded op table: the op record's fields, then where its values are
OP_TABLE = np.dtype([(name, EVENT.fields[name][0]) for name in EVENT.names
                     if name != "type"] +
                    [("start", "<i8"), ("stop", "<i8"), ("complete", "?")])


@dataclass
class OpStream:
    """Decoded ops, in seq order (the order in which they started).

    `ops` is a structured array (OP_TABLE); op i's index values are
    values[ops['start'][i]:ops['stop'][i]]: slot numbers for write ops (-1
    padding included), src, dst, src, dst... for copy and swap ops."""

    ops: np.ndarray
    values: np.ndarray  # may hold more than the ops' values: a trace file's whole mapping
    orphan_chunks: int = 0  # chunks whose op record never arrived
    orphan_values: int = 0
    value_count: int = None  # the values decoded, the orphans' included (None: len(values))

    def values_of(self, i: int) -> np.ndarray:
        return self.values[self.ops["start"][i]:self.ops["stop"][i]]

    @property
    def complete(self) -> bool:
        return bool(self.ops["complete"].all()) and not self.orphan_chunks

    def select(self, mask) -> "OpStream":
        """The ops where mask holds (values are shared, not copied)."""
        return OpStream(self.ops[mask], self.values, self.orphan_chunks, self.orphan_values,
                        self.value_count)

    @property
    def values_decoded(self) -> int:
        """How many values the records brought, the orphans' included."""
        return len(self.values) if self.value_count is None else self.value_count


def expected_values(ops: np.ndarray) -> np.ndarray:
    """How many index values each op streams when nothing is lost.  A
    block-table op streams each row's seq_len and then its entries, counted
    or not (bpf/kvtrace.h); trace files from before reads have no rows."""
    op = ops["op"]
    items = ops["items"].astype(np.int64)
    per = np.where(np.isin(op, list(WRITE_OP_IDS | LIFE_OP_IDS)), 1,
                   np.where(np.isin(op, list(PAIR_OP_IDS | {STEP_REQS_OP_ID})), 2, 0))
    want = items * per
    # block events with content hashes stream the ids, then as many hashes
    want = np.where((ops["flags"] & abi.EV_HASHES) != 0, 2 * want, want)
    # step_rows: 5 values a row, then its tail's int32 entries (slots) two a word
    want = np.where(op == STEP_ROWS_OP_ID,
                    STEP_ROWS_FIELDS * items + (ops["slots"].astype(np.int64) + 1) // 2, want)
    if "rows" in (ops.dtype.names or ()):
        table = op == TABLE_OP_ID
        want = np.where(table, ops["rows"].astype(np.int64) + items +
                        ops["padding"].astype(np.int64), want)
    return want


def decode(batches, event_dtype=EVENT, chunk_dtype=CHUNK_HDR, lying_in=None,
           room_at: int = None) -> OpStream:
    """Pair chunk records with their op records (numpy only).

    batches: RawBatch objects in arrival order (or one).  Chunk records
    whose op record is missing are counted as orphans and dropped.  The
    dtypes are those of the records (a trace file brings its own).

    lying_in: an int64 view of the buffer that every batch's values lie in
    (a trace file's mapping), each batch's values_at a multiple of 8.  An
    op's chunks that lie one after another there, in their order (nearly
    every op's: a batch is records as they came, and an op's are one program
    run's), are left where they lie, and `values` is that view; the few ops
    whose chunks two batches split are copied to lying_in[room_at:], which
    must be writable and have room for them (else all values are copied).
    The copy of them all was a large trace's size in fresh memory, before
    anything else could start."""
    if isinstance(batches, RawBatch):
        batches = [batches]
    ev = np.frombuffer(b"".join(b.ops for b in batches), dtype=event_dtype)
    hdrs = [np.frombuffer(b.chunk_hdrs, dtype=chunk_dtype) for b in batches]
    hdr = np.concatenate(hdrs) if hdrs else np.zeros(0, chunk_dtype)
    parts = [np.frombuffer(b.values, dtype=VALUE) for b in batches]
    if int(hdr["count"].astype(np.int64).sum()) != sum(len(p) for p in parts):
        raise ValueError("chunk headers and values disagree in length")

    # chunks sorted by (seq, offset), and their values put in that order
    count = hdr["count"].astype(np.int64)
    # by (seq, offset): one stable argsort of the two packed into one integer
    # where they fit, which the chunks' near order makes quick (not
    # np.lexsort's pass per key)
    seq0 = int(hdr["seq"].min()) if len(hdr) else 0
    order = order_by((hdr["seq"] - np.uint64(seq0)).astype(np.int64),
                     hdr["offset"].astype(np.int64), stable=True)
    seq_s, off_s, count_s = hdr["seq"][order], hdr["offset"][order], count[order]
    ends_s = np.cumsum(count_s)
    starts_s = ends_s - count_s
    total = int(ends_s[-1]) if len(ends_s) else 0

    # one group of chunks per seq: where its values are, how many, contiguous?
    # (seq_s is sorted: each group starts where the seq changes, with no
    # second sort, which np.unique's was)
    first = np.flatnonzero(np.r_[True, seq_s[1:] != seq_s[:-1]]) if len(seq_s) else \
        np.zeros(0, np.intp)
    useq = seq_s[first]
    if len(useq):
        g_start = starts_s[first]
        g_count = np.add.reduceat(count_s, first)
        g_chunks = np.diff(np.append(first, len(seq_s)))
        # each chunk's offset must be where the previous one ended
        in_place = off_s.astype(np.int64) == starts_s - np.repeat(g_start, g_chunks)
        g_contig = np.logical_and.reduceat(in_place, first)
    else:
        g_start = g_count = g_chunks = np.zeros(0, np.int64)
        g_contig = np.zeros(0, bool)
    where = _where_they_lie(batches, hdrs, count, order, count_s, first, g_chunks, starts_s,
                            lying_in, room_at) if lying_in is not None else None
    if where is None:
        values = _place(parts, hdrs, count, order, starts_s, total)
    else:
        values, g_start = lying_in[:], where
        values.flags.writeable = False  # a file's values: nothing writes them

    ev = ev[np.argsort(ev["seq"], kind="stable")]
    pos = np.searchsorted(useq, ev["seq"])
    pos_c = np.minimum(pos, max(len(useq) - 1, 0))
    found = (pos < len(useq)) & (useq[pos_c] == ev["seq"]) if len(useq) else \
        np.zeros(len(ev), bool)

    ops = np.zeros(len(ev), dtype=OP_TABLE)
    for name in OP_TABLE.names[:-3]:
        if name in ev.dtype.names:  # an older file's records lack the newer fields
            ops[name] = ev[name]
    want = expected_values(ev)
    got = np.where(found, g_count[pos_c] if len(useq) else 0, 0)
    ops["start"] = np.where(found, g_start[pos_c] if len(useq) else 0, 0)
    ops["stop"] = ops["start"] + got
    chunks_ok = np.where(found, (g_chunks[pos_c] if len(useq) else 0) == ev["chunks"],
                         ev["chunks"] == 0)
    contig = np.where(found, g_contig[pos_c] if len(useq) else True, True)
    ops["complete"] = ((ev["flags"] & _BAD_FLAGS) == 0) & (got == want) & chunks_ok & contig

    matched = np.zeros(len(useq), bool)
    matched[pos_c[found]] = True
    orphan_chunks = int(g_chunks[~matched].sum()) if len(useq) else 0
    orphan_values = int(g_count[~matched].sum()) if len(useq) else 0
    return OpStream(ops, values, orphan_chunks, orphan_values, total)


def _where_they_lie(batches, hdrs, count, order, count_s, first, g_chunks, starts_s,
                    lying_in, room_at):
    """Each seq group's first value's index in lying_in, where its chunks
    lie one after another in (seq, offset) order; a group they do not (an op
    split between two batches) is first copied to the room at room_at.
    None where a batch's values lie elsewhere or the room is too small."""
    at = []
    for b, h, n in zip(batches, hdrs, np.split(count, np.cumsum([len(h) for h in hdrs])[:-1])):
        if b.values_at is None or b.values_at % 8:
            return None
        at.append(b.values_at // 8 + np.cumsum(n) - n)  # each chunk's first value
    at_s = np.concatenate(at)[order] if at else np.zeros(0, np.int64)
    # in place where a group's chunks are as far apart there as in a copy
    shift = at_s - starts_s
    split = np.flatnonzero(shift != np.repeat(shift[first], g_chunks))
    g_at = at_s[first]
    if not len(split):
        return g_at
    g_split = np.unique(np.searchsorted(first, split, side="right") - 1)
    c_first, c_n = first[g_split], g_chunks[g_split]  # their chunks, in order
    chunk = ranges(c_first, c_n)
    n = count_s[chunk]
    need = int(n.sum())
    if room_at is None or not lying_in.flags.writeable or room_at + need > len(lying_in):
        return None
    dest = room_at + np.cumsum(n) - n
    lying_in[ranges(dest, n)] = lying_in[ranges(at_s[chunk], n)]
    g_at[g_split] = dest[np.cumsum(c_n) - c_n]
    return g_at


def _place(parts, hdrs, count, order, starts_s, total) -> np.ndarray:
    """Every batch's values copied once, straight from the batch (a view of
    a trace file's mapping, or the collector's bytes) to their place in
    (seq, offset) order: no joined copy of them all first.  A batch whose
    chunks already follow one another there (the common case: one CPU's
    records in order) is one slice copy.  A trace's batches are copied on
    every CPU the process may use: the copy is mostly the kernel handing
    out fresh pages, which two CPUs do side by side."""
    values = np.empty(total, VALUE)
    dest = np.empty(len(order), np.int64)
    dest[order] = starts_s  # each chunk's place, in arrival order
    first = np.cumsum([0] + [len(h) for h in hdrs])

    def copy(i):
        part, d, n = parts[i], dest[first[i]:first[i + 1]], count[first[i]:first[i + 1]]
        if len(d) and bool(np.all(d[1:] == d[:-1] + n[:-1])):
            values[d[0]:d[0] + len(part)] = part
        elif len(d):
            values[ranges(d, n)] = part

    if total >= _PARALLEL_VALUES:
        on_cpus(copy, range(len(parts)))
    else:
        for i in range(len(parts)):
            copy(i)
    return values


# values from which _place copies on several CPUs: 4M (32 MiB), far above
# what a live interval decodes, where a thread pool's start would cost more
_PARALLEL_VALUES = 1 << 22


def on_cpus(fn, items) -> list:
    """[fn(item) for item in items], in order, on every CPU this process
    may use: for work that lets go of the GIL (numpy's copies, crc32)."""
    items = list(items)
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if workers < 2 or len(items) < 2:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def ranges(starts, lengths) -> np.ndarray:
    """The indices starts[i] .. starts[i] + lengths[i] - 1, for every i in
    order, as one int64 array: the values of several ops (their start and
    count) or rows, gathered without a loop."""
    n = np.asarray(lengths, dtype=np.int64)
    first = np.cumsum(n) - n  # where each range begins in the output
    return np.repeat(np.asarray(starts, dtype=np.int64) - first, n) + np.arange(int(n.sum()))


def gather(values: np.ndarray, starts, lengths) -> np.ndarray:
    """values[ranges(starts, lengths)]: the values of several ops (or rows),
    in order.  Where the ranges are long (a prefill's slot mapping is
    hundreds of slots), one slice each and one concatenate: no index per
    value to build and read back."""
    n = np.asarray(lengths, dtype=np.int64)
    if len(n) and int(n.sum()) >= _LONG_RANGE * len(n) and int(n.min()) >= 0:
        return np.concatenate([values[a:a + k] for a, k in
                               zip(np.asarray(starts, dtype=np.int64).tolist(), n.tolist())])
    return values[ranges(starts, n)]


# the mean length from which gather() takes slices: a slice and its place
# in concatenate's list cost about what 64 values' index does
_LONG_RANGE = 64


def order_by(*keys, stable: bool = False) -> np.ndarray:
    """The order that sorts by keys (integer arrays of one length, the first
    the most significant): np.lexsort(keys[::-1]), by one argsort of the
    keys packed into one integer where they are non-negative and their
    product fits one (lexsort's pass per key took three times as long).
    stable: equal keys keep their order, as lexsort's do; else any order."""
    if not len(keys[0]):
        return np.zeros(0, np.intp)
    # a key that is one value throughout orders nothing (a trace's one process,
    # one KV-cache group: the residency's keys), and leaving it out lets the
    # others pack where with it they would not (a group id is an address)
    bounds = [(int(k.min()), int(k.max())) for k in keys]
    varied = [(k, lo, hi) for k, (lo, hi) in zip(keys, bounds) if lo != hi]
    if not varied:
        return np.arange(len(keys[0]))
    keys = [k for k, _, _ in varied]
    try:
        if any(lo < 0 for _, lo, _ in varied):
            raise ValueError("a negative key")
        dims = [hi + 1 for _, _, hi in varied]
        packed = np.ravel_multi_index(keys, dims)
    except (ValueError, TypeError):  # a negative key, or a product beyond an int64
        return np.lexsort(keys[::-1])
    if stable and math.prod(dims) <= 1 << 16:  # numpy sorts 16 bits by radix
        packed = packed.astype(np.uint16)
    return np.argsort(packed, kind="stable" if stable else None)


def chunks(lengths, per_chunk: int) -> list:
    """[(i0, i1), ...]: consecutive items (ops, rows) of the given lengths in
    spans of about per_chunk values each, items whole (one longer than
    per_chunk is a span of its own), covering every item in order; none
    where there are no values.  For passes that need not hold an array per
    value of a whole trace."""
    n = np.asarray(lengths, dtype=np.int64)
    total = int(n.sum())
    if not total:
        return []
    first = np.cumsum(n) - n  # each item's first value (the first is 0)
    edges = np.unique(np.r_[np.searchsorted(first, np.arange(0, total, per_chunk)), len(n)])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def step_numbers(ops: np.ndarray) -> np.ndarray:
    """Per op of one cache (in seq order), the model step it belongs to: the
    number of write ops of that cache before it.  Every forward step makes
    one write call per layer, so this is a clock that the target shares."""
    is_write = np.isin(ops["op"], list(WRITE_OP_IDS))
    return np.cumsum(is_write) - is_write


def per_cache(o: np.ndarray, mapping: dict, default) -> np.ndarray:
    """mapping[(pid, cache_id)] for every op, without a Python loop per op."""
    pids, pid_inv = np.unique(o["pid"], return_inverse=True)
    caches, cache_inv = np.unique(o["cache_id"], return_inverse=True)
    key = pid_inv.reshape(-1) * len(caches) + cache_inv.reshape(-1)
    table = np.array([mapping.get((int(p), int(c)), default) for p in pids for c in caches]
                     or [default], np.int64)
    return table[key] if len(o) else np.zeros(0, np.int64)


# -- step_rows: each step's rows as deltas (docs/design.md, "Row deltas: step_rows")

STEP_ROWS_FIELDS = 5  # int64s a row record holds: req, seq_len, new_tokens, row_len, tail_from


@dataclass
class StepRows:
    """The step_rows ops of an OpStream, decoded: per op, its place and
    header; per row, its record; per row, its tail (the row's new entries).

    Op k's rows are [lo[k], lo[k+1]); row i's tail is
    tail[tail_lo[i]:tail_lo[i+1]]: req_to_blocks entries [tail_from[i],
    row_len[i]) of that request in that group, block ids, 0 the null block.
    An op that is not `complete` brought no rows (lo[k] == lo[k+1])."""

    pos: np.ndarray         # int64 per op: its index in the OpStream's ops
    pid: np.ndarray         # uint32 per op
    ts_ns: np.ndarray       # uint64 per op
    group: np.ndarray       # int64 per op: vLLM's kv_cache_group_id
    block_size: np.ndarray  # int64 per op
    num_blocks: np.ndarray  # int64 per op: blocks in the pool
    complete: np.ndarray    # bool per op: every row and tail entry arrived
    lo: np.ndarray          # int64, len(pos) + 1
    req: np.ndarray         # uint64 per row: the request's FNV-1a hash
    seq_len: np.ndarray     # int64 per row: tokens in the cache once the step has written
    new_tokens: np.ndarray  # int64 per row: tokens computed at the step
    row_len: np.ndarray     # int64 per row: len(req_to_blocks[req]) in the group now
    tail_from: np.ndarray   # int64 per row: where this op's tail for the row starts
    tail_lo: np.ndarray     # int64, len(req) + 1
    tail: np.ndarray        # int32: the rows' new entries, concatenated


def step_rows(ops: OpStream) -> StepRows:
    """The step_rows ops of `ops` (bpf/kvtrace_probes.h, docs/trace-format.md),
    decoded with numpy: no Python loop per op or per row.  An op whose
    stream is not whole, or whose tails do not add up to what it says it
    sent (sum of row_len - tail_from = its slots), is not complete and
    brings no rows: a delta is of no use in part."""
    o = ops.ops
    pos = np.flatnonzero(o["op"] == STEP_ROWS_OP_ID).astype(np.int64)
    sel = o[pos]
    nrows = sel["items"].astype(np.int64)
    ntail = sel["slots"].astype(np.int64)
    complete = sel["complete"].copy()
    # the row records of the complete ops, (rows, 5)
    take = np.where(complete, nrows, 0)
    rec = gather(ops.values, sel["start"], STEP_ROWS_FIELDS * take).reshape(
        -1, STEP_ROWS_FIELDS)
    row_op = np.repeat(np.arange(len(pos)), take)
    tail_n = rec[:, 3] - rec[:, 4]
    # each op's tails must add up to its tail entries, each row's lie inside it
    per_op = np.bincount(row_op, weights=tail_n, minlength=len(pos)).astype(np.int64) \
        if len(pos) else np.zeros(0, np.int64)
    bad = np.zeros(len(pos), bool)
    np.logical_or.at(bad, row_op, (tail_n < 0) | (rec[:, 4] < 0))
    complete &= ~bad & (np.where(complete, per_op, ntail) == ntail)
    if not complete.all():  # drop the rows of ops found wanting just now
        keep = complete[row_op]
        rec, row_op, tail_n = rec[keep], row_op[keep], tail_n[keep]
    take = np.where(complete, nrows, 0)
    lo = np.zeros(len(pos) + 1, np.int64)
    np.cumsum(take, out=lo[1:])
    # the tails: each op's words after its records, as int32, less the padding
    words = np.where(complete, (ntail + 1) // 2, 0)
    w = gather(ops.values, sel["start"] + STEP_ROWS_FIELDS * take, words)
    t32 = np.ascontiguousarray(w).view("<i4")
    t_first = np.cumsum(2 * words) - 2 * words
    tail = t32[ranges(t_first, np.where(complete, ntail, 0))].astype(np.int32)
    tail_lo = np.zeros(len(rec) + 1, np.int64)
    np.cumsum(tail_n, out=tail_lo[1:])
    return StepRows(pos=pos, pid=sel["pid"].astype(np.uint32),
                    ts_ns=sel["ts_ns"].astype(np.uint64),
                    group=sel["cache_id"].astype(np.int64),
                    block_size=sel["rows"].astype(np.int64),
                    num_blocks=sel["held_tokens"].astype(np.int64),
                    complete=complete, lo=lo, req=rec[:, 0].astype(np.uint64),
                    seq_len=rec[:, 1].copy(), new_tokens=rec[:, 2].copy(),
                    row_len=rec[:, 3].copy(), tail_from=rec[:, 4].copy(),
                    tail_lo=tail_lo, tail=tail)
