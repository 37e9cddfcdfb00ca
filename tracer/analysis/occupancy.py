"""Occupancy from the slot stream: block generations, written fill, and the
fragmentation of the blocks being written.

These figures come from writes alone: the stream has no frees and does not
see a block that is held but not written (a full prompt block of a request
still decoding).  Source (below) says so, and names each figure for what it
measures; the views print its caveat beside the figures.

Pure numpy over tracer/stream.py's OpStream; no bcc.  Definitions (written
down in docs/occupancy.md, and computed independently by kvsim's truth):

- Ops of one cache (one layer of one process) are taken in seq order.  The
  clock is the model step: the number of write ops of that cache before an
  op (stream.step_numbers).
- A block's *generation* starts with a write at block offset 0, or when the
  block receives another block's contents: the destination of copy_blocks,
  the device block of a host->device swap_blocks.  It lasts until the block's
  next generation starts.  Writes to a block before any start seen (tracing
  began mid-generation) form a generation of kind "before".
- Tokens held: 1 + the highest offset written in the generation, or the
  tokens it inherited (the source's tokens held at the copy or swap), if
  more.  `writes` counts the slot writes themselves: more than block_size
  writes in one generation means a slot was written twice.
- Last access: the generation's last write, or the last time it was the
  source of a copy or of a device->host swap.  Lifetime = last access -
  start + 1 steps; reuse distance = the block's next start - last access.
- Active at step k: start <= k <= last access.  Internal fragmentation at
  step k = 1 - tokens held by active generations / (active x block_size).
  The tracer sees no frees, so a block whose data is still needed but no
  longer touched (a full prompt block of a running request) drops out after
  its last access: this is fragmentation among the blocks being worked on.
"""

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from .. import abi
from ..trace import stream

KINDS = ("write", "copy", "swap_in", "before")  # how a generation started
_K_WRITE, _K_COPY, _K_SWAP_IN, _K_BEFORE = range(4)
_COPY, _SWAP = abi.OPS["copy_blocks"], abi.OPS["swap_blocks"]
_WITHIN_BITS = 20  # values per op < 2**20 (one op reads at most 270336)


@dataclass(frozen=True)
class Source:
    """Where a set of occupancy figures comes from, and the names the views
    give them.  FROM_WRITES is what this module computes; a source that
    knows which blocks are allocated (a live set from reads or the
    scheduler) gets its own Source with its own names and caveat, and the
    same views draw it."""

    name: str  # "writes": JSON "source"
    caveat: str  # printed beside the figures; "" when there is none
    title: str  # the panel's title
    fill: str  # tokens held at a generation's end
    fragmentation: str  # 1 - tokens held / (blocks x block_size), per step
    span: str  # lifetime_steps: start to last access
    gap: str  # reuse_steps: last access to the block's next start
    # how its unwritten share differs from the internal fragmentation of the
    # blocks read (access), "" where they are one figure
    not_fragmentation: str = ""


FROM_WRITES = Source(
    name="writes",
    caveat="from writes only: frees and held-but-unwritten blocks are not seen",
    title="occupancy from writes",
    fill="written fill at generation end",
    fragmentation="unwritten share of the blocks being written",
    span="write span (steps from a generation's start to its last write)",
    gap="write gap (steps from a last write to the block's next generation)",
    not_fragmentation="not the internal fragmentation of the blocks read (access patterns): "
                      "this counts a block only from its generation's first write to its "
                      "last, so it leaves out the full blocks requests go on holding and "
                      "reading, and the two can move in opposite directions "
                      "(docs/glossary.md)")


@dataclass
class Generations:
    """One cache's generations, sorted by (block, start).  Arrays per generation."""

    block_size: int
    block: np.ndarray
    kind: np.ndarray  # index into KINDS
    start_step: np.ndarray
    last_step: np.ndarray
    start_ns: np.ndarray
    last_ns: np.ndarray
    inherited: np.ndarray  # tokens received from a copy or swap source
    fill: np.ndarray  # tokens held at the generation's end
    writes: np.ndarray  # slot writes in the generation
    reuse_steps: np.ndarray  # next start of the block - last access; -1: none
    steps: int  # write ops of the cache (the clock's length)
    active_blocks: np.ndarray  # per step
    active_tokens: np.ndarray  # per step
    incomplete_ops: int  # ops left out because their values were lost
    start_op: np.ndarray  # index (in this cache's ops) of the op starting it
    last_op: np.ndarray  # ... and of its last access
    # the slot writes as runs (one op's consecutive slots in one block), in
    # op order: what the report's per-block write counts and write heatmap
    # need, read here once rather than from every slot again
    run_block: np.ndarray = None
    run_writes: np.ndarray = None
    run_op: np.ndarray = None  # index (in this cache's ops)
    run_ns: np.ndarray = None  # its time

    def __len__(self):
        return len(self.block)

    @property
    def lifetime_steps(self) -> np.ndarray:
        return self.last_step - self.start_step + 1

    @property
    def max_writes(self) -> int:
        return int(self.writes.max()) if len(self.writes) else 0

    @property
    def fill_hist(self) -> np.ndarray:
        """Generations by tokens held at their end: index 0..block_size."""
        return np.bincount(np.minimum(self.fill, self.block_size),
                           minlength=self.block_size + 1)

    @property
    def fragmentation(self) -> np.ndarray:
        """Per step: 1 - tokens held / (active blocks x block_size); NaN if none."""
        cap = self.active_blocks * self.block_size
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(cap > 0, 1.0 - self.active_tokens / np.maximum(cap, 1), np.nan)


def _runs_before(g_sorted, key_sorted, g_first, q_gen, q_key) -> np.ndarray:
    """For each query, how many runs of generation q_gen have a key below
    q_key (runs sorted by (generation, key), a generation's first at
    g_first)."""
    if not len(q_gen):
        return np.zeros(0, np.int64)
    k_bits = max(int(key_sorted.max(initial=0)), int(q_key.max())).bit_length()
    if (len(g_first) + 1).bit_length() + k_bits < 63 and int(q_key.min()) >= 0 and \
            int(key_sorted.min(initial=0)) >= 0:
        # one packed key per run and query: one binary search for all
        packed = (g_sorted.astype(np.int64) << k_bits) | key_sorted
        return np.searchsorted(packed, (q_gen.astype(np.int64) << k_bits) | q_key) - g_first[q_gen]
    return np.array([np.searchsorted(key_sorted[g_first[g]:g_first[g + 1] if g + 1 < len(g_first)
                                                else len(key_sorted)], k)
                     for g, k in zip(q_gen.tolist(), q_key.tolist())], np.int64)


def _latest_start(s_block, s_key, q_block, q_key, query_first, q_sorted=False):
    """For each query, the index of the latest start of the same block at or
    before its key (starts sorted by (block, key)); -1 if none.  At an equal
    key a start comes first, unless query_first.  q_sorted: the queries are
    sorted by (block, key) too, and then the starts are placed among them
    (a search per start, not per query: there are far fewer starts)."""
    if not len(s_block) or not len(q_block):
        return np.full(len(q_block), -1, np.int64)
    k_bits = max(int(s_key.max()), int(q_key.max())).bit_length()
    if max(int(s_block.max()), int(q_block.max())).bit_length() + k_bits < 63 and \
            s_block.min() >= 0 and q_block.min() >= 0 and s_key.min() >= 0 and q_key.min() >= 0:
        # one packed key per start and query: a binary search finds the latest
        s_packed = (s_block.astype(np.int64, copy=False) << k_bits) | s_key
        q_packed = (q_block.astype(np.int64, copy=False) << k_bits) | q_key
        if q_sorted:
            at = np.searchsorted(q_packed, s_packed, side="right" if query_first else "left")
            del q_packed
            latest = np.full(len(q_block) + 1, -1, np.int64)
            np.maximum.at(latest, at, np.arange(len(s_packed)))  # the last of several
            out = np.maximum.accumulate(latest, out=latest)[:-1]
        else:
            out = np.searchsorted(s_packed, q_packed, side="left" if query_first else "right") - 1
    else:  # starts and queries merged in one sort (any integers)
        ns, nq = len(s_block), len(q_block)
        is_q = np.concatenate([np.zeros(ns, np.int8), np.ones(nq, np.int8)])
        order = np.lexsort(((1 - is_q) if query_first else is_q,
                            np.concatenate([s_key, q_key]), np.concatenate([s_block, q_block])))
        latest = np.cumsum(is_q[order] == 0) - 1
        out = np.empty(nq, np.int64)
        q_at = order >= ns
        out[order[q_at] - ns] = latest[q_at]
    # a start of another block is none (one temporary at a time: out is as
    # long as the queries)
    found = s_block[np.maximum(out, 0)]
    out[(out < 0) | (found != q_block)] = -1
    return out


def _by_block(block, key):
    """The order that sorts writes, already in key order, by (block, key):
    a stable sort by block alone, a radix sort when blocks fit 16 bits."""
    if not len(block):
        return np.zeros(0, np.int64)
    if 0 <= block.min() and block.max() < 1 << 16:
        return np.argsort(block.astype(np.uint16), kind="stable")
    return np.lexsort((key, block))


def generations(cache_ops: stream.OpStream, block_size: int) -> Generations:
    """The generations of one cache from its ops (write ops, and optionally
    its copy_blocks / swap_blocks ops), in seq order."""
    bs = int(block_size)
    ops = cache_ops.ops
    if len(ops) > 1 and np.any(np.diff(ops["seq"].astype(np.int64)) < 0):
        raise ValueError("ops must be in seq order")
    step = stream.step_numbers(ops)
    nsteps = int(np.count_nonzero(np.isin(ops["op"], list(stream.WRITE_OP_IDS))))
    ok = ops["complete"]
    is_write = np.isin(ops["op"], list(stream.WRITE_OP_IDS)) & ok
    is_move = np.isin(ops["op"], [_COPY, _SWAP]) & ok

    def expand(mask):
        """(op index, index within the op, value) of every value of the ops in mask."""
        idx = np.flatnonzero(mask)
        start, stop = ops["start"][idx], ops["stop"][idx]
        n = stop - start
        pos = stream.ranges(start, n)
        return np.repeat(idx, n), pos - np.repeat(start, n), cache_ops.values[pos]

    # Writes as runs: consecutive writes of one op to consecutive slots of
    # one block (a prefill writes a block's slots in a row).  A run's
    # writes share what the rest of this function computes per write: no
    # start can fall among them (a start is an offset-0 write, which only
    # a run's first write can be, or a move, another op's), so they share
    # a generation, the highest offset is the last one's, and the tokens
    # they add sum to the run's.  A prefill's runs are several times fewer
    # elements than its slot writes.  Only the slots
    # themselves are gathered per write; a run's op and place in it are
    # found from its first write (an op, its place and the valid slots as
    # arrays per write were 1 GB and a third of this function's time).
    w_idx = np.flatnonzero(is_write)
    w_start = ops["start"][w_idx].astype(np.int64)
    w_len = ops["stop"][w_idx].astype(np.int64) - w_start
    has = w_len > 0
    w_idx, w_start, w_len = w_idx[has], w_start[has], w_len[has]
    op_at = np.cumsum(w_len) - w_len  # each op's first slot among slots

    def offset(s):  # a slot's place in its block
        if bs & (bs - 1) == 0:  # a power of two, as block sizes are: a mask, 6x a %
            return s & (bs - 1)  # (the same for negative slots, as % rounds down)
        return s % bs

    # a run starts at a block's first slot, where the slot before is not the
    # one before it, and at an op's first slot.  The slots are gathered a
    # chunk of ops at a time (no run spans two ops, so none spans two
    # chunks), and only each run's first and last slot are kept: the slots
    # of every write, and their breaks, were a tenth of a GB of fresh
    # memory on a large trace, and a GB first touched costs 0.5-0.8 s of CPU
    # on a VM, as the offsets and shifted slots of every write had before
    # them
    first_l, first_slot_l, last_slot_l = [], [], []
    for o0, o1 in stream.chunks(w_len, _CHUNK_SLOTS):
        s = stream.gather(cache_ops.values, w_start[o0:o1], w_len[o0:o1])
        b = offset(s) == 0
        b[1:] |= s[1:] != s[:-1] + 1
        b[op_at[o0:o1] - op_at[o0]] = True
        f = np.flatnonzero(b)
        first_l.append(f + op_at[o0])
        first_slot_l.append(s[f])
        last_slot_l.append(s[np.r_[f[1:], len(s)] - 1])
    first = np.concatenate([np.zeros(0, np.int64)] + first_l)
    first_slot = np.concatenate([np.zeros(0, np.int64)] + first_slot_l)
    last_slot = np.concatenate([np.zeros(0, np.int64)] + last_slot_l)
    del first_l, first_slot_l, last_slot_l
    w_n = np.diff(np.append(first, int(w_len.sum())))  # writes per run
    # an invalid (negative) slot is no write; a run of them never reaches a
    # valid one (after -1 comes 0, a block's first slot), so runs are kept
    # or left whole, by their first
    keep = first_slot >= 0
    first, w_n, first_slot, last_slot = first[keep], w_n[keep], first_slot[keep], last_slot[keep]
    last_off = offset(last_slot)
    w_off = offset(first_slot)
    w_block = first_slot // bs
    del first_slot, last_slot
    run_of = np.searchsorted(op_at, first, side="right") - 1  # which op's
    w_op, w_in = w_idx[run_of], first - op_at[run_of]
    del first, run_of
    run_op, run_block, run_writes = w_op, w_block, w_n  # kept as they are: none is changed
    w_key = w_op << _WITHIN_BITS
    w_key |= w_in
    del w_in
    # moves: (src, dst) pairs
    m_op, m_in, mv = expand(is_move)
    m_op, m_key = m_op[0::2], (m_op[0::2] << _WITHIN_BITS) | m_in[0::2]
    m_src, m_dst = mv[0::2], mv[1::2]
    m_flags = ops["flags"][m_op]
    m_copy = ops["op"][m_op] == _COPY
    m_swap_in = ~m_copy & ((m_flags & abi.EV_SWAP_IN) != 0)
    m_swap_out = ~m_copy & ((m_flags & abi.EV_SWAP_OUT) != 0)
    m_starts = m_copy | m_swap_in  # these start a generation on dst

    # generation starts: offset-0 writes, copy and swap-in destinations...
    s_block = np.concatenate([w_block[w_off == 0], m_dst[m_starts]])
    s_key = np.concatenate([w_key[w_off == 0], m_key[m_starts]])
    s_kind = np.concatenate([np.full(np.count_nonzero(w_off == 0), _K_WRITE),
                             np.where(m_copy[m_starts], _K_COPY, _K_SWAP_IN)])
    s_op = np.concatenate([w_op[w_off == 0], m_op[m_starts]])
    s_move = np.concatenate([np.full(np.count_nonzero(w_off == 0), -1),
                             np.flatnonzero(m_starts)])
    # ...and, for blocks written before any start, the first such write
    sorted_starts = _sorted_starts(s_block, s_key)
    # the writes by (block, key): searched in that order, and since a
    # block's generations are in key order, also the writes by (generation, key)
    worder = _by_block(w_block, w_key)
    w_gen = np.empty(len(w_block), np.int64)
    w_gen[worder] = _latest_start(*sorted_starts[:2], w_block[worder], w_key[worder], False,
                                   q_sorted=True)
    orphans = bool(np.any(w_gen < 0))
    if orphans:
        orphan = np.flatnonzero(w_gen < 0)
        blocks, first = np.unique(w_block[orphan], return_index=True)  # orphans are key-sorted
        at = orphan[first]
        found_order, n_found = sorted_starts[2], len(s_block)
        s_block = np.concatenate([s_block, blocks])
        s_key = np.concatenate([s_key, w_key[at]])
        s_kind = np.concatenate([s_kind, np.full(len(at), _K_BEFORE)])
        s_op = np.concatenate([s_op, w_op[at]])
        s_move = np.concatenate([s_move, np.full(len(at), -1)])
    if orphans:  # the starts changed: sort them and find each write's again
        sorted_starts = _sorted_starts(s_block, s_key)
    s_block, s_key, order = sorted_starts
    s_kind, s_op, s_move = s_kind[order], s_op[order], s_move[order]
    G = len(s_block)
    if orphans:
        # each write's start again, without a second search: a found one's by where it went in the new order, and an
        # orphan's is its block's new start (before any other of the block,
        # so no write that had a start is moved to it)
        place = np.empty(G, np.int64)
        place[order] = np.arange(G)
        had = np.flatnonzero(w_gen >= 0)
        w_gen[had] = place[found_order][w_gen[had]]
        w_gen[orphan] = place[n_found + np.searchsorted(blocks, w_block[orphan])]

    # per generation, from its runs (sorted by generation, then order)
    g_sorted, key_sorted = w_gen[worder], w_key[worder]
    runs = np.bincount(w_gen, minlength=G)
    writes = np.bincount(w_gen, weights=w_n, minlength=G).astype(np.int64)
    g_first = np.cumsum(runs) - runs
    # running highest (offset + 1) within each generation, after each run
    stride = bs + 1
    run_fill = np.maximum.accumulate(g_sorted * stride + last_off[worder] + 1) - g_sorted * stride
    has_w = runs > 0
    written_fill = np.zeros(G, np.int64)
    written_fill[has_w] = run_fill[g_first[has_w] + runs[has_w] - 1]
    last_w_op = np.full(G, -1)
    last_w_op[has_w] = w_op[worder][g_first[has_w] + runs[has_w] - 1]

    # moves in order: what each destination inherits, when sources are used.
    # What a device-side source holds from its own writes before the move
    # (the running fill of its last run before the move's key) and when it
    # was last used need no order, and are found for all moves at once; the
    # loop keeps only what chains from move to move, in Python ints (a
    # search and numpy scalars per move were not)
    last_op = np.maximum(s_op, last_w_op)
    src_gen = _latest_start(s_block, s_key, m_src, m_key, True)
    dst_gen = np.full(len(m_key), -1)
    dst_gen[s_move[s_move >= 0]] = np.flatnonzero(s_move >= 0)
    device_src = m_copy | m_swap_out
    used = np.flatnonzero(device_src & (src_gen >= 0))
    g_used = src_gen[used]
    n_before = _runs_before(g_sorted, key_sorted, g_first, g_used, m_key[used])
    own = np.zeros(len(m_key), np.int64)
    has_before = np.flatnonzero(n_before > 0)
    own[used[has_before]] = run_fill[g_first[g_used[has_before]] + n_before[has_before] - 1]
    np.maximum.at(last_op, g_used, m_op[used])
    moved_in = {}  # generation -> tokens it inherits (none listed: 0)
    host_fill = {}  # host block -> tokens it holds
    src_l, own_l, dst_l = src_gen.tolist(), own.tolist(), dst_gen.tolist()
    copy_l, device_l, swap_in_l = m_copy.tolist(), device_src.tolist(), m_swap_in.tolist()
    m_src_l, m_dst_l = m_src.tolist(), m_dst.tolist()
    for i in np.argsort(m_key, kind="stable").tolist():
        if device_l[i]:
            g = src_l[i]
            fill = max(moved_in.get(g, 0), own_l[i]) if g >= 0 else 0
            if copy_l[i]:
                moved_in[dst_l[i]] = fill
            else:
                host_fill[m_dst_l[i]] = fill
        elif swap_in_l[i]:
            moved_in[dst_l[i]] = host_fill.get(m_src_l[i], 0)
    inherited = np.zeros(G, np.int64)
    if moved_in:
        inherited[np.fromiter(moved_in, np.int64)] = np.fromiter(moved_in.values(), np.int64)

    fill = np.maximum(inherited, written_fill)
    start_step, last_step = step[s_op], step[last_op]
    same_next = np.zeros(G, bool)
    same_next[:-1] = s_block[1:] == s_block[:-1]
    reuse = np.full(G, -1, np.int64)
    reuse[:-1] = np.where(same_next[:-1], start_step[1:] - last_step[:-1], -1)

    # the timeline: + tokens as they arrive, - everything after last access
    blocks_d = np.zeros(nsteps + 2, np.int64)
    tokens_d = np.zeros(nsteps + 2, np.int64)
    np.add.at(blocks_d, start_step, 1)
    np.add.at(blocks_d, last_step + 1, -1)
    np.add.at(tokens_d, start_step, inherited)
    np.add.at(tokens_d, last_step + 1, -fill)
    before = np.where(np.arange(len(run_fill)) == g_first[g_sorted],
                      inherited[g_sorted], np.concatenate([[0], run_fill[:-1]]))
    gained = np.maximum(run_fill, inherited[g_sorted]) - np.maximum(before, inherited[g_sorted])
    np.add.at(tokens_d, step[w_op[worder]], gained)

    ts = ops["ts_ns"].astype(np.int64)
    return Generations(
        block_size=bs, block=s_block, kind=s_kind, start_step=start_step, last_step=last_step,
        start_ns=ts[s_op], last_ns=ts[last_op], inherited=inherited, fill=fill,
        writes=writes, reuse_steps=reuse, steps=nsteps,
        active_blocks=np.cumsum(blocks_d)[:nsteps], active_tokens=np.cumsum(tokens_d)[:nsteps],
        incomplete_ops=int(np.count_nonzero(~ok)), start_op=s_op, last_op=last_op,
        run_block=run_block, run_writes=run_writes, run_op=run_op, run_ns=ts[run_op])


# slots per chunk of generations' run search: 1M, as stream's chunks (its
# temporaries stay in the CPU's caches)
_CHUNK_SLOTS = 1 << 20


def _sorted_starts(block, key):
    order = stream.order_by(block, key, stable=True)
    return block[order], key[order], order


def _shape(cache_ops: stream.OpStream, block_size: int) -> bytes:
    """What generations() depends on, except the clock's timestamps and the
    values: per op, its kind, completeness, flags and value count."""
    ops = cache_ops.ops
    h = hashlib.blake2b(digest_size=16)
    for part in (np.int64(block_size), ops["op"], ops["complete"], ops["flags"],
                 ops["stop"] - ops["start"]):
        h.update(np.ascontiguousarray(part))  # the buffer, not a copy of it
    return h.digest()


def _same_values(a: stream.OpStream, b: stream.OpStream) -> bool:
    """Whether two caches of one _shape have the same values, op for op (the
    rest of what generations() depends on).  Compared exactly, a chunk of
    ops at a time, in the caches: a digest of each cache's values (blake2b
    of a gathered copy) read them the same but hashed at 1 GB/s and wrote
    a fresh copy of each (five times slower), and a digest that matched
    would have been trusted."""
    n = a.ops["stop"] - a.ops["start"]  # as b's: the shapes are equal
    for i0, i1 in stream.chunks(n, _COMPARED_VALUES):
        if not np.array_equal(stream.gather(a.values, a.ops["start"][i0:i1], n[i0:i1]),
                              stream.gather(b.values, b.ops["start"][i0:i1], n[i0:i1])):
            return False
    return True


# values compared at a time by _same_values: 1M a side (8 MiB), in the caches
_COMPARED_VALUES = 1 << 20


def by_cache(ops_stream: stream.OpStream, block_sizes: dict) -> dict:
    """Generations of every cache: {(pid, cache_id): Generations}.

    block_sizes: {(pid, cache_id): block_size}, e.g. from the trace's cache
    table; caches without a known block size are left out.

    Every layer of a model sees the same slot mapping, so most caches have
    the same ops and values: each distinct one is computed once (an 80-layer
    model costs one layer's work), and only its timestamps are taken from
    the cache itself (distinct_caches, computed)."""
    out = computed_groups(distinct_caches(ops_stream, block_sizes))
    return dict(sorted(out.items(), key=lambda kv: kv[0]))


def computed_groups(groups: list) -> dict:
    """computed() of each of these groups of distinct_caches(), in one dict."""
    out = {}
    for caches in groups:
        out.update(computed(caches))
    return out


def distinct_caches(ops_stream: stream.OpStream, block_sizes: dict) -> list:
    """The caches with a known block size, grouped by what generations()
    depends on: [[((pid, cache_id), cache_ops, block_size), ...], ...],
    one group per distinct computation, each in (pid, cache_id) order.  The
    groups are independent of one another: a report computes them on the
    side with time to spare (cmd_report.Report).

    A cache's shape (_shape) is hashed first; its values are compared
    (_same_values) only with the caches that have its shape already.  A
    cache whose shape no other has needs no look at its values: on a trace
    with lost records the layers' shapes differ."""
    ops = ops_stream.ops
    # per shape, the groups of caches that have it: distinct values each
    shapes = {}
    # each op's (pid, cache_id) as one integer, in their order: np.unique of
    # the pairs as rows sorts them as bytes, which is slow
    pids, pid_of = np.unique(ops["pid"], return_inverse=True)
    cache_ids, cache_of = np.unique(ops["cache_id"], return_inverse=True)
    pairs, inverse = np.unique(pid_of.reshape(-1) * len(cache_ids) + cache_of.reshape(-1),
                               return_inverse=True)
    inverse = inverse.reshape(-1)
    uniq = zip(pids[pairs // max(len(cache_ids), 1)].tolist(),
               cache_ids[pairs % max(len(cache_ids), 1)].tolist())
    groups = []
    for j, (pid, cache_id) in enumerate(uniq):
        bs = block_sizes.get((pid, cache_id))
        if not bs:
            continue
        mine = ((pid, cache_id), ops_stream.select(inverse == j), bs)
        same_shape = shapes.setdefault(_shape(mine[1], bs), [])
        group = next((g for g in same_shape if _same_values(g[0][1], mine[1])), None)
        if group is None:
            group = []
            same_shape.append(group)
            groups.append(group)
        group.append(mine)
    return groups


def computed(caches: list) -> dict:
    """{(pid, cache_id): Generations} of one group of distinct_caches():
    computed for its first cache, and the others take their own times."""
    (key, first, bs), *rest = caches
    g = generations(first, bs)
    out = {key: g}
    for key, mine, _ in rest:
        ts = mine.ops["ts_ns"].astype(np.int64)
        out[key] = replace(g, start_ns=ts[g.start_op], last_ns=ts[g.last_op],
                           run_ns=ts[g.run_op])
    return out


def trace_generations(trace, pid: int = None) -> dict:
    """{(pid, layer): Generations} for every layer of a trace file
    (tracefile.TraceFile), of one process if given: true fill per block
    generation, per layer."""
    layers = trace.layers()
    return {(p, layers[(p, c)]): g
            for (p, c), g in by_cache(trace.ops, trace.block_sizes()).items()
            if pid is None or p == pid}
