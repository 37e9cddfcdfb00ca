"""Access patterns: which blocks attention reads, how often, how long each
sits idle (docs/access.md).  Pure logic (numpy), no bcc.

Two sources, one vocabulary:
  - the exact counters (BPF maps, aggregate.ReadGroup): reads per block, the
    step of each block's last read, and per-group sums; what `attach` shows;
  - the stream (a trace file's block_table ops): each step's live set, row
    by row, with its time; what `report` shows over time.

DAMON's names where they fit: a block's access frequency is its
`nr_accesses` (here exact, not sampled), its age is the time since its
last read, and the working set is the set of distinct blocks read.
"""

from dataclasses import dataclass

import numpy as np

from . import abi, stream

PERCENTILES = (0, 25, 50, 75, 90, 99, 100)


# -- the exact counters ----------------------------------------------------------

def frequency_histogram(reads_per_block: np.ndarray) -> list:
    """[(lo, hi, blocks)]: blocks by how many reads they had, in log2
    buckets (0 reads: blocks never read, up to the highest block read)."""
    nz = np.flatnonzero(reads_per_block)
    if not len(nz):
        return []
    counts = reads_per_block[:nz[-1] + 1].astype(np.uint64)
    out = [(0, 0, int((counts == 0).sum()))]
    read = counts[counts > 0]
    slot = np.floor(np.log2(read.astype(np.float64))).astype(np.int64)
    for s, n in zip(*np.unique(slot, return_counts=True)):
        out.append((1 << int(s), (1 << (int(s) + 1)) - 1, int(n)))
    return out


def hottest(reads_per_block: np.ndarray, n: int = 5) -> list:
    """[(block, reads)] of the n most read blocks, most first."""
    nz = np.flatnonzero(reads_per_block)
    order = nz[np.argsort(-reads_per_block[nz].astype(np.int64), kind="stable")][:n]
    return [(int(b), int(reads_per_block[b])) for b in order]


def coldest(reads_per_block: np.ndarray, n: int = 5) -> list:
    """[(block, reads)] of the n least read blocks among those read at all."""
    nz = np.flatnonzero(reads_per_block)
    order = nz[np.argsort(reads_per_block[nz].astype(np.int64), kind="stable")][:n]
    return [(int(b), int(reads_per_block[b])) for b in order]


def age_steps(last_read_step: np.ndarray, steps: int) -> np.ndarray:
    """Per block read at least once: steps since its last read (0: read at
    the latest step), -1 for blocks never read."""
    last = last_read_step.astype(np.int64)
    return np.where(last > 0, steps - last, -1)


def group_summary(g) -> dict:
    """The figures of one aggregate.ReadGroup, for views and JSON."""
    steps = g.steps
    return {
        "steps": steps,
        "layers": round(g.layers, 3),
        "reads_per_step": g.reads / steps if steps else 0.0,
        "distinct_per_step": g.distinct / steps if steps else 0.0,
        "blocks_ever_read": int(np.count_nonzero(g.reads_per_block)),
        # mean requests reading a live block at a step: 1 without sharing
        "sharing": g.reads / g.distinct if g.distinct else 0.0,
        # tokens held in the live set over its capacity, over all steps
        "utilization": g.held_tokens / (g.distinct * g.block_size)
        if g.distinct and g.block_size else None,
    }


# -- the stream --------------------------------------------------------------------

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


def live_set(values: np.ndarray, block_size: int) -> list:
    """One block_table op's streamed values as rows: [(seq_len, blocks)],
    blocks as the table held them (0: the null block).  The stream is,
    row after row, seq_len then ceil(seq_len / block_size) entries."""
    rows, pos, n = [], 0, len(values)
    while pos < n:
        seq = int(values[pos])
        length = -(-seq // block_size) if block_size else 0
        rows.append((seq, values[pos + 1:pos + 1 + length]))
        pos += 1 + length
    return rows


def step_entries(ops: stream.OpStream, steps: Steps) -> tuple:
    """(step number per entry, block per entry) over the complete steps,
    null entries left out: every (request, block) read, in step order."""
    idx, blocks = [], []
    for k, i in enumerate(steps.index):
        if not steps.complete[k]:
            continue
        for _, row in live_set(ops.values_of(i), steps.block_size):
            row = row[row > 0]
            blocks.append(row)
            idx.append(np.full(len(row), k, np.int64))
    if not blocks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(idx), np.concatenate(blocks).astype(np.int64)


def sharing_by_block(step_of: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Per block: the most requests that read it at one step."""
    if not len(block):
        return np.zeros(0, np.int64)
    key = step_of * (int(block.max()) + 1) + block
    uk, counts = np.unique(key, return_counts=True)
    out = np.zeros(int(block.max()) + 1, np.int64)
    np.maximum.at(out, uk % (int(block.max()) + 1), counts)
    return out


def last_read_ns(step_of: np.ndarray, block: np.ndarray, ts_ns: np.ndarray) -> np.ndarray:
    """Per block: the time of its last read (0: never read)."""
    if not len(block):
        return np.zeros(0, np.int64)
    out = np.zeros(int(block.max()) + 1, np.int64)
    np.maximum.at(out, block, ts_ns[step_of])
    return out


def idle_before_reuse(step_of: np.ndarray, block: np.ndarray, ts_ns: np.ndarray,
                      gen_block: np.ndarray, gen_start_ns: np.ndarray) -> np.ndarray:
    """For every block generation that starts after the block was read:
    how long (ns) the block sat unread between its last read and the new
    generation's first write (a new request reusing it)."""
    if not len(block) or not len(gen_block):
        return np.zeros(0, np.int64)
    n = len(block)
    gen_block = np.asarray(gen_block, np.int64)
    gen_start_ns = np.asarray(gen_start_ns, np.int64)
    # reads and generation starts in one order: by block, then time, a
    # generation before a read at its very time (that read is not before
    # it).  The last read at or before each position is then a running
    # maximum, and a generation's idle time is measured from it when that
    # read was of the same block.
    blocks = np.concatenate([block, gen_block])
    times = np.concatenate([ts_ns[step_of], gen_start_ns])
    is_read = np.concatenate([np.ones(n, np.int8), np.zeros(len(gen_block), np.int8)])
    order = np.lexsort((is_read, times, blocks))
    last_read = np.where(order < n, np.arange(len(order)), -1)
    np.maximum.accumulate(last_read, out=last_read)
    at = np.flatnonzero(order >= n)  # generations' places in the order
    gen = order[at] - n
    read = order[last_read[at]]  # meaningful where last_read[at] >= 0
    ok = (last_read[at] >= 0) & (blocks[read] == gen_block[gen])
    found = np.zeros(len(gen_block), bool)
    found[gen[ok]] = True
    idle = np.zeros(len(gen_block), np.int64)
    idle[gen[ok]] = gen_start_ns[gen[ok]] - times[read[ok]]
    return idle[found]  # in the generations' order


def prefix_reuse(ops: stream.OpStream, steps: Steps, leader: int) -> dict:
    """Prefix reuse: blocks a request read at its first step that it did not
    write (docs/access.md), i.e. blocks it found in the cache (vLLM's
    prefix-cache hits, in blocks) or shares with the sequence it was forked
    from, rather than computed.

    A request has no id in the table, so it is followed by its row from
    step to step: a row continues an earlier request's row when that row is
    a prefix of it (a request's row only grows; a block a sliding window
    dropped reads 0), its seq_len grew, and the last token the earlier row
    held was not written at this step (a new request that got a finished
    one's freed blocks writes its own tokens there now).  A row that continues no
    request is a request's first step.  What a step wrote: the leader
    layer's write op just before the table op (vLLM and kvsim write a
    layer's tokens, then attend), and the copies and swaps into that cache
    since the step before (a swapped-in request's blocks are written by
    the swap).  Requests already running at the first traced step look new:
    attach before the load to count them.

    Returns {"requests": first steps seen, "blocks": reused blocks,
    "per_block": {block: times reused}, "steps_without_writes": steps
    whose writes were not found}."""
    o = ops.ops
    bs = steps.block_size
    if bs <= 0:  # no block size: no row can be split (a damaged trace)
        return {"requests": 0, "blocks": 0, "per_block": {}, "steps_without_writes": 0}
    order = np.argsort(o["seq"], kind="stable")
    seqs = o["seq"][order]
    mine = (o["pid"][order] == steps.pid) & (o["cache_id"][order] == leader) & \
        o["complete"][order]
    is_write = mine & np.isin(o["op"][order], list(stream.WRITE_OP_IDS))
    is_move = mine & np.isin(o["op"][order], list(stream.PAIR_OP_IDS))
    write_pos, write_seq = order[is_write], seqs[is_write]
    move_pos, move_seq = order[is_move], seqs[is_move]
    open_by_last = {}  # a request's latest row, by its last block
    out_blocks, per_block, new_rows, missing = 0, {}, 0, 0
    prev_seq = -1
    for k, i in enumerate(steps.index):
        cur_seq = int(o["seq"][i])
        if not steps.complete[k]:
            prev_seq = cur_seq
            continue
        rows = [(seq, tuple(r.tolist())) for seq, r in live_set(ops.values_of(i), bs)]
        # what this step wrote: the leader's write op just before the table
        # op, and copies and swaps into the cache since the step before
        j = np.searchsorted(write_seq, cur_seq) - 1
        slots = set()
        if j >= 0 and write_seq[j] > prev_seq:
            v = ops.values_of(write_pos[j])
            slots = set(v[v >= 0].tolist())
        elif any(r for _, r in rows):
            missing += 1
        written = {x // bs for x in slots}
        lo, hi = np.searchsorted(move_seq, [prev_seq, cur_seq], side="right")
        for m in move_pos[lo:hi]:
            pairs = ops.values_of(m)
            out_swap = o["flags"][m] & abi.EV_SWAP_OUT
            if not out_swap:  # a copy's destination, a swap-in's device block
                written.update(pairs[1::2].tolist())

        def continues(r, seq, p_seq, p):
            # a request's seq_len grows at every step it is scheduled: a
            # new request given a finished one's freed tail block, with
            # fewer tokens than that one had, is not it
            if len(p) > len(r) or p_seq < 1 or seq <= p_seq:
                return False
            # equal, entry by entry, except where either reads 0 (a block a
            # sliding window dropped); the common case, an exact prefix, is
            # one tuple comparison
            if r[:len(p)] != p and any(a != b and a and b for a, b in zip(p, r)):
                return False
            last = p_seq - 1  # the earlier row's last token, in r's blocks
            return last // bs < len(r) and r[last // bs] * bs + last % bs not in slots

        new_count, running, claimed = {}, set(), []
        for seq, r in rows:
            if not any(r):
                continue
            match = None
            # the earlier rows ending in one of r's blocks, tried in the
            # order of those blocks in r: found from the smaller side (a
            # row has hundreds of blocks, a step tens of open requests)
            rset = set(r)
            if len(open_by_last) < len(rset):
                ends = [b for b in open_by_last if b in rset]
            else:
                ends = [b for b in rset if b in open_by_last]
            for b in sorted(ends, key=r.index):
                for cand in open_by_last[b]:
                    if cand not in claimed and continues(r, seq, *cand):
                        match = cand
                        break
                if match:
                    break
            if match:
                claimed.append(match)
                running.update(r)  # the same request, a step on
            else:
                new_rows += 1
                for b in rset - {0}:
                    new_count[b] = new_count.get(b, 0) + 1
            claimed.append((seq, r))
        for p_seq, p in claimed:  # each request's latest row replaces its last
            end = p[-1] if p else 0
            lst = open_by_last.get(end)
            if lst and (p_seq, p) in lst:
                lst.remove((p_seq, p))
                if not lst:  # no empty lists: the dict holds open rows only
                    del open_by_last[end]
        for seq, r in rows:
            if any(r):
                open_by_last.setdefault(r[-1], []).append((seq, r))
        # a block new rows hold was reused by all of them if this step did
        # not write it; if it did, by all but the one that wrote it, unless
        # a running request holds it (then that one wrote it: a prefix hit on
        # a block computed at the same step, as kvsim's scheduler allows)
        for b, n in new_count.items():
            reused = n if b not in written or b in running else n - 1
            if reused:
                out_blocks += reused
                per_block[b] = per_block.get(b, 0) + reused
        prev_seq = cur_seq
    return {"requests": new_rows, "blocks": out_blocks, "per_block": per_block,
            "steps_without_writes": missing}
