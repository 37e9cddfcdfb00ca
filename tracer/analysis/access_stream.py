"""Access patterns from the stream (a trace file's block_table ops): each
step's live set, row by row, with its time, the reads scanned against
block generations, idle time before reuse, and prefix reuse inferred
from the rows; what `report` shows over time (docs/access.md).  Pure
logic (numpy), no bcc.
"""

from dataclasses import dataclass

import numpy as np

from .. import abi
from ..trace import stream
from ..trace.tracefile import MAX_BLOCKS


@dataclass
class Steps:
    """The block_table ops of one group (one per forward step), in order."""

    pid: int
    group_id: int
    block_size: int
    ts_ns: np.ndarray
    rows: np.ndarray
    reads: np.ndarray
    distinct: np.ndarray  # the step's live set size (working set of the step)
    tokens: np.ndarray  # sum of seq_len
    held_tokens: np.ndarray
    complete: np.ndarray  # the op's live set arrived whole
    index: np.ndarray  # the ops' positions in the OpStream

    def __len__(self):
        return len(self.ts_ns)

    @property
    def utilization(self) -> np.ndarray:
        """Per step: tokens held in the blocks read over their capacity."""
        cap = self.distinct.astype(np.float64) * self.block_size
        return np.divide(self.held_tokens.astype(np.float64), cap,
                         out=np.full(len(cap), np.nan), where=cap > 0)


def steps_of(ops: stream.OpStream, groups: list) -> list:
    """One Steps per group (groups: the trace's group documents)."""
    o = ops.ops
    is_table = o["op"] == stream.TABLE_OP_ID
    out = []
    for g in groups:
        sel = np.flatnonzero(is_table & (o["pid"] == g["pid"]) & (o["cache_id"] == g["group_id"]))
        t = o[sel]
        out.append(Steps(g["pid"], g["group_id"], int(g["block_size"]),
                         t["ts_ns"].astype(np.int64), t["rows"].astype(np.int64),
                         t["items"].astype(np.int64), t["slots"].astype(np.int64),
                         t["bytes"].astype(np.int64), t["held_tokens"].astype(np.int64),
                         t["complete"].copy(), sel))
    return out


@dataclass
class Rows:
    """A group's complete steps, parsed once: every row (one request at one
    step) with its seq_len and its table entries, nulls kept so that an
    entry's place in its row stays its block's place in the request.

    The stream holds, per block_table op, row after row, seq_len then
    ceil(seq_len / block_size) entries (bpf/kvtrace.h).  Incomplete steps
    have no rows here (their live set is not whole)."""

    steps: Steps
    row_lo: np.ndarray  # per step k (len(steps) + 1): its rows are row_lo[k]:row_lo[k + 1]
    seq: np.ndarray  # per row: seq_len
    start: np.ndarray  # per row: where its entries begin in `entries`
    length: np.ndarray  # per row: how many entries it has
    entries: np.ndarray  # every row's entries, row after row, step after step:
    # the narrowest of int16 and int32 that all fit (_narrow_runs), else int64
    bounds: tuple = None  # (lowest, highest) of the entries where known (rows_of
    # finds them as it narrows them), else None

    @property
    def step_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.steps)), np.diff(self.row_lo))

    def block_counts(self, spans, nb: int):
        """For each span (k0, k1) of steps, the reads per block (0..nb - 1)
        over steps k0..k1 - 1: how many (request, step) pairs read each.
        Null entries and blocks nb or more are not counted.  A bincount of
        the steps' entries as they lie, a chunk at a time: no step number or
        time per read (the read heatmap's cells are such counts per time
        row: report --kind reads).  A generator."""
        at = np.concatenate([[0], np.cumsum(self.length)])[self.row_lo]  # each step's first
        scratch = np.empty(min(_CHUNK_READS, len(self.entries)), np.intp)
        for k0, k1 in spans:
            counts = np.zeros(nb + 1, np.int64)
            for a in range(int(at[k0]), int(at[k1]), _CHUNK_READS):
                part = self.entries[a:min(a + _CHUNK_READS, int(at[k1]))]
                # nulls (0 or below) to bin 0, blocks nb or more to bin nb: both dropped
                np.clip(part, 0, nb, out=scratch[:len(part)])
                counts += np.bincount(scratch[:len(part)], minlength=nb + 1)
            counts[0] = 0
            yield counts[:nb]

    def scan(self, gen_block=(), gen_start_ns=(), max_blocks: int = MAX_BLOCKS) -> "ReadScan":
        """scan_reads() over these rows, without a step number per read."""
        # The entries left out (nulls, out of range) are few, so they are
        # found by place and the rest is used as it lies: a copy of the kept
        # entries, or a per-row sum over an int64 cast of the mask, would
        # each touch the entries' size again (a GB on a large trace, and on
        # a VM fresh memory costs seconds a GiB).
        e = self.entries
        per_row = self.length.astype(np.int64, copy=True)
        out_of_range = 0
        # Usually every entry is a block in range: the lowest and highest
        # tell, which rows_of found as it copied them (two reductions here
        # cost ten times less than masks of the whole, most of whose time
        # was their fresh pages)
        if not len(e):
            lowest, highest = 1, 0  # none: nothing to drop
        elif self.bounds is not None:
            lowest, highest = self.bounds
        else:
            lowest, highest = int(e.min()), int(e.max())
        if not (lowest > 0 and highest < max_blocks):
            drop = []
            for a in range(0, len(e), _CHUNK_VALUES):  # masks of a chunk, in the caches
                part = e[a:a + _CHUNK_VALUES]
                beyond = part >= max_blocks
                out_of_range += int(np.count_nonzero(beyond))
                beyond |= part <= 0
                drop.append(np.flatnonzero(beyond) + a)
            drop = np.concatenate(drop)
            # a dropped entry's row: the last row starting at or before it
            # (rows lie one after another; an empty row starts where the
            # next one does, and the next one is found)
            row = np.searchsorted(self.start, drop, side="right") - 1
            per_row -= np.bincount(row, minlength=len(per_row))
            e = np.delete(e, drop)
        row_end = np.concatenate([[0], np.cumsum(per_row)])
        return _scan(row_end[self.row_lo], e, self.steps.ts_ns, gen_block,
                     gen_start_ns, out_of_range)


def rows_of(ops: stream.OpStream, steps: Steps) -> Rows:
    """Parse the complete steps' live sets, all steps at once: each round
    finds every op's next row header (a row's length follows from its
    seq_len), so the rounds are as many as the most rows one step has,
    and no Python runs per row or per entry."""
    values = ops.values
    bs = steps.block_size
    ks = np.flatnonzero(steps.complete)
    idx = steps.index[ks]
    lo = ops.ops["start"][idx].astype(np.int64)
    hi = ops.ops["stop"][idx].astype(np.int64)

    def entries_of(seq):
        # ceil(seq_len / block_size); a corrupt negative seq_len has none
        return np.maximum(-(-seq // bs), 0) if bs > 0 else np.zeros(len(seq), np.int64)

    head_op, head_pos = [], []
    pos = lo.copy()
    live = np.flatnonzero(pos < hi)
    while len(live):
        p = pos[live]
        head_op.append(live)
        head_pos.append(p)
        pos[live] = p + 1 + entries_of(values[p])
        live = live[pos[live] < hi[live]]
    if head_pos:
        hop, hpos = np.concatenate(head_op), np.concatenate(head_pos)
        order = np.lexsort((hpos, hop))
        hop, hpos = hop[order], hpos[order]
    else:
        hop = hpos = np.zeros(0, np.int64)
    seq = values[hpos].astype(np.int64)
    # the op's last row may be cut short by its end (a damaged record)
    length = np.clip(np.minimum(entries_of(seq), hi[hop] - hpos - 1), 0, None)
    start = np.cumsum(length) - length

    # The ops' values lie in step order, one after another (a copy puts them
    # in seq order; a trace file's lie in its order, but for the few ops that
    # two batches split, which lie past its end: stream.decode), and so do
    # their rows.  In each run of ops that do, the entries are the values of
    # the rows' runs (_narrow_runs; an index per entry was 0.9 GB of fresh
    # memory and 2-5 s where one op lay out of order)
    # into one array: a part per run, then their concatenation, held the
    # entries twice (where an op was split in the middle of a large trace)
    runs = [0, *(np.flatnonzero(lo[1:] < hi[:-1]) + 1).tolist(), len(lo)]
    total = int(length.sum())
    # int16 first (a cache of fewer than 32767 blocks, as on the CPU and in
    # kvsim), widened to int32 at the first entry that does not fit it (a
    # GPU's cache): int16 entries are half the fresh memory of int32
    entries = np.empty(total, _NARROW[0])
    bounds = []  # each run's (lowest, highest)
    for k0, k1 in zip(runs[:-1], runs[1:]):
        r0, r1 = np.searchsorted(hop, [k0, k1])
        if r0 == r1:
            continue
        at, until = int(start[r0]), int(start[r0]) + int(length[r0:r1].sum())
        got = _narrow_runs(values, hpos[r0:r1] + 1, length[r0:r1], entries[at:until])
        while got is None and entries.dtype != _NARROW[-1]:
            # the next type, with what the runs before wrote, and this run again
            wider = np.empty(total, _NARROW[_NARROW.index(entries.dtype) + 1])
            wider[:at] = entries[:at]
            entries = wider
            got = _narrow_runs(values, hpos[r0:r1] + 1, length[r0:r1], entries[at:until])
        if got is None:
            entries = values[stream.ranges(hpos + 1, length)]  # beyond an int32: as they are
            bounds = None
            break
        if got[0] <= got[1]:  # (a run of empty rows has none)
            bounds.append(got)
    per_step = np.zeros(len(steps), np.int64)
    per_step[ks] = np.bincount(hop, minlength=len(ks))
    row_lo = np.concatenate([[0], np.cumsum(per_step)])
    if bounds:
        bounds = (min(b[0] for b in bounds), max(b[1] for b in bounds))
    return Rows(steps, row_lo, seq, start, length, entries, bounds or None)


# values per chunk of _narrow_runs and of the read scan's count: 1M.  A
# chunk's temporaries (8 MiB of int64) stay in the CPU's caches from one step
# of the chunk to the next, where 8M went to memory and back (and a boolean
# index, not np.compress into a scratch, made rows_of's copy a third as
# long).
_CHUNK_VALUES = 1 << 20

# reads per chunk in _reads_by_place and Rows.block_counts: 1M, for the
# caches, as _CHUNK_VALUES (8M was slower)
_CHUNK_READS = 1 << 20


# the types rows_of keeps entries in, narrowest first
_NARROW = (np.dtype(np.int16), np.dtype(np.int32))


def _narrow_runs(values: np.ndarray, at: np.ndarray, n: np.ndarray, out: np.ndarray):
    """values[at[i]:at[i] + n[i]] for every i, in order (runs that lie in
    ascending order, apart), into out (an integer type of _NARROW, n.sum()
    long), if every value fits out's type below its highest value (so that
    a count of blocks, the highest entry + 1, is one too: numpy 2 wraps a
    Python int beyond an array's type in np.where, as in prefix_reuse's
    keys): returns the lowest and highest value copied (lowest > highest
    where none is); None if one does not fit (out is then partly written).

    A chunk of runs at a time, each by a boolean mask of its chunk made run
    by run (not a running sum over every value), where one mask of the
    whole span was a hundred MB of fresh memory on a large trace.  An int16
    copy is a quarter of an int64 one, and each later pass over it reads a
    quarter of the bytes."""
    fits_lo, fits_hi = np.iinfo(out.dtype).min, np.iinfo(out.dtype).max - 1
    span = np.r_[np.diff(at), n[-1:]]  # from a run's start to the next one's
    pos = 0
    lowest, highest = fits_hi, fits_lo
    for r0, r1 in stream.chunks(span, _CHUNK_VALUES):
        first = int(at[r0])
        a, m = at[r0:r1] - first, n[r0:r1]
        gap = a - np.r_[0, (a + m)[:-1]]  # headers and other ops' values
        mask = np.repeat(np.tile(np.array([False, True]), len(a)),  # each gap, then its run
                         np.stack([gap, m], axis=1).reshape(-1))
        part = values[first:first + len(mask)][mask]
        if len(part):
            low, high = int(part.min()), int(part.max())
            if not (fits_lo <= low and high <= fits_hi):
                return None
            lowest, highest = min(lowest, low), max(highest, high)
        out[pos:pos + len(part)] = part
        pos += len(part)
    return lowest, highest


@dataclass
class ReadScan:
    """What one pass over a group's reads, in time order, finds per block."""

    reads_per_block: np.ndarray  # uint64: reads of complete steps
    last_read_step: np.ndarray  # uint64: 1 + the last step that read it, 0: never
    last_read_ns: np.ndarray  # int64: the time of its last read, 0: never
    sharing: np.ndarray  # int64: the most requests that read it at one step
    out_of_range: int  # reads of block numbers beyond tracefile's MAX_BLOCKS
    idle: np.ndarray  # idle_before_reuse's answer for the generations given


def scan_reads(step_of: np.ndarray, block: np.ndarray, ts_ns: np.ndarray,
               gen_block=(), gen_start_ns=(), max_blocks: int = MAX_BLOCKS) -> ReadScan:
    """The per-block figures of a group's reads in one pass over its steps.

    step_of, block: every (request, block) read (positive blocks), in any
    order; ts_ns: each step's time.  gen_block, gen_start_ns: block
    generations (a block's new owner's first write) to measure
    idle_before_reuse for.  Reads of blocks >= max_blocks are counted
    (out_of_range), not kept per block, as the maps count what lies beyond
    --max-blocks."""
    step_of = np.asarray(step_of, np.int64)
    block = np.asarray(block, np.int64)
    inside = block < max_blocks
    out_of_range = int(len(block) - np.count_nonzero(inside))
    step_of, block = step_of[inside], block[inside]
    order = np.argsort(step_of, kind="stable")
    step_of, block = step_of[order], block[order]
    bounds = np.searchsorted(step_of, np.arange(len(ts_ns) + 1))
    return _scan(bounds, block, ts_ns, gen_block, gen_start_ns, out_of_range)


def _scan(bounds, block, ts_ns, gen_block, gen_start_ns, out_of_range) -> ReadScan:
    """scan_reads(), with step k's reads at block[bounds[k]:bounds[k + 1]]."""
    ts_ns = np.asarray(ts_ns, np.int64)
    gen_block = np.asarray(gen_block, np.int64)
    gen_start_ns = np.asarray(gen_start_ns, np.int64)
    nb = int(block.max()) + 1 if len(block) else 0
    reads = np.zeros(nb, np.int64)
    steps_in_time = np.argsort(ts_ns, kind="stable")
    t_sorted = ts_ns[steps_in_time]
    rank = np.empty(len(ts_ns), np.int64)  # each step's place in time order
    rank[steps_in_time] = np.arange(len(ts_ns))
    # per block, its last read so far (-1: none yet), as the read's number:
    # the one array the pass writes per read.  Its step and time follow from
    # bounds; a read's number also tells two reads of one block in one step
    # apart without a second array (a block read by more than one request)
    # read numbers as int32 where they fit: the per-step scatter and gather
    # move half the bytes
    number = np.int32 if len(block) < 2**31 - 1 else np.int64
    # (and one place past the blocks, never written: where a generation of
    # a block never read looks)
    last_read_or_none = np.full(nb + 1, -1, number)
    last_read = last_read_or_none[:nb]
    # the steps' times in step order (the usual case): the latest step is
    # also the highest-numbered; otherwise that is kept apart
    in_order = bool(np.all(steps_in_time == np.arange(len(ts_ns))))
    last_step = None if in_order else np.zeros(nb, np.int64)
    # the blocks as an index (intp), a chunk of steps at a time: each step's
    # are a slice of its chunk's, and the reads per block a bincount of each
    # chunk as it is cast, where the steps in order tile the reads once (else
    # they are counted apart).  A bincount of the int32 blocks cast them
    # again inside (a fifth of the scan)
    tiled = in_order and len(bounds) and bounds[0] == 0 and bounds[-1] == len(block)
    counted = 0 if tiled else len(block)  # the reads counted so far
    if not tiled:
        for a in range(0, len(block), _CHUNK_VALUES):
            reads += np.bincount(block[a:a + _CHUNK_VALUES], minlength=nb)
    as_index = np.empty(0, np.intp)
    c_lo = c_hi = 0  # the chunk that as_index holds
    sharing = np.zeros(nb, np.int64)
    widest = int(np.max(np.diff(bounds), initial=0))
    offsets, numbers = np.arange(widest, dtype=number), np.empty(widest, number)  # reused per step
    # the generations in start order, each one's block as an index (a
    # block out of range: the place past the blocks), and the number of the
    # last read of its block before it (-1: none), taken as the scan passes
    # its start; the idle times follow from those numbers at the end (per
    # step, a search and six arrays were a third of the scan)
    g_order = np.argsort(gen_start_ns, kind="stable")
    g_starts = gen_start_ns[g_order]
    g_blocks = gen_block[g_order]
    g_blocks = np.where((g_blocks >= 0) & (g_blocks < nb), g_blocks, nb)
    read_before = np.empty(len(g_order), number)
    g_next = 0

    def step_of(read):  # the step of each read number
        return np.searchsorted(bounds, read, side="right") - 1

    def answer(g_end):
        # the generations before g_end (in start order) see only the reads
        # applied so far, all of them earlier than their start
        nonlocal g_next
        read_before[g_next:g_end] = last_read_or_none[g_blocks[g_next:g_end]]
        g_next = g_end

    # before each step, in time order, the generations that start at or
    # before its time: a read at a generation's very start is not before it
    g_ends = np.searchsorted(g_starts, t_sorted, side="right").tolist()
    bounds_l = bounds.tolist()
    for k, g_end in zip(steps_in_time.tolist(), g_ends):
        if g_end > g_next:
            answer(g_end)
        lo, hi = bounds_l[k], bounds_l[k + 1]
        if lo == hi:
            continue
        if hi > c_hi or lo < c_lo:
            c_lo, c_hi = lo, min(len(block), max(hi, lo + _CHUNK_VALUES)) if tiled else hi
            if len(as_index) < c_hi - c_lo:
                as_index = np.empty(c_hi - c_lo, np.intp)
            chunk = as_index[:c_hi - c_lo]
            chunk[:] = block[c_lo:c_hi]
            if counted < c_hi:
                reads += np.bincount(chunk[counted - c_lo:], minlength=nb)
                counted = c_hi
        b = as_index[lo - c_lo:hi - c_lo]
        here = np.add(offsets[:hi - lo], lo, out=numbers[:hi - lo])  # the reads' numbers
        last_read[b] = here  # time order: this is the latest
        if last_step is not None:
            last_step[b] = np.maximum(last_step[b], k + 1)
        # a block read by more than one request at this step: found without
        # sorting, as a read whose number another one overwrote.  Of a
        # block's m reads here exactly one number stayed (they differ), so m
        # is 1 + its overwritten reads, and only those are counted: a count
        # of the step's every read was slower by far
        stale = last_read[b] != here
        if bool(stale.any()):
            u, c = np.unique(b[stale], return_counts=True)
            sharing[u] = np.maximum(sharing[u], c + 1)
    answer(len(g_starts))
    seen = read_before >= 0
    idle = np.zeros(len(gen_block), np.int64)
    found = np.zeros(len(gen_block), bool)
    found[g_order[seen]] = True
    idle[g_order[seen]] = g_starts[seen] - ts_ns[step_of(read_before[seen])]
    has_read = last_read >= 0
    sharing[(sharing == 0) & has_read] = 1
    last_at = np.zeros(nb, np.int64)  # 1 + the place in time order of its last step
    last_at[has_read] = rank[step_of(last_read[has_read])] + 1
    last_ns = np.where(has_read, t_sorted[np.maximum(last_at - 1, 0)], 0) if nb else \
        np.zeros(0, np.int64)
    if last_step is None:
        last_step = last_at
    return ReadScan(reads.astype(np.uint64), last_step.astype(np.uint64), last_ns, sharing,
                    out_of_range,
                    idle[found])


def idle_before_reuse(step_of: np.ndarray, block: np.ndarray, ts_ns: np.ndarray,
                      gen_block: np.ndarray, gen_start_ns: np.ndarray) -> np.ndarray:
    """For every block generation that starts after the block was read:
    how long (ns) the block sat unread between its last read and the new
    generation's first write (a new request reusing it), in the
    generations' order."""
    return scan_reads(step_of, block, ts_ns, gen_block, gen_start_ns).idle


def prefix_reuse(ops: stream.OpStream, rows: Rows, leader) -> dict:
    """Prefix reuse: blocks a request read at its first step that it did not
    write (docs/access.md), i.e. blocks it found in the cache (vLLM's
    prefix-cache hits, in blocks) rather than computed; from the rows, also
    the blocks a forked sequence shares with its parent.

    Inferred from the rows and the leader layer's writes (where the plugin
    tier names the requests, access_requests.prefix_reuse knows them by
    name and the figure is exact); leader None or 0
    (a group with no layer of its own: the plugin tier's groups, in vLLM's
    engine core, have leader 0 and no writes to go by): None.

    A request has no id in the table, so it is followed by its row from
    step to step: a row continues an earlier request's row when that row is
    a prefix of it (a request's row only grows; a block a sliding window
    dropped reads 0), its seq_len grew, and the last token the earlier row
    held was not written at this step (a new request that got a finished
    one's freed blocks writes its own tokens there now).  The earlier rows
    tried are the open ones (not yet continued) that end in one of the
    row's blocks, in the order of those blocks in the row, then oldest
    first; rows claim them in their order in the step.  A row that
    continues no request is a request's first step.  What a step wrote:
    the leader layer's write op just before the table op (vLLM and kvsim
    write a layer's tokens, then attend), and the copies and swaps into
    that cache since the step before (a swapped-in request's blocks are
    written by the swap).  Requests already running at the first traced
    step look new: attach before the load to count them.

    Each step is one round of array operations over its rows and the
    candidate pairs; Python runs per step, and per row only where two rows
    of a step want the same earlier row.

    Returns {"requests": first steps seen, "blocks": reused blocks,
    "per_block": {block: times reused}, "steps_without_writes": steps
    whose writes were not found, "by": "request ids" or "rows"}."""
    if not leader:
        return None
    o = ops.ops
    steps = rows.steps
    bs = steps.block_size
    if bs <= 0:  # no block size: no row can be split (a damaged trace)
        return {"requests": 0, "blocks": 0, "per_block": {}, "steps_without_writes": 0,
                "by": "rows"}
    order = np.argsort(o["seq"], kind="stable")
    seqs = o["seq"][order]
    mine = (o["pid"][order] == steps.pid) & (o["cache_id"][order] == leader) & \
        o["complete"][order]
    is_write = mine & np.isin(o["op"][order], list(stream.WRITE_OP_IDS))
    is_move = mine & np.isin(o["op"][order], list(stream.PAIR_OP_IDS))
    write_pos, write_seq = order[is_write], seqs[is_write]
    move_pos, move_seq = order[is_move], seqs[is_move]

    entries, start, length, rseq = rows.entries, rows.start, rows.length, rows.seq
    # a row takes part if it has a non-null entry; its key is its last
    # entry, folded into [0, nb] (nb: anything not a plausible block) for
    # the dense count of open rows by last entry
    has_entry = np.zeros(len(start), bool)
    if len(entries):  # reduceat over the rows with entries: empty ones have none
        nz = length > 0
        has_entry[nz] = np.logical_or.reduceat(entries != 0, start[nz])
    lo, hi = (int(entries.min()), int(entries.max())) if len(entries) else (0, 0)
    if 0 <= lo and hi < MAX_BLOCKS:  # every entry a plausible block: no mask
        valid, nb = True, hi + 1
    else:
        valid = (entries >= 0) & (entries < MAX_BLOCKS)
        nb = int(entries[valid].max()) + 1 if np.any(valid) else 1
    last_entry = entries[np.maximum(start + length - 1, 0)] if len(entries) else \
        np.zeros(len(start), np.int64)
    row_key = np.where((last_entry >= 0) & (last_entry < nb), last_entry, nb)
    open_count = np.zeros(nb + 1, np.int64)  # open rows by key
    open_rows = np.zeros(0, np.int64)  # open rows, oldest first (row index order)
    is_open = np.zeros(len(start), bool)
    # per key, the last step that marked it (dense sets, cleared by the stamp)
    hit_mark = np.zeros(nb + 1, np.int64)
    run_mark = np.zeros(nb + 1, np.int64)
    written_mark = np.zeros(nb + 1, np.int64)

    plausible = bool(np.all(valid)) and nb == max(hi, 0) + 1

    def keys(v):
        return v if plausible else np.where((v >= 0) & (v < nb), v, nb)

    def distinct(v):
        # np.unique without its hash table, which costs more on short arrays
        v = np.sort(v)
        return v[np.concatenate([[True], v[1:] != v[:-1]])] if len(v) else v

    def gather(starts, lengths):
        # the entries of several rows, one after another
        return entries[stream.ranges(starts, lengths)]

    seq_of_step = o["seq"][steps.index].tolist()
    complete = steps.complete.tolist()
    row_lo = rows.row_lo.tolist()
    out_blocks, per_block, new_rows, missing = 0, {}, 0, 0
    prev_seq = -1
    for k in range(len(steps)):
        stamp = k + 1
        cur_seq = seq_of_step[k]
        r0, r1 = row_lo[k], row_lo[k + 1]
        if not complete[k]:
            prev_seq = cur_seq
            continue
        # what this step wrote: the leader's write op just before the table
        # op, and copies and swaps into the cache since the step before
        j = int(np.searchsorted(write_seq, cur_seq)) - 1
        if j >= 0 and write_seq[j] > prev_seq:
            v = ops.values_of(write_pos[j])
            slots = v[v >= 0]
        else:
            slots = np.zeros(0, np.int64)
            if r1 > r0 and bool(np.any(length[r0:r1] > 0)):
                missing += 1
        lo_m, hi_m = np.searchsorted(move_seq, [prev_seq, cur_seq], side="right")
        moved = [ops.values_of(m)[1::2] for m in move_pos[lo_m:hi_m]
                 if not o["flags"][m] & abi.EV_SWAP_OUT]  # a copy's, a swap-in's destination
        prev_seq = cur_seq

        part = r0 + np.flatnonzero(has_entry[r0:r1])  # the rows that take part
        if not len(part):
            continue
        e_lo = int(start[r0])
        e = entries[e_lo:int(start[r1 - 1] + length[r1 - 1])]
        ek = keys(e)
        hit = np.flatnonzero(open_count[ek])
        match_row = match_open = np.zeros(0, np.int64)
        if len(hit):
            # the candidate pairs (row, open row), in the rows' order, then
            # the order of the open row's last entry in the row, then oldest
            hit_row = r0 + np.searchsorted(start[r0:r1] - e_lo, hit, side="right") - 1
            hk = ek[hit]
            hit_mark[hk] = stamp
            cand = open_rows[hit_mark[row_key[open_rows]] == stamp]
            ck = row_key[cand]  # cand is in row order: a stable sort keeps it
            cand = cand[np.argsort(ck.astype(np.uint16) if nb < 1 << 16 else ck, kind="stable")]
            ck = row_key[cand]
            left = np.searchsorted(ck, hk, "left")
            n = np.searchsorted(ck, hk, "right") - left
            pick = stream.ranges(left, n)
            pr = np.repeat(hit_row, n)  # the row
            pp = cand[pick]  # the open row
            lp = length[pp]
            ok = (last_entry[pp] == np.repeat(e[hit], n)) & has_entry[pr] & \
                (lp <= length[pr]) & (rseq[pp] >= 1) & (rseq[pr] > rseq[pp])
            pr, pp, lp = pr[ok], pp[ok], lp[ok]
            # most pairs fail at the open row's last place, checked first
            end_r, end_p = entries[start[pr] + lp - 1], last_entry[pp]
            ok = (end_r == end_p) | (end_r == 0) | (end_p == 0)
            pr, pp, lp = pr[ok], pp[ok], lp[ok]
            if len(pr):
                # the open row is a prefix of the row, entry by entry,
                # except where either reads 0 (a block a window dropped)
                seg = np.cumsum(lp) - lp  # each pair's place in a and b
                within = np.arange(int(lp.sum())) - np.repeat(seg, lp)
                a = entries[np.repeat(start[pr], lp) + within]
                b = entries[np.repeat(start[pp], lp) + within]
                # the few places that differ, then whether either reads 0 there
                diff = np.flatnonzero(a != b)
                diff = diff[(a[diff] != 0) & (b[diff] != 0)]
                ok = np.ones(len(pr), bool)
                ok[np.searchsorted(seg, diff, side="right") - 1] = False
                # the open row's last token was not written at this step
                last = rseq[pp] - 1
                inrow = last // bs < length[pr]
                at = start[pr] + np.where(inrow, last // bs, 0)
                token = entries[at].astype(np.int64) * bs + last % bs
                done = np.sort(slots)
                seen = done[np.minimum(np.searchsorted(done, token), len(done) - 1)] == token \
                    if len(done) else np.zeros(len(token), bool)
                ok &= inrow & ~seen
                pr, pp = pr[ok], pp[ok]
            if len(pr):
                first_row, first = np.unique(pr, return_index=True)
                if len(distinct(pp[first])) == len(first):
                    match_row, match_open = first_row, pp[first]
                else:  # two rows want one open row: the earlier row gets it
                    match, claimed = {}, set()
                    for r, p in zip(pr.tolist(), pp.tolist()):
                        if r not in match and p not in claimed:
                            match[r] = p
                            claimed.add(p)
                    match_row = np.fromiter(match.keys(), np.int64, len(match))
                    match_open = np.fromiter(match.values(), np.int64, len(match))
        # each request's latest row replaces its last: the open rows
        # continued now close, and this step's rows open
        if len(match_open):
            np.subtract.at(open_count, row_key[match_open], 1)
            is_open[match_open] = False
            open_rows = open_rows[is_open[open_rows]]
        written = np.concatenate([slots // bs] + moved)
        written_mark[keys(written)] = stamp
        # An open row that did not go on at this step, and whose last block
        # this step wrote, lost that block: it was freed and another
        # request writes there now (a request that goes on has its row
        # continued first; one left out of the step writes nothing).
        # Nothing can continue the row any more, so it is retired, and
        # finished requests' rows do not pile up as candidates that every
        # later step tests.
        if len(open_rows) and len(written):
            key_open = row_key[open_rows]
            gone = (written_mark[key_open] == stamp) & (key_open != nb)
            if np.any(gone):
                np.subtract.at(open_count, key_open[gone], 1)
                is_open[open_rows[gone]] = False
                open_rows = open_rows[~gone]
        np.add.at(open_count, row_key[part], 1)
        is_open[part] = True
        open_rows = np.concatenate([open_rows, part])

        is_new = np.ones(r1 - r0, bool)
        is_new[match_row - r0] = False
        new = part[is_new[part - r0]]
        if not len(new):
            continue
        new_rows += len(new)
        # a block new rows hold was reused by all of them if this step did
        # not write it; if it did, by all but the one that wrote it, unless
        # a running request holds it (then that one wrote it: a prefix hit on
        # a block computed at the same step, as kvsim's scheduler allows)
        held = np.concatenate([distinct(entries[start[r]:start[r] + length[r]])
                               for r in new.tolist()])
        blocks, n = np.unique(held[held != 0], return_counts=True)
        running = ek[np.repeat(~is_new, length[r0:r1])]
        run_mark[running] = stamp
        bk = keys(blocks)
        was_written = (written_mark[bk] == stamp) & (run_mark[bk] != stamp)
        odd = bk == nb  # not a plausible block: the dense marks cannot tell
        if np.any(odd):
            was_written[odd] = np.isin(blocks[odd], written) & \
                ~np.isin(blocks[odd], gather(start[match_row], length[match_row]))
        reused = n - was_written
        for blk, c in zip(blocks[reused > 0].tolist(), reused[reused > 0].tolist()):
            out_blocks += c
            per_block[blk] = per_block.get(blk, 0) + c
    return {"requests": new_rows, "blocks": out_blocks, "per_block": per_block,
            "steps_without_writes": missing, "by": "rows"}
