"""Reads derived from row events: the plugin tier's step_rows ops (each
scheduled request's seq_len and its row's new entries) and block events
(block_free nulls a block of a request's row; req_preempt and req_finish
end the row) replayed into every row at every step, and from them the
figures the counted path (block_table, docs/access.md) gives: reads per
block, last read, sharing, and per step the rows, tokens, reads, working
set and tokens held (docs/design.md, "Reads derived from row events").

Nothing here expands every entry at every step.  A row's entry at
position j holds its block from the request's k-th scheduled step until
it is freed, nulled or its row ends, at the m-th (a *tenure*); it is read
at each of the request's steps t in [k, m) whose seq_len covers it
(ceil(seq_len / block_size) > j).  A request's coverage only grows
within one life of its row, so the steps that read a tenure are one
range [first, m), found by one search, and they fall into the request's
runs of consecutive steps (a request scheduled at every step between its
admission and its end: one run).  Every figure is then a sum over those
(tenure, run) segments, by difference arrays and one sort of their ends:
the cost is O(events + scheduled rows + segments), whatever the rows'
lengths.

A row whose record does not continue what was replayed (tail_from, not 0,
is not the replayed length, or the tail is not row_len - tail_from long:
a row sent from 0 is whole, a fresh start), and a
step_rows or block_free op whose values were lost, are counted, never
guessed past: `Derived.exact` is then False, and `reasons` says why.
Pure logic (numpy), no bcc.
"""

from dataclasses import dataclass, field

import numpy as np

from .. import abi
from ..trace import stream
from ..trace.tracefile import MAX_BLOCKS
from . import access_stream

FREE_OP_ID = abi.OPS["block_free"]
RESET_OP_IDS = (abi.OPS["req_preempt"], abi.OPS["req_finish"])


@dataclass
class RowEvents:
    """What changes a row between step_rows ops: block_free (per block:
    op position, pid, request hash, group, block) and req_preempt /
    req_finish (op position, pid, request hash), in the OpStream's order."""

    free_pos: np.ndarray
    free_pid: np.ndarray
    free_req: np.ndarray
    free_group: np.ndarray
    free_block: np.ndarray
    reset_pos: np.ndarray
    reset_pid: np.ndarray
    reset_req: np.ndarray
    lost_frees: dict = field(default_factory=dict)  # pid -> block_free ops whose ids were lost


def row_events(ops: stream.OpStream) -> RowEvents:
    """The block_free and request-end ops of a decoded stream."""
    o = ops.ops
    is_free = o["op"] == FREE_OP_ID
    idx = np.flatnonzero(is_free & o["complete"])
    n = o["items"][idx].astype(np.int64)
    block = ops.values[stream.ranges(o["start"][idx], n)].astype(np.int64)
    lost = {}
    for p in o["pid"][is_free & ~o["complete"]].tolist():
        lost[int(p)] = lost.get(int(p), 0) + 1
    r = np.flatnonzero(np.isin(o["op"], RESET_OP_IDS))
    return RowEvents(np.repeat(idx, n), np.repeat(o["pid"][idx].astype(np.int64), n),
                     np.repeat(o["cache_id"][idx].astype(np.uint64), n),
                     np.repeat(o["cache_index"][idx].astype(np.int64), n), block,
                     r.astype(np.int64), o["pid"][r].astype(np.int64),
                     o["cache_id"][r].astype(np.uint64), lost)


@dataclass
class Derived:
    """One (process, KV-cache group)'s rows replayed, and its figures.

    Per step (each step_rows op of the group, in order): ts_ns, complete,
    rows, tokens (sum of seq_len), reads ((request, block) pairs read),
    distinct (blocks read: the step's working set), held_tokens (tokens in
    them, each block's fill as its first row in the step sees it).  Per
    block (0 .. highest read): reads_per_block, last_read_step (1 + the
    step of its last read, 0: never), last_read_ns, sharing (the most rows
    that read it at one step)."""

    pid: int
    group: int
    block_size: int
    num_blocks: int
    ts_ns: np.ndarray
    complete: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray
    reads: np.ndarray
    distinct: np.ndarray
    held_tokens: np.ndarray
    reads_per_block: np.ndarray
    last_read_step: np.ndarray
    last_read_ns: np.ndarray
    sharing: np.ndarray
    out_of_range: int  # reads of blocks at or above max_blocks, not per block
    mismatches: int  # rows whose record did not continue the replayed row
    incomplete: int  # step_rows ops whose rows were lost
    lost_frees: int  # block_free ops whose ids were lost
    # the replay, for per-row questions (verify mode, per request)
    _t: dict = None

    def __len__(self):
        return len(self.ts_ns)

    @property
    def exact(self) -> bool:
        return not (self.mismatches or self.incomplete or self.lost_frees)

    @property
    def reasons(self) -> list:
        out = []
        if self.mismatches:
            out.append(f"{self.mismatches} step_rows rows did not continue the replayed row "
                       f"(pid {self.pid} group {self.group})")
        if self.incomplete:
            out.append(f"{self.incomplete} step_rows ops whose rows were lost "
                       f"(pid {self.pid} group {self.group})")
        if self.lost_frees:
            out.append(f"{self.lost_frees} block_free ops whose ids were lost "
                       f"(pid {self.pid}): derived reads may count freed blocks")
        return out

    @property
    def utilization(self) -> np.ndarray:
        cap = self.distinct.astype(np.float64) * self.block_size
        return np.divide(self.held_tokens.astype(np.float64), cap,
                         out=np.full(len(cap), np.nan), where=cap > 0)

    def idle_before_reuse(self, gen_block, gen_start_ns) -> np.ndarray:
        """For each block generation (block, start: its first write) whose
        block was read at a step before the one it starts in: start - the
        time of that last read, in the generations' order (what
        access_stream.idle_before_reuse answers from tables).  A step's
        time here is its step_rows op's, the scheduler's, which comes
        before the step's writes: so the step a generation starts in is
        the latest one at or before its start, and its reads (the new
        owner's) are not before it.  The steps' times are taken as they
        come (one scheduler's ops, in order)."""
        t = self._t
        gen_block = np.asarray(gen_block, np.int64)
        gen_start_ns = np.asarray(gen_start_ns, np.int64)
        if not len(gen_block) or not len(t["seg_block"]):
            return np.zeros(0, np.int64)
        ts = self.ts_ns.astype(np.int64)
        K = len(ts) + 2
        b, s0, s1 = t["seg_block"], t["seg_s0"], t["seg_s1"]
        order = stream.order_by(b, s0)
        b, s0, s1 = b[order], s0[order], s1[order]
        key = b * K + s0
        # per segment, the latest end among its block's segments up to it
        reach = np.maximum.accumulate(b * K + s1) - b * K
        # the steps before the one each generation starts in
        c = np.maximum(np.searchsorted(ts, gen_start_ns, side="right") - 1, 0)
        at = np.searchsorted(key, gen_block * K + c, side="left") - 1
        ok = (at >= 0) & (gen_block >= 0)
        ok[ok] &= b[at[ok]] == gen_block[ok]
        last = np.minimum(reach[at[ok]], c[ok]) - 1
        return gen_start_ns[ok] - ts[last]

    def request_reads(self):
        """Per tenure read at all: (request index in requests(), block,
        reads, first step read, last step read), blocks in range only."""
        t = self._t
        seg_ten, s0, s1 = t["seg_ten"], t["seg_s0"], t["seg_s1"]
        n = len(t["ten_pos"])
        reads = np.bincount(seg_ten, weights=s1 - s0, minlength=n).astype(np.int64)
        first = np.full(n, len(self.ts_ns), np.int64)
        last = np.full(n, -1, np.int64)
        np.minimum.at(first, seg_ten, s0)
        np.maximum.at(last, seg_ten, s1 - 1)
        r = np.flatnonzero(reads)
        return t["ten_req"][r], t["ten_block"][r], reads[r], first[r], last[r]

    def request_writes(self):
        """Per (row, block) its step writes: (request index, block, tokens,
        step): the tokens [seq_len - new, seq_len) of each row, in the
        blocks its row holds there (none where it holds no block)."""
        t = self._t
        bs = self.block_size
        seq, new, cov = t["row_seq"], t["new"], t["row_cov"]
        z = np.zeros(0, np.int64)
        if bs <= 0 or not len(seq):
            return z, z, z, z
        first = np.clip(seq - new, 0, None)
        b0 = first // bs
        b1 = np.minimum((seq - 1) // bs, cov - 1)
        nw = np.where((new > 0) & (seq > 0), np.clip(b1 - b0 + 1, 0, None), 0)
        place = stream.ranges(b0, nw)
        rr = np.repeat(np.arange(len(seq)), nw)
        wrote = np.minimum(seq[rr], (place + 1) * bs) - np.maximum(first[rr], place * bs)
        ten = _tenure_at(t, t["rq"][rr], place, t["t_of"][rr])
        ok = ten >= 0
        return (t["rq"][rr][ok], t["ten_block"][ten[ok]], wrote[ok],
                t["row_step"][rr][ok])

    def requests(self) -> np.ndarray:
        """The request hashes the replay knows (request indices index it)."""
        return self._t["ureq"]

    def row_entries(self):
        """Every row at every step as the replay holds it, for the verify
        mode's comparison with block_table (O(entries), which that mode
        pays anyway): (seq_len per row, first per row, entries), row r's
        covered positions being entries[first[r]:first[r] + ceil(seq_len /
        block_size)], 0 where nothing is read (null, or never reported).
        Rows are those of this (pid, group) in the StepRows, in order."""
        t = self._t
        cov, G = t["row_cov"], t["G"]
        first = np.cumsum(cov) - cov
        flat = np.zeros(int(cov.sum()), np.int64)
        a, m = t["ten_first"], t["ten_m"]
        n = np.maximum(m - a, 0)  # a tenure read at all its steps from a on
        g = stream.ranges(a, n)
        r = G[g]
        flat[first[r] + np.repeat(t["ten_pos"], n)] = np.repeat(t["ten_block"], n)
        gcov = cov[G]
        for ten in np.flatnonzero(t["ten_odd"]).tolist():  # coverage went back: step by step
            k, e, p = int(t["ten_k"][ten]), int(m[ten]), int(t["ten_pos"][ten])
            for j in np.flatnonzero(gcov[k:e] > p).tolist():
                flat[first[G[k + j]] + p] = t["ten_block"][ten]
        return t["row_seq"], first, flat


def _tenure_at(t: dict, req, pos, g) -> np.ndarray:
    """The tenure that holds (request index, row position) at the
    request's g-th row (G index), -1 where none does."""
    k, tr, tp = t["ten_k"], t["ten_req"], t["ten_pos"]
    if not len(k) or not len(req):
        return np.full(len(req), -1, np.int64)
    order = stream.order_by(tr, tp, k)
    W = int(max(tp.max(), np.max(pos))) + 1
    R = len(t["G"]) + 1
    key = (tr[order] * W + tp[order]) * R + k[order]
    at = np.searchsorted(key, (req * W + pos) * R + g, side="right") - 1
    ten = np.where(at >= 0, order[np.maximum(at, 0)], -1)
    ok = ten >= 0
    ok[ok] &= (tr[ten[ok]] == req[ok]) & (tp[ten[ok]] == pos[ok]) & (t["ten_m"][ten[ok]] > g[ok])
    return np.where(ok, ten, -1)


def _next_after(q_key, q_pos, d_key, d_pos) -> np.ndarray:
    """For each query (key, pos): the index in d of the first item with the
    same key and a greater pos, -1 where none."""
    nq = len(q_key)
    if not nq:
        return np.zeros(0, np.int64)
    if not len(d_key):
        return np.full(nq, -1, np.int64)
    key = np.concatenate([q_key, d_key]).astype(np.int64)
    pos = np.concatenate([q_pos, d_pos]).astype(np.int64)
    flag = np.concatenate([np.ones(nq, np.int64), np.zeros(len(d_key), np.int64)])
    order = stream.order_by(key, pos, flag)  # at equal pos, data first: not after
    is_d = flag[order] == 0
    big = len(order)
    nxt = np.where(is_d, np.arange(big), big)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1]
    cand = np.r_[nxt[1:], big]
    qs = np.flatnonzero(~is_d)
    c = cand[qs]
    ok = c < big
    ok[ok] &= key[order][c[ok]] == key[order][qs[ok]]
    out = np.full(nq, -1, np.int64)
    out[order[qs[ok]]] = order[c[ok]] - nq
    return out


def select(sr: stream.StepRows, pid: int, group: int):
    """(op indices, row indices) of sr's ops of one (pid, group)."""
    ops = np.flatnonzero((sr.pid.astype(np.int64) == pid) & (sr.group.astype(np.int64) == group))
    rows = stream.ranges(sr.lo[ops], sr.lo[ops + 1] - sr.lo[ops])
    return ops, rows


def groups_of(sr: stream.StepRows) -> list:
    """The (pid, group) pairs that have step_rows ops, in order of first op."""
    seen = {}
    for p, g in zip(sr.pid.tolist(), sr.group.tolist()):
        seen.setdefault((int(p), int(g)), None)
    return list(seen)


def replay(sr: stream.StepRows, ev: RowEvents, pid: int, group: int,
           max_blocks: int = MAX_BLOCKS) -> Derived:
    """Replays one (pid, group)'s step_rows ops and row events (module doc)
    into its figures."""
    ops, rows = select(sr, pid, group)
    K = len(ops)
    bs = int(sr.block_size[ops[0]]) if K else 0
    nblocks = int(sr.num_blocks[ops].max()) if K else 0
    ts = sr.ts_ns[ops].astype(np.int64)
    complete = sr.complete[ops].astype(bool)
    op_pos = sr.pos[ops].astype(np.int64)
    R = len(rows)
    row_step = np.repeat(np.arange(K), (sr.lo[ops + 1] - sr.lo[ops]).astype(np.int64))
    row_pos = op_pos[row_step]
    seq = sr.seq_len[rows].astype(np.int64)
    tail_from = sr.tail_from[rows].astype(np.int64)
    row_len = sr.row_len[rows].astype(np.int64)
    t_lo = sr.tail_lo[rows].astype(np.int64)
    ntail = sr.tail_lo[rows + 1].astype(np.int64) - t_lo
    cov = np.maximum(-(-seq // bs), 0) if bs > 0 else np.zeros(R, np.int64)

    # this process's events; frees of this group
    fm = (ev.free_pid == pid) & (ev.free_group == group)
    f_pos, f_req, f_block = ev.free_pos[fm], ev.free_req[fm], ev.free_block[fm]
    rm = ev.reset_pid == pid
    r_pos, r_req = ev.reset_pos[rm], ev.reset_req[rm]
    ureq, inv = np.unique(np.concatenate([sr.req[rows].astype(np.uint64), f_req, r_req]),
                          return_inverse=True)
    inv = inv.reshape(-1)
    rq, fq, resq = inv[:R], inv[R:R + len(f_req)], inv[R + len(f_req):]

    # the rows request by request, each's in order: a request's t-th
    # scheduled step is G[t] (rows are in op order, so a stable sort)
    G = np.argsort(rq, kind="stable")
    t_of = np.empty(R, np.int64)
    t_of[G] = np.arange(R)
    gq = rq[G]
    first_of_req = np.r_[True, gq[1:] != gq[:-1]] if R else np.zeros(0, bool)

    # what the replay held before each row: the request's row before it
    # (its after-length), unless the row ended since (a reset between)
    after = tail_from + ntail
    before = np.zeros(R, np.int64)
    cur = G[~first_of_req]  # each row that has one before it, and that one
    prev = G[np.flatnonzero(~first_of_req) - 1]
    nxt = _next_after(rq[prev], row_pos[prev], resq, r_pos)
    reset_between = (nxt >= 0) & (r_pos[np.maximum(nxt, 0)] < row_pos[cur]) if len(r_pos) \
        else np.zeros(len(cur), bool)
    before[cur] = np.where(reset_between, 0, after[prev])
    # a row sent from 0 is whole: a fresh start (after a preemption), never
    # a guess, whatever was held before
    mismatch = ((tail_from != before) & (tail_from != 0)) | (ntail != row_len - tail_from)
    cuts = np.flatnonzero(tail_from < before)  # rows that overwrite held positions

    # tenures: every non-null tail entry
    e_row = np.repeat(np.arange(R), ntail)
    e_pos = stream.ranges(tail_from, ntail) if R else np.zeros(0, np.int64)
    e_block = sr.tail[stream.ranges(t_lo, ntail)].astype(np.int64) if R else \
        np.zeros(0, np.int64)
    keep = e_block > 0
    e_row, e_pos, e_block = e_row[keep], e_pos[keep], e_block[keep]
    T = len(e_row)
    ten_req = rq[e_row]
    k = t_of[e_row]
    open_pos = row_pos[e_row]
    hi_block = int(max(e_block.max() if T else 0, f_block.max() if len(f_block) else 0)) + 1
    free_at = _next_after(ten_req * hi_block + e_block, open_pos,
                          fq * hi_block + np.clip(f_block, 0, None), f_pos)
    reset_at = _next_after(ten_req, open_pos, resq, r_pos)
    P = int(max(op_pos.max() if K else 0, f_pos.max() if len(f_pos) else 0,
                r_pos.max() if len(r_pos) else 0)) + 2
    close = np.full(T, P - 1, np.int64)
    has = free_at >= 0
    close[has] = f_pos[free_at[has]]
    has = reset_at >= 0
    close[has] = np.minimum(close[has], r_pos[reset_at[has]])
    gkey = gq * P + row_pos[G]
    m = np.searchsorted(gkey, ten_req * P + close, side="left")
    for c in cuts.tolist():  # rare: only where a row did not continue
        tc = t_of[c]
        hit = (ten_req == rq[c]) & (k < tc) & (e_pos >= tail_from[c]) & (m > tc)
        m[hit] = tc

    # the steps that read each tenure: [first, m) where coverage grows
    gcov = cov[G]
    nd_brk = first_of_req | np.r_[False, gcov[1:] < gcov[:-1]] if R else np.zeros(0, bool)
    nd_run = np.cumsum(nd_brk) - 1
    CM = int(gcov.max()) + 2 if R else 2
    nd_key = nd_run * CM + gcov
    mono = np.ones(T, bool)
    live = m > k
    mono[live] = nd_run[m[live] - 1] == nd_run[k[live]]
    first = np.maximum(np.searchsorted(nd_key, nd_run[k] * CM + e_pos, side="right"), k) \
        if T else np.zeros(0, np.int64)
    first = np.where(mono, np.minimum(first, m), m)
    # the requests' runs of consecutive steps
    gstep = row_step[G]
    run_brk = first_of_req | np.r_[False, gstep[1:] != gstep[:-1] + 1] if R else \
        np.zeros(0, bool)
    run_id = np.cumsum(run_brk) - 1
    run_start = np.flatnonzero(run_brk)
    run_end = np.r_[run_start[1:], R]
    readt = np.flatnonzero(m > first)
    r0, r1 = run_id[first[readt]], run_id[m[readt] - 1]
    nseg = r1 - r0 + 1
    seg_run = stream.ranges(r0, nseg)
    seg_ten = np.repeat(readt, nseg)
    lo = np.maximum(run_start[seg_run], first[seg_ten])
    hi = np.minimum(run_end[seg_run], m[seg_ten])
    seg_s0, seg_s1 = gstep[lo], gstep[hi - 1] + 1
    # tenures whose coverage shrank within their life: step by step (rare)
    odd_ten, odd_s = [], []
    for ten in np.flatnonzero(~mono & (m > k)).tolist():
        ts_ = np.arange(k[ten], m[ten])
        ts_ = ts_[gcov[ts_] > e_pos[ten]]
        odd_ten.append(np.full(len(ts_), ten))
        odd_s.append(gstep[ts_])
    if odd_ten:
        o_ten, o_s = np.concatenate(odd_ten), np.concatenate(odd_s)
        seg_ten = np.concatenate([seg_ten, o_ten])
        seg_s0 = np.concatenate([seg_s0, o_s])
        seg_s1 = np.concatenate([seg_s1, o_s + 1])
    seg_block = e_block[seg_ten]
    inside = seg_block < max_blocks
    out_of_range = int((seg_s1 - seg_s0)[~inside].sum())
    seg_ten, seg_block = seg_ten[inside], seg_block[inside]
    seg_s0, seg_s1 = seg_s0[inside], seg_s1[inside]

    # per block
    nb = int(seg_block.max()) + 1 if len(seg_block) else 0
    span = seg_s1 - seg_s0
    reads_per_block = np.bincount(seg_block, weights=span, minlength=nb).astype(np.int64)
    last_step = np.zeros(nb, np.int64)
    np.maximum.at(last_step, seg_block, seg_s1)
    last_ns = np.where(last_step > 0, ts[np.maximum(last_step - 1, 0)] if K else 0, 0)
    # per step: reads, and from the segments' ends in block order, each
    # block's readers at each step: distinct blocks and sharing
    reads = np.cumsum(np.bincount(seg_s0, minlength=K + 1) -
                      np.bincount(seg_s1, minlength=K + 1))[:K]
    eb = np.concatenate([seg_block, seg_block])
    es = np.concatenate([seg_s0, seg_s1])
    ed = np.concatenate([np.ones(len(seg_s0), np.int64), -np.ones(len(seg_s1), np.int64)])
    order = stream.order_by(eb, es, (ed + 1) // 2)  # at one step, ends first
    eb, es, ed = eb[order], es[order], ed[order]
    cnt = np.cumsum(ed)  # each block's ends sum to 0: the running count is per block
    sharing = np.zeros(nb, np.int64)
    np.maximum.at(sharing, eb, cnt)
    g = (cnt > 0).astype(np.int64)
    dg = g - np.r_[0, g[:-1]]
    distinct = np.cumsum(np.bincount(es, weights=dg, minlength=K + 1))[:K].astype(np.int64)
    tokens = np.bincount(row_step, weights=seq, minlength=K).astype(np.int64)
    nrows = np.bincount(row_step, minlength=K).astype(np.int64)

    # tokens held: block_size a block read, but a row's last block, which
    # holds seq_len - (n - 1) x block_size, as its first row at the step sees it
    held = distinct * bs
    rem = seq - (cov - 1) * bs
    part = np.flatnonzero((cov >= 1) & (rem < bs))
    if len(part) and T:
        ten = _tenure_at({"ten_k": k, "ten_req": ten_req, "ten_pos": e_pos, "ten_m": m, "G": G},
                         rq[part], cov[part] - 1, t_of[part])
        ok = ten >= 0
        ok[ok] &= e_block[ten[ok]] < max_blocks
        part, ten = part[ok], ten[ok]
        blk, s = e_block[ten], row_step[part]
        alone = sharing[blk] == 1
        # else the count of its readers at that step, from the ends above
        ekey = (eb * (K + 2) + es) * 2 + (ed + 1) // 2
        at = np.searchsorted(ekey, (blk * (K + 2) + s) * 2 + 1, side="right") - 1
        here = np.where((at >= 0) & (eb[np.maximum(at, 0)] == blk), cnt[np.maximum(at, 0)], 0)
        alone |= here == 1
        deficit = np.zeros(K, np.int64)
        np.add.at(deficit, s[alone], bs - rem[part][alone])
        for i, b, st in zip(part[~alone].tolist(), blk[~alone].tolist(), s[~alone].tolist()):
            # shared at that step: the first row of the step that reads it
            readers = seg_ten[(seg_block == b) & (seg_s0 <= st) & (seg_s1 > st)]
            reqs = ten_req[readers]
            at_step = np.flatnonzero((row_step == st) & np.isin(rq, reqs))
            if len(at_step) and int(at_step.min()) == i:
                deficit[st] += bs - int(rem[i])
        held = held - deficit

    return Derived(
        pid=pid, group=group, block_size=bs, num_blocks=nblocks, ts_ns=ts, complete=complete,
        rows=nrows, tokens=tokens, reads=reads.astype(np.int64), distinct=distinct,
        held_tokens=held.astype(np.int64), reads_per_block=reads_per_block.astype(np.uint64),
        last_read_step=last_step.astype(np.uint64), last_read_ns=last_ns.astype(np.int64),
        sharing=sharing, out_of_range=out_of_range, mismatches=int(mismatch.sum()),
        incomplete=int(np.count_nonzero(~complete)), lost_frees=int(ev.lost_frees.get(pid, 0)),
        _t={"G": G, "t_of": t_of, "row_seq": seq, "row_cov": cov, "ten_pos": e_pos,
            "ten_block": e_block, "ten_first": first, "ten_m": m, "ten_k": k,
            "ten_odd": ~mono & (m > k), "ten_req": ten_req, "ureq": ureq, "rq": rq,
            "row_step": row_step, "seg_ten": seg_ten, "seg_block": seg_block,
            "seg_s0": seg_s0, "seg_s1": seg_s1, "rows": rows,
            "new": sr.new_tokens[rows].astype(np.int64), "pos": op_pos})


def pair_groups(derived: list, counted: list) -> dict:
    """{(pid, group): the counted group's index} for each derived group that
    has a counted one (block_table) for the same table: the same (pid,
    group id), as the plugin fires both; else, in a process, the only
    derived and the only counted group left, of one block size and as many
    steps (kvsim names its table by its buffer's address, its step_rows
    and block events by group 0).  counted: [(index, pid, group id, block
    size, steps)]."""
    out = {}
    ids = {(pid, gid): i for i, pid, gid, _, _ in counted}
    for d in derived:
        if (d.pid, d.group) in ids:
            out[(d.pid, d.group)] = ids[(d.pid, d.group)]
    taken = set(out.values())
    for pid in {d.pid for d in derived}:
        left_d = [d for d in derived if d.pid == pid and (d.pid, d.group) not in out]
        left_c = [c for c in counted if c[1] == pid and c[0] not in taken]
        if len(left_d) == 1 and len(left_c) == 1:
            (d,), (c,) = left_d, left_c
            if c[3] == d.block_size and c[4] == len(d):
                out[(d.pid, d.group)] = c[0]
    return out


def replay_all(sr: stream.StepRows, ev: RowEvents, max_blocks: int = MAX_BLOCKS) -> list:
    """replay() of every (pid, group) with step_rows ops: what `make bench`
    times for the derived path."""
    return [replay(sr, ev, p, g, max_blocks) for p, g in groups_of(sr)]


class DerivedRows:
    """A derived group where the report has a counted group's Rows: the
    same questions (its steps, the reads per block over runs of steps, the
    per-block scan, prefix reuse), answered from the replay's segments."""

    def __init__(self, d: Derived):
        self.derived = d
        self.steps = access_stream.Steps(
            d.pid, d.group, d.block_size, d.ts_ns, d.rows, d.reads, d.distinct, d.tokens,
            d.held_tokens, d.complete, d._t["pos"])

    def block_counts(self, spans, nb: int):
        """Rows.block_counts: per span (k0, k1) of steps, the reads per
        block 0 .. nb - 1; each segment split at the spans' edges."""
        t = self.derived._t
        b, s0, s1 = t["seg_block"], t["seg_s0"], t["seg_s1"]
        spans = list(spans)
        if not spans:
            return
        edges = np.array([k0 for k0, _ in spans] + [spans[-1][1]], np.int64)
        keep = (s1 > edges[0]) & (s0 < edges[-1]) & (b < nb)
        b, s0, s1 = b[keep], np.maximum(s0[keep], edges[0]), np.minimum(s1[keep], edges[-1])
        i0 = np.searchsorted(edges, s0, side="right") - 1
        i1 = np.searchsorted(edges, s1 - 1, side="right") - 1
        n = i1 - i0 + 1
        span = stream.ranges(i0, n)
        seg = np.repeat(np.arange(len(b)), n)
        w = np.minimum(s1[seg], edges[span + 1]) - np.maximum(s0[seg], edges[span])
        order = np.argsort(span, kind="stable")
        span, blk, w = span[order], b[seg][order], w[order]
        at = np.searchsorted(span, np.arange(len(spans) + 1))
        for i in range(len(spans)):
            yield np.bincount(blk[at[i]:at[i + 1]], weights=w[at[i]:at[i + 1]],
                              minlength=nb).astype(np.int64)[:nb]

    def scan(self, gen_block=(), gen_start_ns=(), max_blocks: int = MAX_BLOCKS):
        """Rows.scan's ReadScan, from the replay."""
        d = self.derived
        return access_stream.ReadScan(d.reads_per_block, d.last_read_step, d.last_read_ns,
                                      d.sharing, d.out_of_range,
                                      d.idle_before_reuse(gen_block, gen_start_ns))

    def prefix_reuse(self) -> dict:
        """access_requests' prefix reuse by request id: at a request's first
        row, the blocks it holds below seq_len - new tokens (whole blocks)."""
        d = self.derived
        t = d._t
        G, rq = t["G"], t["rq"]
        if not len(G) or d.block_size <= 0:
            return {"requests": 0, "blocks": 0, "per_block": {}, "steps_without_writes": 0,
                    "by": "request ids"}
        gq = rq[G]
        firsts = np.flatnonzero(np.r_[True, gq[1:] != gq[:-1]])  # each request's first row
        first_t = np.full(len(t["ureq"]), -1, np.int64)
        first_t[gq[firsts]] = firsts
        row = G[firsts]
        cached = np.zeros(len(t["ureq"]), np.int64)
        cached[gq[firsts]] = np.minimum(
            np.clip(t["row_seq"][row] - t["new"][row], 0, None) // d.block_size,
            t["row_cov"][row])
        req = t["ten_req"]
        hit = (t["ten_k"] == first_t[req]) & (t["ten_pos"] < cached[req])
        blocks, n = np.unique(t["ten_block"][hit], return_counts=True)
        return {"requests": int(len(firsts)), "blocks": int(n.sum()),
                "per_block": dict(zip(blocks.tolist(), n.tolist())),
                "steps_without_writes": 0, "by": "request ids"}


def verify(d: Derived, sr_pos: np.ndarray, st: "access_stream.Steps",
           rows: "access_stream.Rows", scan: "access_stream.ReadScan") -> dict:
    """The verify mode's check (recordings with both step_rows and
    block_table for a group): each table matched to the group's step_rows
    op of the same step, and, step by step, the rows it held (seq_len and
    the entries read) and the step's figures (rows, tokens, reads, working
    set, tokens held) equal to the replay's; where every step matched
    whole, the reads per block too.  A table's step_rows op is its
    neighbour among the group's tables and step_rows ops in stream order,
    on the side that pairs the most tables (the plugin fires a step's
    tables, then its step_rows), where the two agree on rows and tokens; a
    table with none is counted as unmatched.  Returns {"steps", "rows", "steps_differ", "rows_differ",
    "blocks_differ", "unmatched", "first": a line on the first difference
    or None}."""
    out = {"steps": 0, "rows": 0, "steps_differ": 0, "rows_differ": 0, "blocks_differ": 0,
           "unmatched": 0, "first": None}
    if not len(st):
        return out
    # the group's tables and step_rows ops in stream order; a table's
    # neighbours there, after it first
    kind = np.r_[np.zeros(len(st), np.int64), np.ones(len(sr_pos), np.int64)]
    where = np.r_[st.index, sr_pos].astype(np.int64)
    idx = np.r_[np.arange(len(st)), np.arange(len(sr_pos))]
    order = np.argsort(where, kind="stable")
    kind, idx = kind[order], idx[order]
    tables = np.flatnonzero(kind == 0)

    def pairs(side):  # each table with its neighbour on one side, where they agree
        at = np.full(len(st), -1, np.int64)
        nb = tables + side
        ok = (nb >= 0) & (nb < len(kind))
        ok[ok] &= kind[nb[ok]] == 1
        t, j = idx[tables[ok]], idx[nb[ok]]
        same = (st.rows[t] == d.rows[j]) & (st.tokens[t] == d.tokens[j])
        at[t[same]] = j[same]
        return at
    # the side the producer fires them on: the one that pairs more
    at = max((pairs(1), pairs(-1)), key=lambda a: int(np.count_nonzero(a >= 0)))
    ok = (at >= 0) & st.complete
    ok[ok] &= d.complete[at[ok]]
    out["unmatched"] = int(np.count_nonzero(~ok))
    seqs, first, flat = d.row_entries()
    d_lo = np.r_[0, np.cumsum(d.rows)]
    fields = ("rows", "tokens", "reads", "distinct", "held_tokens")

    def note(what):
        if out["first"] is None:
            out["first"] = what
    for k in np.flatnonzero(ok).tolist():
        j = int(at[k])
        out["steps"] += 1
        diff = [f for f in fields if int(getattr(st, f)[k]) != int(getattr(d, f)[j])]
        if diff:
            out["steps_differ"] += 1
            note(f"step {k}: " + ", ".join(f"{f} {int(getattr(st, f)[k])} counted, "
                                           f"{int(getattr(d, f)[j])} derived" for f in diff))
        r0, r1 = int(rows.row_lo[k]), int(rows.row_lo[k + 1])
        q0, q1 = int(d_lo[j]), int(d_lo[j + 1])
        if r1 - r0 != q1 - q0:
            out["rows_differ"] += max(r1 - r0, q1 - q0)
            note(f"step {k}: {r1 - r0} rows counted, {q1 - q0} derived")
            continue
        for r, q in zip(range(r0, r1), range(q0, q1)):
            out["rows"] += 1
            a = rows.entries[int(rows.start[r]):int(rows.start[r]) + int(rows.length[r])]
            b = flat[int(first[q]):int(first[q]) + int(rows.length[r])]
            if int(rows.seq[r]) != int(seqs[q]) or len(a) != len(b) or \
                    not np.array_equal(np.where(a > 0, a, 0), b):
                out["rows_differ"] += 1
                note(f"step {k} row {r - r0}: seq_len {int(rows.seq[r])} and "
                     f"{a.tolist()[:8]} counted, {int(seqs[q])} and {b.tolist()[:8]} derived")
    if not out["unmatched"] and len(st) == len(d) and d.exact:
        a, b = scan.reads_per_block.astype(np.int64), d.reads_per_block.astype(np.int64)
        n = max(len(a), len(b))
        a, b = np.r_[a, np.zeros(n - len(a), np.int64)], np.r_[b, np.zeros(n - len(b), np.int64)]
        out["blocks_differ"] = int(np.count_nonzero(a != b))
        if out["blocks_differ"]:
            w = int(np.flatnonzero(a != b)[0])
            note(f"block {w}: {a[w]} reads counted, {b[w]} derived")
    return out


class _LiveReq:
    """One request's row in LiveRows."""

    __slots__ = ("row", "since", "pos_of", "cov", "n", "last_step", "active", "ncov")

    def __init__(self):
        self.row = []  # block ids (0: null, or never reported)
        self.since = []  # per position: the request's step count when its reads began, -1: none
        self.pos_of = {}  # block -> position
        self.cov = 0  # positions [0, cov) are read at its steps
        self.n = 0  # its scheduled steps so far
        self.last_step = -1  # the group's step of its latest
        self.active = False  # its covered blocks are in the group's readers
        self.ncov = 0  # covered positions holding a block in range


class _LiveGroup:
    def __init__(self, pid, group, block_size, num_blocks, max_blocks):
        self.pid, self.group, self.block_size, self.num_blocks = pid, group, block_size, num_blocks
        self.max_blocks = max_blocks
        self.reqs = {}
        self.readers = {}  # block -> rows reading it at the latest step (active requests)
        self.closed = np.zeros(0, np.int64)  # reads of ended tenures, per block
        self.closed_last = np.zeros(0, np.int64)  # 1 + the step of their last read
        self.steps = self.requests = self.tokens = self.reads = 0
        self.distinct = self.held_tokens = 0
        self.out_of_range = self.mismatches = self.incomplete = 0

    def _grow(self, b):
        if b >= len(self.closed):
            n = max(b + 1, 2 * len(self.closed), 64)
            self.closed = np.r_[self.closed, np.zeros(n - len(self.closed), np.int64)]
            self.closed_last = np.r_[self.closed_last,
                                     np.zeros(n - len(self.closed_last), np.int64)]

    def _read(self, b, delta):
        c = self.readers.get(b, 0) + delta
        if c:
            self.readers[b] = c
        else:
            del self.readers[b]

    def _stop(self, r, j):
        """Position j of r stops being read (freed, nulled, uncovered)."""
        b, s = r.row[j], r.since[j]
        if s < 0:
            return
        r.since[j] = -1
        if b >= self.max_blocks:
            self.out_of_range += r.n - s
            return
        r.ncov -= 1
        if r.n > s:
            self._grow(b)
            self.closed[b] += r.n - s
            self.closed_last[b] = max(self.closed_last[b], r.last_step + 1)
        if r.active:
            self._read(b, -1)

    def _start(self, r, j):
        b = r.row[j]
        if b <= 0 or r.since[j] >= 0:
            return
        r.since[j] = r.n
        if b < self.max_blocks:
            r.ncov += 1
            if r.active:
                self._read(b, 1)

    def free(self, req, blocks):
        r = self.reqs.get(req)
        if r is None:
            return
        for b in blocks:
            j = r.pos_of.pop(b, None)
            if j is not None:
                self._stop(r, j)
                r.row[j] = 0

    def reset(self, req):
        r = self.reqs.pop(req, None)
        if r is None:
            return
        for j in range(len(r.row)):
            self._stop(r, j)

    def step(self, recs, complete=True):
        """One step_rows op: recs [(req, seq_len, new, row_len, tail_from, tail)]."""
        s = self.steps
        self.steps += 1
        if not complete:
            self.incomplete += 1
        bs = self.block_size
        here = {rec[0] for rec in recs}
        for req, r in self.reqs.items():  # left out of this step: not read at it
            if r.active and req not in here:
                for j in range(min(r.cov, len(r.row))):
                    if r.since[j] >= 0 and r.row[j] < self.max_blocks:
                        self._read(r.row[j], -1)
                r.active = False
        reads = tokens = 0
        for req, seq, new, row_len, tail_from, tail in recs:
            r = self.reqs.get(req)
            if r is None:
                r = self.reqs[req] = _LiveReq()
            if (tail_from != len(r.row) and tail_from) or len(tail) != row_len - tail_from:
                self.mismatches += 1
            if tail_from < len(r.row):  # overwritten: its tenures end
                for j in range(tail_from, len(r.row)):
                    self._stop(r, j)
                    r.pos_of.pop(r.row[j], None)
                del r.row[tail_from:], r.since[tail_from:]
                r.cov = min(r.cov, tail_from)
            elif tail_from > len(r.row):  # never reported: read as nothing
                gap = tail_from - len(r.row)
                r.row += [0] * gap
                r.since += [-1] * gap
            for b in tail:
                b = int(b)
                if b > 0:
                    r.pos_of[b] = len(r.row)
                r.row.append(b)
                r.since.append(-1)
            if not r.active:  # back in the step: its covered blocks are read again
                r.active = True
                for j in range(min(r.cov, len(r.row))):
                    if r.since[j] >= 0 and r.row[j] < self.max_blocks:
                        self._read(r.row[j], 1)
            cov = max(-(-seq // bs), 0) if bs > 0 else 0
            old = min(r.cov, len(r.row))
            new_cov = min(cov, len(r.row))
            for j in range(new_cov, old):
                self._stop(r, j)
            for j in range(old, new_cov):
                self._start(r, j)
            # (a position appended below the old coverage: overwritten above)
            r.cov = cov
            r.n += 1
            r.last_step = s
            reads += r.ncov
            tokens += seq
        distinct = len(self.readers)
        held = distinct * bs
        for i, (req, seq, *_rest) in enumerate(recs):
            # a row's last block holds seq_len - (n - 1) x block_size, as its
            # first row at the step sees it
            r = self.reqs[req]
            n = -(-seq // bs) if bs > 0 else 0
            rem = seq - (n - 1) * bs
            if n < 1 or rem >= bs or n > len(r.row):
                continue
            b = r.row[n - 1]
            if b <= 0 or b >= self.max_blocks:
                continue
            if self.readers.get(b, 0) > 1:
                first = next(k for k, rec in enumerate(recs)
                             if self.reqs[rec[0]].pos_of.get(b, 1 << 62) <
                             min(self.reqs[rec[0]].cov, len(self.reqs[rec[0]].row)))
                if first != i:
                    continue
            held -= bs - rem
        self.requests += len(recs)
        self.tokens += tokens
        self.reads += reads
        self.distinct += distinct
        self.held_tokens += held

    def snapshot(self) -> dict:
        """The group's figures as attach's maps have them (aggregate's raw
        group, reads_per_block and last_read_step included): O(open entries)."""
        reads = self.closed.copy()
        last = self.closed_last.copy()
        for r in self.reqs.values():
            for j, (b, s) in enumerate(zip(r.row, r.since)):
                if s >= 0 and r.n > s and b < self.max_blocks:
                    if b >= len(reads):
                        n = b + 1
                        reads = np.r_[reads, np.zeros(n - len(reads), np.int64)]
                        last = np.r_[last, np.zeros(n - len(last), np.int64)]
                    reads[b] += r.n - s
                    last[b] = max(last[b], r.last_step + 1)
        hi = int(np.flatnonzero(reads)[-1]) + 1 if np.any(reads) else 0
        nb = max(hi, self.num_blocks)
        pad = max(0, nb - len(reads))
        return dict(pid=self.pid, group_id=self.group, block_size=self.block_size,
                    num_blocks=nb, steps=self.steps, layer_calls=self.steps,
                    requests=self.requests, tokens=self.tokens, reads=self.reads,
                    distinct=self.distinct, held_tokens=self.held_tokens, null_entries=0,
                    out_of_range=self.out_of_range, truncated=0, read_errors=0,
                    reads_per_block=np.r_[reads, np.zeros(pad, np.int64)][:nb].astype(np.uint64),
                    last_read_step=np.r_[last, np.zeros(pad, np.int64)][:nb].astype(np.uint64),
                    mismatches=self.mismatches, incomplete=self.incomplete)


class LiveRows:
    """Derived reads live (attach, --prometheus): step_rows ops and row
    events fed in stream order, batch after batch; each step costs
    O(rows + new entries + coverage gained or lost), and the entries of a
    request left out of a step or back in it; a snapshot costs O(open
    entries).  Same definitions as replay() (tests/test_unit_derived_rows.py
    holds the two equal)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self.groups = {}  # (pid, group) -> _LiveGroup

    def add(self, ops: stream.OpStream):
        """A decoded batch of ops, in seq order, after those added before."""
        self.add_rows(stream.step_rows(ops), row_events(ops))

    def add_rows(self, sr: stream.StepRows, ev: RowEvents):
        # the batch's step_rows ops, frees and resets, merged by position
        items = [(int(p), 0, k) for k, p in enumerate(sr.pos.tolist())]
        items += [(int(p), 1, i) for i, p in enumerate(ev.free_pos.tolist())]
        items += [(int(p), 2, i) for i, p in enumerate(ev.reset_pos.tolist())]
        items.sort()
        for pos, kind, i in items:
            if kind == 0:
                key = (int(sr.pid[i]), int(sr.group[i]))
                g = self.groups.get(key)
                if g is None:
                    g = self.groups[key] = _LiveGroup(
                        key[0], key[1], int(sr.block_size[i]), int(sr.num_blocks[i]),
                        self.max_blocks)
                lo, hi = int(sr.lo[i]), int(sr.lo[i + 1])
                recs = [(int(sr.req[j]), int(sr.seq_len[j]), int(sr.new_tokens[j]),
                         int(sr.row_len[j]), int(sr.tail_from[j]),
                         sr.tail[int(sr.tail_lo[j]):int(sr.tail_lo[j + 1])].tolist())
                        for j in range(lo, hi)]
                g.step(recs, bool(sr.complete[i]))
            elif kind == 1:
                # a free op's blocks come one by one here: each is looked up
                g = self.groups.get((int(ev.free_pid[i]), int(ev.free_group[i])))
                if g is not None:
                    g.free(int(ev.free_req[i]), (int(ev.free_block[i]),))
            else:
                pid, req = int(ev.reset_pid[i]), int(ev.reset_req[i])
                for (p, _), g in self.groups.items():
                    if p == pid:
                        g.reset(req)

    def snapshot(self) -> list:
        return [g.snapshot() for g in self.groups.values()]

    def merge_into(self, raw: dict) -> dict:
        """raw (Tracer.read_maps()'s maps) with a group of derived reads for
        each (pid, group) with step_rows in a process whose reads the
        kernel counts in no group (it counts them only where block_table
        is attached: the plugin's with --verify-rows, kvsim's and a
        worker's attention op), after the counted ones: the counted ones
        are shown where there are any, as report does (pair_groups)."""
        counted = {g["pid"] for g in raw.get("groups", [])}
        extra = [dict(g, index=_LIVE_INDEX + i) for i, g in enumerate(self.snapshot())
                 if g["pid"] not in counted]
        if extra:
            raw = dict(raw, groups=list(raw.get("groups", [])) + extra)
        return raw


# derived groups' index, after the kernel's groups (KVTRACE_MAX_GROUPS rows)
_LIVE_INDEX = 1 << 16
