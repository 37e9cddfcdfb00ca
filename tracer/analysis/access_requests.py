"""Access per request: the plugin tier's step_reqs ops name each
block-table row, so what each request wrote and read, and its prefix
reuse, are known by name (docs/access.md).  Builds on access_stream's
rows.  Pure logic (numpy), no bcc.
"""

from dataclasses import dataclass

import numpy as np

from ..trace import stream
from . import access_stream, derived_rows
from .access_stream import Rows


@dataclass
class StepRequests:
    """Every complete step_reqs op, flattened: op k's requests are
    req[lo[k]:lo[k + 1]], in the order of the rows of the step's tables."""

    pos: np.ndarray  # the ops' positions in the OpStream
    pid: np.ndarray
    lo: np.ndarray  # len(pos) + 1
    req: np.ndarray  # uint64 request hash
    tokens: np.ndarray  # int64: tokens it computes (writes) at the step
    ureq: np.ndarray  # the distinct hashes, sorted
    req_index: np.ndarray  # per entry of req: its hash's place in ureq


def step_requests(ops: stream.OpStream) -> StepRequests:
    """The step_reqs ops, with each request's place among the distinct ones
    found once, for request_access (beside) and prefix reuse (the main
    side's document), where each sorted every request hash of the trace
    (a stable sort for the latter)."""
    o = ops.ops
    pos = np.flatnonzero((o["op"] == stream.STEP_REQS_OP_ID) & o["complete"])
    n = o["items"][pos].astype(np.int64)
    start = o["start"][pos].astype(np.int64)
    vals = ops.values
    req = vals[stream.ranges(start, n)].view(np.uint64)
    ureq, req_index = np.unique(req, return_inverse=True)
    return StepRequests(pos, o["pid"][pos].astype(np.int64), np.concatenate([[0], np.cumsum(n)]),
                        req, vals[stream.ranges(start + n, n)].astype(np.int64), ureq,
                        req_index.reshape(-1))


def name_rows(sr: StepRequests, rows: Rows):
    """Whose each row of one group is: a table is named by its process's
    latest step_reqs op before it when that op has as many requests as the
    table rows and no table of the same group lies between them (a lost
    record leaves the table unnamed, never given to the step before).
    Returns None where the process has no step_reqs (or the group no step);
    else (ok: per step, named; row: the named steps' rows, in order; el:
    each one's place in sr.req and sr.tokens)."""
    st = rows.steps
    mine = np.flatnonzero(sr.pid == st.pid)
    if not len(mine) or not len(st):
        return None
    at = np.searchsorted(sr.pos[mine], st.index) - 1
    ok = at >= 0
    j = mine[np.maximum(at, 0)]
    prev_table = np.concatenate([[-1], st.index[:-1]])
    nrows = np.diff(rows.row_lo)
    ok &= st.complete & (sr.pos[j] > prev_table) & (sr.lo[j + 1] - sr.lo[j] == nrows)
    k = np.flatnonzero(ok)
    return ok, stream.ranges(rows.row_lo[k], nrows[k]), stream.ranges(sr.lo[j[k]], nrows[k])


def _prefix_reuse_by_name(rows: Rows, sr: StepRequests):
    """Prefix reuse where step_reqs names every complete step's rows: a
    request's first step is the first one that names it, and what it found
    cached is its rows' blocks below seq_len - the tokens it computes there
    (whole blocks: vLLM's hit is num_computed_tokens at admission, always a
    multiple of the block size).  A swapped-in or re-admitted request, or a
    sequence forked from its parent, keeps its name and is not new here,
    as in vLLM's own counters (preemptions count apart there).  No writes
    are needed, so a group of the plugin tier, which has no layers, gets
    the figure too.  None where any complete step is unnamed (a lost
    record): the caller infers it from the rows instead."""
    named = name_rows(sr, rows)
    st = rows.steps
    if named is None or st.block_size <= 0:
        return None
    ok, row, el = named
    if not len(row) or not np.all(ok | ~st.complete):
        return None
    ri = sr.req_index[el]
    step = rows.step_of_row[row]
    # each request's first step: its rows' lowest (no sort of the hashes)
    first_step = np.full(len(sr.ureq), len(st), np.int64)
    np.minimum.at(first_step, ri, step)
    is_first = step == first_step[ri]  # every row of a request's first step
    r = row[is_first]
    cached = np.clip(rows.seq[r] - sr.tokens[el[is_first]], 0, None) // st.block_size
    found = rows.entries[stream.ranges(rows.start[r], np.minimum(cached, rows.length[r]))]
    blocks, n = np.unique(found[found > 0], return_counts=True)  # null entries: no read
    return {"requests": int(np.count_nonzero(first_step < len(st))), "blocks": int(n.sum()),
            "per_block": dict(zip(blocks.tolist(), n.tolist())),
            "steps_without_writes": 0, "by": "request ids"}


def prefix_reuse(ops: stream.OpStream, rows: Rows, leader, requests: StepRequests = None) -> dict:
    """Prefix reuse (access_stream.prefix_reuse, docs/access.md): where the
    plugin tier's step_reqs (requests: step_requests()) names every complete
    step of the group, the requests are known by name and the figure is
    exact (_prefix_reuse_by_name); otherwise it is inferred from the rows
    and the leader layer's writes.  A group whose reads are derived from
    step_rows (derived_rows.DerivedRows) knows its requests by name."""
    if isinstance(rows, derived_rows.DerivedRows):
        return rows.prefix_reuse()
    if requests is not None:
        named = _prefix_reuse_by_name(rows, requests)
        if named is not None:
            return named
    return access_stream.prefix_reuse(ops, rows, leader)


def request_access(ops: stream.OpStream, all_rows: list, t0_ns: int = 0,
                   only=None, sr: StepRequests = None) -> tuple:
    """Per request (its hash), what it wrote and read, from the plugin tier:
    each table row is the request step_reqs named at its place, and writes
    the tokens [seq_len - new_tokens, seq_len) of its row.  Returns
    ({req: {"steps", "tokens_written", "block_reads", "blocks": {column: array}}},
    {"steps": tables matched, "unmatched": tables of a process with
    step_reqs that no complete step_reqs op names}).

    Tables are matched to step_reqs ops by name_rows.  only: the request
    hashes wanted (a view that shows a few); None: all.  sr: step_requests(ops),
    if the caller has it."""
    if sr is None:
        sr = step_requests(ops)
    out, stats = {}, {"steps": 0, "unmatched": 0}
    derived = [r for r in all_rows if isinstance(r, derived_rows.DerivedRows)]
    if not len(sr.pos) and not derived:
        return out, stats
    # per request: steps scheduled and tokens written, from step_reqs; a
    # process without step_reqs (the plugin without --verify-rows) from its
    # first derived group's step_rows, which name the same requests
    ureq, inv = sr.ureq, sr.req_index
    if derived:
        ureq = np.unique(np.concatenate([sr.ureq] + [r.derived.requests() for r in derived]))
        inv = np.searchsorted(ureq, sr.ureq)[sr.req_index]
    steps = np.bincount(inv, minlength=len(ureq))
    toks = np.bincount(inv, weights=sr.tokens, minlength=len(ureq))
    named_pids, by_pid = set(sr.pid.tolist()), {}
    for r in sorted(derived, key=lambda r: r.derived.group):
        if r.derived.pid not in named_pids:
            by_pid.setdefault(r.derived.pid, r.derived)
    for d in by_pid.values():
        ri = np.searchsorted(ureq, d.requests())[d._t["rq"]]
        steps = steps + np.bincount(ri, minlength=len(ureq))
        toks = toks + np.bincount(ri, weights=d._t["new"], minlength=len(ureq))
    wanted = np.ones(len(ureq), bool) if only is None else \
        np.isin(ureq, np.fromiter(only, np.uint64))
    # a request that read and wrote no block: empty columns, made once and
    # shared (read-only), where most requests get their own below
    none = {k: np.zeros(0, _COLUMN_TYPES[k]) for k in BLOCK_COLUMNS}
    for v in none.values():
        v.flags.writeable = False
    for r, s, t, w in zip(ureq.tolist(), steps.tolist(), toks.tolist(), wanted.tolist()):
        if w:
            out[r] = {"steps": int(s), "tokens_written": int(t), "block_reads": 0,
                      "blocks": dict(none)}

    # partial figures, merged per (request, group, block) at the end:
    # (request index, group, block, reads, first read, last read, tokens
    # written, first write, last write).  A time is a step's, carried as
    # its rank among the groups' distinct step times: the merge's minima
    # and maxima are the same, and a column's seconds are then one gather
    # (not a sort of each of four columns to round each distinct time once)
    times = np.unique(np.concatenate([np.zeros(0, np.int64)] +
                                     [r.steps.ts_ns for r in all_rows]))
    parts = []
    for rows in all_rows:
        if isinstance(rows, derived_rows.DerivedRows):
            parts += _derived_parts(rows.derived, ureq, times, wanted)
            stats["steps"] += int(np.count_nonzero(rows.derived.complete))
            continue
        st = rows.steps
        named = name_rows(sr, rows)
        if named is None:
            continue
        ok, row, el = named
        stats["steps"] += int(ok.sum())
        stats["unmatched"] += int((~ok).sum())
        if not len(row):
            continue
        k = np.flatnonzero(ok)
        ts = np.repeat(np.searchsorted(times, st.ts_ns[k]), np.diff(rows.row_lo)[k])
        if only is not None:
            keep = wanted[inv[el]]
            row, el, ts = row[keep], el[keep], ts[keep]
        ri, new = inv[el], sr.tokens[el]
        seq, start, length = rows.seq[row], rows.start[row], rows.length[row]
        bs = st.block_size
        places, odd = _reads_by_place(ri, start, length, ts, rows.entries, len(ureq))
        # writes: the blocks that hold [seq - new, seq), within the row
        first = np.clip(seq - new, 0, None)
        b0 = first // bs
        b1 = np.minimum((seq - 1) // bs, length - 1)
        nw = np.where((new > 0) & (seq > 0), np.clip(b1 - b0 + 1, 0, None), 0)
        place = stream.ranges(b0, nw)  # block's place in its row
        rr = np.repeat(np.arange(len(row)), nw)
        blk_w = rows.entries[start[rr] + place]
        wrote = np.minimum(seq[rr], (place + 1) * bs) - np.maximum(first[rr], place * bs)
        t = ts[rr]
        keep = blk_w > 0
        if places is not None:
            # a write to the block its place holds throughout is summed into
            # that place's figures: one figure per (request, place) and no
            # part per write in the final merge (a sort of millions of parts
            # on a large trace, and a reduce per column)
            at = places.first_bin[ri[rr]] + place
            fits = keep & ~places.several[at] & (places.held[at] == blk_w)
            at, keep = at[fits], keep & ~fits
            nb = len(places.held)
            tw = np.zeros(nb, np.int64)
            np.add.at(tw, at, wrote[fits])
            fw, lw = np.full(nb, _NEVER), np.full(nb, _EVER)
            np.minimum.at(fw, at, t[fits])
            np.maximum.at(lw, at, t[fits])
            u = places.used
            parts.append((places.req[u], places.held[u], places.reads[u], places.first[u],
                          places.last[u], tw[u], fw[u], lw[u], st.group_id))
        parts += [p + (st.group_id,) for p in odd]
        n, t = int(keep.sum()), t[keep]
        parts.append((ri[rr][keep], blk_w[keep], np.zeros(n, np.int64), np.full(n, _NEVER),
                      np.full(n, _EVER), wrote[keep], t, t, st.group_id))

    parts = [p for p in parts if len(p[0])]
    if not parts:
        return out, stats
    cols = [np.concatenate([p[c] for p in parts]) for c in range(8)]
    group_ids = sorted({p[8] for p in parts})  # addresses: sorted by their index
    gix = np.concatenate([np.full(len(p[0]), group_ids.index(p[8])) for p in parts])
    (ri, blk, nreads, fr, lr, tw, fw, lw, gix), kept = _merged(cols + [gix])
    gid = np.asarray(group_ids, np.int64)[gix]

    # seconds since t0 of each time rank, and NaN (at len(times)) for none
    seconds = np.array([round((v - t0_ns) / 1e9, 6) for v in times.tolist()] + [np.nan])

    def secs(rank):
        return seconds[np.where((rank == _NEVER) | (rank == _EVER), len(times), rank)]

    # each request's blocks in the order it first touched them, as columns:
    # an array per figure, sliced per request (views: no Python object per
    # value; the JSON writer takes arrays), where a dict per block was most
    # of the JSON report's time and of its document
    by = stream.order_by(ri, np.minimum(fw, fr), gix, blk)  # a block has a write or a read
    if kept is not None:  # the rows that _merged summed into another left out
        by = by[kept[by]]
    columns = dict(zip(BLOCK_COLUMNS, (
        gid[by], blk[by], tw[by], secs(fw[by]), secs(lw[by]), nreads[by], secs(fr[by]),
        secs(lr[by]))))
    for k, v in columns.items():
        columns[k] = np.ascontiguousarray(v, _COLUMN_TYPES[k])
    req_by = ri[by]
    reads_of = np.bincount(req_by, weights=columns["reads"], minlength=len(ureq))
    reads_of = reads_of.astype(np.int64).tolist()
    edges = np.searchsorted(req_by, np.arange(len(ureq) + 1)).tolist()
    for i, r in enumerate(ureq.tolist()):
        a, b = edges[i], edges[i + 1]
        if b > a and r in out:
            fig = out[r]
            fig["block_reads"] = reads_of[i]
            fig["blocks"] = {k: v[a:b] for k, v in columns.items()}
    return out, stats


def _derived_parts(d, ureq, times, wanted) -> list:
    """request_access's partial figures of a derived group: per tenure read
    (a block at a place of a request's row), its reads and first and last
    read; per write, its tokens and time (derived_rows)."""
    rmap = np.searchsorted(ureq, d.requests())
    rank = np.searchsorted(times, d.ts_ns.astype(np.int64))  # each step's time's rank
    req, blk, reads, first, last = d.request_reads()
    ri = rmap[req]
    keep = wanted[ri]
    n = int(keep.sum())
    parts = [(ri[keep], blk[keep], reads[keep], rank[first[keep]], rank[last[keep]],
              np.zeros(n, np.int64), np.full(n, _NEVER), np.full(n, _EVER), d.group)]
    req, blk, tokens, step = d.request_writes()
    ri = rmap[req]
    keep = wanted[ri] & (blk > 0)
    n, t = int(keep.sum()), rank[step[keep]]
    parts.append((ri[keep], blk[keep], np.zeros(n, np.int64), np.full(n, _NEVER),
                  np.full(n, _EVER), tokens[keep], t, t, d.group))
    return parts


def _merged(cols: list) -> tuple:
    """Partial figures (request, block, reads, first read, last read, tokens
    written, first write, last write, group) merged to one row per (request,
    group, block): those of a key that occurs more than once are summed
    (reads and tokens), and their earliest and latest times kept.  Returns
    (cols, kept): the columns, where each such key's first row (in sorted
    order) now holds its merged figures, and kept, a mask of the rows that
    stand for one key each (None: all of them).  Most keys occur once (a
    request's place that held one block, its writes summed into it), and
    they are found by one sort of the keys' values, not an argsort of all
    and a reduce per column.  The merged figures are written in place, and
    the rows they replace masked, not cut out: a copy of the rows that occur
    once and a concatenation after were most of this function's time (tens
    of MB of fresh memory each).  The columns must be the caller's own
    (written here)."""
    ri, blk, gix = cols[0], cols[1], cols[8]
    try:
        key = np.ravel_multi_index((ri, gix, blk), [int(k.max()) + 1 for k in (ri, gix, blk)])
    except ValueError:  # a product beyond an int64: all of them through the merge
        key = None
    if key is not None:
        # the keys in order, by one argsort: a repeated key's rows are
        # neighbours there, already in the order the merge needs (a sort, a
        # search of every key among the repeated ones and an order of those
        # took three times as long)
        by_key = np.argsort(key)
        s = key[by_key]
        repeat = s[1:] == s[:-1]
        if not repeat.any():
            return cols, None
        twin = np.zeros(len(s), bool)
        twin[1:] = repeat
        twin[:-1] |= repeat
        order = by_key[twin]  # the rows of repeated keys, in key order
    else:
        order = stream.order_by(ri, gix, blk)
    r, g, b = ri[order], gix[order], blk[order]
    seg = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (g[1:] != g[:-1]) | (b[1:] != b[:-1])])
    lead = order[seg]  # the row that holds each repeated key's figures
    for how, c in zip((np.add, np.minimum, np.maximum, np.add, np.minimum, np.maximum),
                      cols[2:8]):
        c[lead] = how.reduceat(c[order], seg)
    kept = np.ones(len(ri), bool)
    kept[order] = False
    kept[lead] = True
    return cols, kept


@dataclass
class _Places:
    """_reads_by_place's figures per (request, place in its rows): a place's
    bins are first_bin[request] + place."""

    first_bin: np.ndarray  # per request
    held: np.ndarray  # per bin: the block its earliest row holds there (0: none)
    several: np.ndarray  # per bin: its reads are not all of held's block
    used: np.ndarray  # the bins whose figures are these (not several, a block held)
    req: np.ndarray  # per bin: its request
    reads: np.ndarray  # per bin: its reads
    first: np.ndarray  # per bin: its first read's time
    last: np.ndarray  # per bin: its last read's time


# a request's per-block figures (request_access), in this order, and their
# types: a time is NaN where there is none (null in the report's JSON)
BLOCK_COLUMNS = ("group", "block", "tokens_written", "first_write_s", "last_write_s", "reads",
                 "first_read_s", "last_read_s")
_COLUMN_TYPES = {k: np.float64 if k.endswith("_s") else np.int64 for k in BLOCK_COLUMNS}
_NEVER, _EVER = np.iinfo(np.int64).max, np.iinfo(np.int64).min  # no first / last time


def _reads_by_place(ri, start, length, ts, entries, nreq) -> tuple:
    """The reads of a group's matched rows (request index ri, entries
    start:start + length, time ts: any ordered integer, such as a step
    time's rank), as (_Places or None where there are none, [partial
    figures]): figures per (request, place in its row) while the place holds
    one block, which is nearly always (a row only grows), and a partial one
    per (request, block) in each chunk at the places that held several
    blocks (a preempted request given new blocks) or a null entry (a block
    a window dropped).  Summing per place first keeps the final sort to the
    places, not the reads: a request reads each of its blocks at every step.

    A place's figures come from its request's rows alone, without a pass
    per read: its reads are the rows longer than it, its first and last
    read the earliest and latest of those, and its block the one the
    earliest holds there.  One pass over the reads (114M for a 1.1 GB
    trace) checks every read against that block; only if some place fails
    does a second pass take that place's reads one by one.  Three passes,
    each scattering or gathering per read, took seconds on a large trace.
    The reads are taken a few million at a time, rows whole: an array per
    read was the report's peak memory, and on a VM each GiB first touched
    costs seconds."""
    width = np.zeros(nreq, np.int64)  # each request's widest row
    np.maximum.at(width, ri, length)
    nbins = int(width.sum())  # one per (request, place)
    if not nbins:
        return None, []
    first_bin = np.cumsum(width) - width  # each request's first place
    row_at = np.cumsum(length) - length  # each row's first read
    contiguous = np.array_equal(start[1:], start[:-1] + length[:-1])
    # a read's place: its request's first place + its place in its row, as
    # an intp index (numpy casts any other type per use: an int32 key made
    # each gather 2.35 against 1.42 ns a read)
    base = (first_bin[ri] - row_at).astype(np.intp, copy=False)

    # each place's earliest and latest row: a request's rows in time order
    # (ties in row order, as a stable sort leaves them), and in reverse; the
    # first of them to reach past a place's start covers it first
    rank = np.empty(len(ts), np.int64)
    by_time = np.argsort(ts, kind="stable")
    rank[by_time] = np.arange(len(ts))

    def covering(order):  # per place, the first row of order to cover it
        r, n = ri[order], length[order]
        lift = r * (int(n.max()) + 1)  # a request's rows never reach its next's
        reach = np.maximum.accumulate(lift + n) - lift  # the widest so far
        before = np.r_[0, reach[:-1]]
        before[np.r_[True, r[1:] != r[:-1]]] = 0  # a request's first row
        new = np.flatnonzero(n > before)
        row = np.empty(nbins, np.int64)
        row[stream.ranges(first_bin[r[new]] + before[new], n[new] - before[new])] = \
            np.repeat(order[new], n[new] - before[new])
        return row

    # a request's rows in time order: the rows in time order, sorted stably
    # by request (a radix sort where request numbers fit 16 bits), and each
    # request's reversed, not two argsorts of (request, rank)
    req_in_time = ri[by_time]
    if nreq <= 1 << 16:
        req_in_time = req_in_time.astype(np.uint16)
    in_time = by_time[np.argsort(req_in_time, kind="stable")]
    rows_of_req = np.bincount(ri, minlength=nreq)
    end = np.cumsum(rows_of_req)[ri[in_time]]  # the end of each one's request's rows
    mirror = 2 * end - rows_of_req[ri[in_time]] - 1 - np.arange(len(ri))
    first_row = covering(in_time)
    last_row = covering(in_time[mirror])
    req_of = np.repeat(np.arange(nreq), width)
    place = np.arange(nbins) - first_bin[req_of]
    held = entries[start[first_row] + place]  # what the earliest row holds
    reads = np.cumsum(np.bincount(first_bin[ri], minlength=nbins + 1)
                      - np.bincount(first_bin[ri] + length, minlength=nbins + 1))[:nbins]

    def chunks(rows=None):  # rows (all: None) a few million reads at a time, rows whole
        sel = slice(None) if rows is None else rows
        n_of, base_of, row_of, start_of = length[sel], base[sel], row_at[sel], start[sel]
        for r0, r1 in stream.chunks(n_of, access_stream._CHUNK_READS):
            n = int(n_of[r0:r1].sum())
            if rows is None and contiguous:
                lo = int(row_of[r0])
                blk = entries[start[0] + lo:start[0] + lo + n]
                key = np.repeat(base_of[r0:r1], n_of[r0:r1])
                key += np.arange(lo, lo + n, dtype=np.intp)
            else:
                at = stream.ranges(row_of[r0:r1], n_of[r0:r1])  # the reads' numbers
                blk = entries[stream.ranges(start_of[r0:r1], n_of[r0:r1])]
                key = (np.repeat(base_of[r0:r1], n_of[r0:r1]) + at).astype(np.intp, copy=False)
            yield r0, r1, n_of[r0:r1], blk, key

    several = np.zeros(nbins, bool)  # places whose reads are not all held's
    # (a null read at a place that holds a block is one of these)
    for *_, blk, key in chunks():
        several[key[blk != held[key]]] = True
    out = []
    if several.any():
        # each read at such a place, summed per (place, block) in its chunk,
        # a block at a time: a round takes the reads of the block that each
        # place's next read holds, and leaves the others to the next round.
        # A place holds few blocks (a preempted request's new ones), so the
        # rounds are few and each is a count and two ufunc.at over what is
        # left, not one sort of every such read (millions on a large
        # trace).  Only the rows of requests with such a place are read
        # again; a part per read was most of request_access's memory.
        odd_req = np.zeros(nreq, bool)
        odd_req[req_of[several]] = True
        rows = np.flatnonzero(odd_req[ri])
        wanted = np.zeros(nbins, entries.dtype)  # per place: its block this round
        # per place: the earliest and latest rank of its round's reads, one
        # pair for every round, put back where a round wrote (two fresh
        # arrays of every place per round were not)
        first, last = np.full(nbins, len(ts)), np.full(nbins, -1)
        for r0, r1, n_of, blk, key in chunks(rows):
            at = np.flatnonzero(several[key])
            at = at[blk[at] > 0]  # a null entry is no read
            if not len(at):
                continue
            bins, b = key[at], blk[at]
            k = rank[np.repeat(rows[r0:r1], n_of)[at]]
            while len(bins):
                wanted[bins] = b  # of a place's reads left, one's block (the last one's)
                hit = b == wanted[bins]
                hb, hk = bins[hit], k[hit]
                count = np.bincount(hb, minlength=nbins)
                got = np.flatnonzero(count)
                np.minimum.at(first, hb, hk)
                np.maximum.at(last, hb, hk)
                m = len(got)
                out.append((req_of[got], wanted[got].astype(np.int64), count[got],
                            ts[by_time[first[got]]], ts[by_time[last[got]]],
                            np.zeros(m, np.int64), np.full(m, _NEVER), np.full(m, _EVER)))
                first[got], last[got] = len(ts), -1
                miss = ~hit
                bins, b, k = bins[miss], b[miss], k[miss]
    used = np.flatnonzero(~several & (held > 0))  # all of a place's reads null: none
    return _Places(first_bin, held, several, used, req_of, reads, ts[first_row],
                   ts[last_row]), out
