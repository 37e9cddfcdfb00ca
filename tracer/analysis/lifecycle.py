"""The plugin tier's block lifecycle, from a recorded stream (docs/lifecycle.md),
and its residency histograms live, for attach --prometheus (LiveResidency).

Each block event (block_alloc, block_hit, block_cache, block_free,
block_evict) is one op record with its block ids as the index stream:
cache_id is the request's hash, cache_index its KV-cache group, ts_ns when
the scheduler decided (bpf/kvtrace.h).  From them, exactly and for every
block (vLLM samples 1% of blocks, and only with --kv-cache-metrics):

- block residency as vLLM's KVCacheMetricsCollector defines it (v1/core/
  kv_cache_metrics.py): a block is born when get_new_blocks hands it out,
  last accessed at birth or at its latest prefix hit (touch), and "evicted"
  when get_new_blocks hands it out again.  lifetime = that reallocation's
  time - birth; idle before evict = reallocation - last access; reuse gaps
  = the gaps between consecutive prefix hits of one life (vLLM keeps the
  last 4 hits of a life, so at most 3 gaps; these are all of them).  The
  bucket bounds are vLLM's KV_CACHE_RESIDENCY_BUCKETS, so the two overlay.
- per request, its timeline: each event with its time and blocks.
"""

import time
from dataclasses import dataclass

import numpy as np

from .. import abi
from ..kernel import records
from ..trace import stream
from . import derived_rows

# vllm/v1/metrics/buckets.py KV_CACHE_RESIDENCY_BUCKETS (seconds), the
# buckets of vllm:kv_block_lifetime_seconds, idle_before_evict, reuse_gap
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20,
                     30, 60, 120, 300, 600, 1200, 1800)

KIND_OF_OP = {abi.OPS[op]: kind for op, kind in zip(abi.LIFE_OPS, abi.LIFE)}
# the ops LiveRows needs beside the block events: step_rows, and the
# request ends that end a row (derived_rows)
ROW_OP_IDS = frozenset(abi.OPS[op] for op in ("step_rows", "req_preempt", "req_finish")
                       if op in abi.OPS)


@dataclass
class Events:
    """Every block of every complete block event, one row per (event, block),
    in the order the scheduler decided them."""

    ts_ns: np.ndarray   # int64
    kind: np.ndarray    # index into abi.LIFE
    req: np.ndarray     # uint64 request hash
    group: np.ndarray   # int64 KV-cache group
    block: np.ndarray   # int64 block id
    event: np.ndarray   # int64: which op (row of the op table) it came from
    hash: np.ndarray = None  # uint64 content hash, 0 if the probe passed none
    incomplete: int = 0  # block events whose ids did not all arrive
    pid: np.ndarray = None  # int64: the process (each EngineCore has its own pool)

    def __len__(self):
        return len(self.block)


def events(ops: stream.OpStream) -> Events:
    """The block events of a decoded stream (numpy, no loop per block).
    Null ids (0, padding) are left out, as the kernel leaves them out of its
    counts; an op whose ids did not all arrive is left out whole and counted."""
    o = ops.ops
    is_life = np.isin(o["op"], list(KIND_OF_OP))
    idx = np.flatnonzero(is_life & o["complete"])
    incomplete = int(np.count_nonzero(is_life & ~o["complete"]))
    # the ids come first; with KVTRACE_EV_HASHES as many hashes follow
    n = o["items"][idx].astype(np.int64)
    at = stream.ranges(o["start"][idx], n)
    blocks = ops.values[at].astype(np.int64)
    has_hash = np.repeat((o["flags"][idx] & abi.EV_HASHES) != 0, n)
    hashes = np.where(has_hash, ops.values[np.where(has_hash, at + np.repeat(n, n), at)],
                      0).astype(np.uint64)
    kind_table = np.zeros(abi.NR_OPS, dtype=np.int64)
    for op_id, kind in KIND_OF_OP.items():
        kind_table[op_id] = abi.LIFE.index(kind)
    keep = blocks > 0
    if keep.all():  # no null id (as usual): no copy of each field to drop one
        keep = slice(None)

    def per_event(per_op):  # an op's field, for each of its events kept
        return np.repeat(per_op, n)[keep]

    # each field taken from the ops' table once per op, then repeated: a
    # gather per event from the table's strided columns was most of this
    # function
    op = o[idx]
    return Events(ts_ns=per_event(op["ts_ns"].astype(np.int64)),
                  kind=per_event(kind_table[op["op"]]),
                  req=per_event(op["cache_id"].astype(np.uint64)),
                  group=per_event(op["cache_index"].astype(np.int64)),
                  block=blocks[keep], event=per_event(idx.astype(np.int64)),
                  incomplete=incomplete, hash=hashes[keep],
                  pid=per_event(op["pid"].astype(np.int64)))


RESIDENCY = ("lifetime", "idle_before_evict", "reuse_gap")


class Residency:
    """Block residency as vLLM's collector defines it (module doc), event by
    event: each sample is taken once, when the event that ends its interval
    is added.  attach --prometheus's histograms (LiveResidency) are read
    with it; report's (residency()) are the same samples read in one pass
    over sorted arrays, which a unit test holds equal to this reading.

    A block is (pid, KV-cache group, block id): each EngineCore and each
    group has its own pool.  Per block it keeps [birth ns, last access ns,
    last hit ns]: birth None for a life that began with a hit (allocated
    before the trace: no known birth, so no lifetime), last hit None until
    the life's first hit.  Its size is bounded by the blocks seen."""

    def __init__(self):
        self._blocks = {}
        self.samples = {}  # pid -> {name: [ns, ...]} since the last take()

    def add(self, ev: Events):
        """Adds ev's allocations and hits in time order (the scheduler's
        order among equal times).  Events must come no earlier than those
        added before: LiveResidency holds recent ones back to make sure."""
        alloc, hit = abi.LIFE.index("alloc"), abi.LIFE.index("hit")
        sel = np.flatnonzero(np.isin(ev.kind, (alloc, hit)))
        if not len(sel):
            return
        sel = sel[np.lexsort((sel, ev.ts_ns[sel]))]
        pids = ev.pid[sel] if ev.pid is not None else np.zeros(len(sel), np.int64)
        blocks, samples = self._blocks, self.samples
        for pid, group, block, ts, is_alloc in zip(
                pids.tolist(), ev.group[sel].tolist(), ev.block[sel].tolist(),
                ev.ts_ns[sel].tolist(), (ev.kind[sel] == alloc).tolist()):
            key = (pid, group, block)
            st = blocks.get(key)
            if is_alloc:
                # get_new_blocks hands it out again: the life before ends
                if st is not None:
                    out = samples.get(pid) or samples.setdefault(
                        pid, {n: [] for n in RESIDENCY})
                    if st[0] is not None:
                        out["lifetime"].append(ts - st[0])
                    out["idle_before_evict"].append(ts - st[1])
                blocks[key] = [ts, ts, None]
            elif st is None:
                blocks[key] = [None, ts, ts]
            else:
                # vLLM's access_history records touches only, not the
                # birth: the gap from the allocation to the first hit is
                # not a reuse gap
                if st[2] is not None:
                    out = samples.get(pid) or samples.setdefault(
                        pid, {n: [] for n in RESIDENCY})
                    out["reuse_gap"].append(ts - st[2])
                st[1] = st[2] = ts

    def take(self) -> dict:
        """{pid: {name: ns samples}} since the last take(), handed over."""
        out, self.samples = self.samples, {}
        return out


def residency(ev: Events) -> dict:
    """{"lifetime", "idle_before_evict", "reuse_gap"}: seconds, one sample
    per block life (reuse gaps: per gap), as vLLM's collector defines them
    (module doc), all processes together.  Lives still running at the end
    of the trace have no lifetime yet and are not counted (vLLM's neither:
    it records at eviction).

    The same samples, in the same order, as Residency().add(ev) then take()
    (tests/test_unit_lifecycle.py holds the two equal), without a Python
    step per event: a trace holds millions of block events, and the live
    path (LiveResidency), which must carry each block's state from one
    batch to the next, keeps the event-by-event reading.  Each event is
    read against the one before it on the same block: an allocation ends
    the life before it (idle since that event; lifetime since the life's
    allocation, if it had one), and a hit after a hit of the same life is
    a reuse gap."""
    alloc, hit = abi.LIFE.index("alloc"), abi.LIFE.index("hit")
    sel = np.flatnonzero(np.isin(ev.kind, (alloc, hit)))
    if not len(sel):
        return {n: np.zeros(0) for n in RESIDENCY}
    sel = sel[stream.order_by(ev.ts_ns[sel], stable=True)]  # time order, as Residency.add
    pid = ev.pid[sel] if ev.pid is not None else np.zeros(len(sel), np.int64)
    group, block, ts = ev.group[sel], ev.block[sel], ev.ts_ns[sel]
    is_alloc = ev.kind[sel] == alloc
    n = len(sel)
    # each block's events together, in time order (t: the place in time)
    by = stream.order_by(pid, group, block, stable=True)
    p, g, b, t = pid[by], group[by], block[by], by
    ts, is_alloc = ts[by], is_alloc[by]
    i = np.arange(n)
    same = np.zeros(n, bool)  # the event before is the same block's
    same[1:] = (p[1:] == p[:-1]) & (g[1:] == g[:-1]) & (b[1:] == b[:-1])
    first = np.maximum.accumulate(np.where(same, 0, i))  # the block's first event
    # the latest allocation and the latest hit at or before each event, on
    # its block (a place before `first` is another block's: none)
    last_alloc = np.maximum.accumulate(np.where(is_alloc, i, -1))
    last_hit = np.maximum.accumulate(np.where(is_alloc, -1, i))
    prev = np.maximum(i - 1, 0)
    ends = same & is_alloc  # an allocation ending the life before it
    birth = last_alloc[prev]
    life = ends & (birth >= first)  # that life began with an allocation
    gap = same & ~is_alloc & (last_hit[prev] >= first) & (last_hit[prev] > last_alloc[prev])
    found = {"lifetime": (life, ts - ts[np.maximum(birth, 0)]),
             "idle_before_evict": (ends, ts - ts[prev]),
             "reuse_gap": (gap, ts - ts[np.maximum(last_hit[prev], 0)])}
    # Residency's order: process by process, in the order of each one's
    # first sample of any kind, then in time order
    any_sample = life | ends | gap
    pids, which = np.unique(p[any_sample], return_inverse=True)
    first_t = np.full(len(pids), n, np.int64)
    np.minimum.at(first_t, which, t[any_sample])
    rank = np.empty(len(pids), np.int64)
    rank[np.argsort(first_t, kind="stable")] = np.arange(len(pids))
    # every event (its place in `by`) in that order: time order is by's
    # inverse (t is a place in time), with no sort; then process by process
    # (one sort of the processes' ranks, where there are several).  Each
    # kind's samples are then those events that have one: three sorts of the
    # samples by (rank, time) were not
    in_time = np.empty(n, np.intp)
    in_time[t] = i
    if len(pids) > 1:
        r = rank[np.minimum(np.searchsorted(pids, p[in_time]), len(pids) - 1)]
        in_time = in_time[stream.order_by(r, stable=True)]
    return {name: value[in_time[mask[in_time]]].astype(np.int64) / 1e9
            for name, (mask, value) in found.items()}


def bucket_counts(seconds, bounds=RESIDENCY_BUCKETS) -> np.ndarray:
    """Samples per bucket, not cumulative: len(bounds) + 1 counts, the last
    for +Inf.  A sample equal to a bound is in that bound's bucket (le)."""
    s = np.asarray(seconds, dtype=np.float64)
    return np.bincount(np.searchsorted(np.asarray(bounds, dtype=np.float64), s, side="left"),
                       minlength=len(bounds) + 1)


def histogram(seconds: np.ndarray, bounds=RESIDENCY_BUCKETS) -> list:
    """Cumulative [(le, count)], Prometheus style, +Inf last."""
    counts = np.cumsum(bucket_counts(seconds, bounds)).tolist()
    return [*zip(bounds, counts[:-1]), ("+Inf", counts[-1])]


def request_names(end_doc: dict) -> dict:
    """{request hash: vLLM request id} from a trace's END aggregate (the
    tracer's per-request map, kept with the id the request probe gave)."""
    names = {}
    for p in (end_doc or {}).get("processes", []):
        for r in ((p.get("lifecycle") or {}).get("requests") or []):
            try:
                names[int(r["req"], 16)] = r.get("id", "")
            except (KeyError, TypeError, ValueError):
                continue
    return names


REQUEST_OP_IDS = {abi.OPS[op]: op for op in abi.REQUEST_OPS}
REQUEST_EVENT = {"request": "arrive", "req_preempt": "preempt", "req_finish": "finish"}


def request_events(ops: stream.OpStream) -> list:
    """[(ts_ns, req, what, tokens)] of the request ops (arrive: prompt
    tokens, preempt: computed tokens lost, finish: output tokens)."""
    o = ops.ops
    r = o[np.flatnonzero(np.isin(o["op"], list(REQUEST_OP_IDS)))]
    return [(t, req, REQUEST_EVENT[REQUEST_OP_IDS[op]], n) for t, req, op, n in zip(
        r["ts_ns"].tolist(), r["cache_id"].tolist(), r["op"].tolist(), r["items"].tolist())]


def timelines(ev: Events, t0_ns: int = 0, names: dict = None, limit: int = None,
              requests: list = ()) -> list:
    """Per request (first seen first): its id, and its events in time order:
    block events as [seconds since t0, kind, group, [blocks]], and (from
    request_events) [seconds, "arrive" | "preempt" | "finish", None, tokens]."""
    names = names or {}
    starts = np.flatnonzero(np.r_[True, ev.event[1:] != ev.event[:-1]]) if len(ev) else \
        np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(ev)]
    if limit is not None:
        # the first `limit` requests seen, found before any event is made a
        # Python row: the terminal's view shows 12, and making every event's
        # row was most of a large trace's text report.
        # The order is the one sorted below: time, then event order, a
        # request event first, ties kept in list order (both sorts stable)
        t_first = np.r_[ev.ts_ns[starts], np.array([r[0] for r in requests], np.int64)]
        then = np.r_[ev.event[starts], np.full(len(requests), -1, np.int64)]
        who = np.r_[ev.req[starts], np.array([r[1] for r in requests], np.uint64)]
        seen = who[np.lexsort((then, t_first))]
        first_seen, at = np.unique(seen, return_index=True)
        shown = first_seen[np.argsort(at)[:limit]]
        keep = np.isin(ev.req[starts], shown)
        starts, ends = starts[keep], ends[keep]
        shown_set = set(shown.tolist())
        requests = [r for r in requests if r[1] in shown_set]
    # one entry per event (op row), its blocks together, and one per
    # request event; in time order, a request event first at a tie (its
    # event number -1), then in event order, request events in list order
    # (lexsort is stable).  Columns turned to lists once, and each distinct
    # time rounded once: a numpy scalar per field, a key function per row
    # and a round per event were most of this function's time.
    nb = len(starts)
    ts = np.concatenate([ev.ts_ns[starts], np.array([r[0] for r in requests], np.int64)])
    order = np.lexsort((np.concatenate([ev.event[starts], np.full(len(requests), -1)]), ts))
    uniq, at = np.unique(ts, return_inverse=True)
    secs = [round((t - t0_ns) / 1e9, 6) for t in uniq.tolist()]
    at = at.reshape(-1).tolist()
    reqs = ev.req[starts].tolist() + [r[1] for r in requests]
    kinds = [abi.LIFE[k] for k in ev.kind[starts].tolist()]
    groups = ev.group[starts].tolist()
    # the blocks of the events kept only (a view that shows 12 requests
    # needs a few of a trace's millions), each event's a slice of one list
    per_event = ends - starts
    blocks = stream.gather(ev.block, starts, per_event).tolist()
    last = np.cumsum(per_event)
    first, last = (last - per_event).tolist(), last.tolist()
    out = {}
    for i in order.tolist():
        req = reqs[i]
        if req not in out:
            if limit is not None and len(out) >= limit:
                continue
            out[req] = {"req": f"{req:016x}", "id": names.get(req, ""), "events": []}
        if i < nb:
            entry = [secs[at[i]], kinds[i], groups[i], blocks[first[i]:last[i]]]
        else:
            _, _, what, tokens = requests[i - nb]
            entry = [secs[at[i]], what, None, tokens]
        out[req]["events"].append(entry)
    return list(out.values())


def summary(ev: Events) -> dict:
    """Blocks per kind, and the share of the blocks requests needed that the
    prefix cache served (hit / (hit + alloc))."""
    counts = np.bincount(ev.kind, minlength=len(abi.LIFE)) if len(ev) else \
        np.zeros(len(abi.LIFE), np.int64)
    totals = {k: int(counts[i]) for i, k in enumerate(abi.LIFE)}
    needed = totals["hit"] + totals["alloc"]
    return {"blocks": totals, "reallocated": reallocations(ev),
            "prefix_served_share": totals["hit"] / needed if needed else None,
            "requests": _distinct_requests(ev),
            "incomplete_events": ev.incomplete}


def reallocations(ev: Events) -> int:
    """Allocations of a block (pid, group, id) that an allocation or a hit
    in the trace held before: what vLLM's collector counts as evictions
    (idle_before_evict has one sample each), cached or not.  block_evict
    counts fewer: the blocks whose cached content was dropped on the way."""
    alloc, hit = abi.LIFE.index("alloc"), abi.LIFE.index("hit")
    sel = np.flatnonzero(np.isin(ev.kind, (alloc, hit)))
    if not len(sel):
        return 0
    sel = sel[np.argsort(ev.ts_ns[sel], kind="stable")]
    pid = ev.pid[sel] if ev.pid is not None else np.zeros(len(sel), np.int64)
    keys = np.stack([pid, ev.group[sel], ev.block[sel]], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    first_is_alloc = int(np.count_nonzero(ev.kind[sel][first] == alloc))
    return int(np.count_nonzero(ev.kind[sel] == alloc)) - first_is_alloc


def _distinct_requests(ev: Events) -> int:
    """How many requests the events name.  An op's events are one request's
    (events() repeats its request per event, in op order), so only each
    op's first is looked at: one np.unique of the ops, not of every event."""
    if not len(ev):
        return 0
    first = np.r_[True, ev.event[1:] != ev.event[:-1]]
    return int(len(np.unique(ev.req[first])))


def stack_distances(hashes: np.ndarray) -> np.ndarray:
    """Mattson's LRU stack distance of each reference in a stream of content
    hashes: how many distinct other hashes were referenced since this hash's
    previous reference (-1 for a first reference: a compulsory miss).  An
    LRU cache of C blocks hits exactly the references with distance < C.
    O(n log n): a Fenwick tree marks the latest reference of every hash."""
    h = np.asarray(hashes)
    n = len(h)
    # previous reference of the same hash, -1 if none (numpy, no loop)
    order = np.lexsort((np.arange(n), h))
    prev = np.full(n, -1, dtype=np.int64)
    same = np.r_[False, h[order][1:] == h[order][:-1]]
    prev[order[same]] = order[np.flatnonzero(same) - 1]
    tree = [0] * (n + 1)
    out = np.full(n, -1, dtype=np.int64)
    marked = 0  # references that are some hash's latest so far
    prev_l = prev.tolist()
    for i in range(n):
        p = prev_l[i]
        if p >= 0:
            # latest references after p: the distinct hashes since p
            k, before = p + 1, 0
            while k > 0:
                before += tree[k]
                k -= k & -k
            out[i] = marked - before
            k = p + 1
            while k <= n:
                tree[k] -= 1
                k += k & -k
            marked -= 1
        k = i + 1
        while k <= n:
            tree[k] += 1
            k += k & -k
        marked += 1
    return out


def miss_ratio_curve(ev: Events, sizes=None) -> dict:
    """The hit ratio an LRU prefix cache of C blocks would give, for the
    trace's stream of block references (a prefix hit of a block's content,
    or a block computed and cached: vLLM's block_hit and block_cache, with
    their content hashes), from Mattson's stack distances.  None when the
    probes passed no hashes.

    vLLM's cache is LRU over free blocks only (blocks running requests hold
    are never evicted), so this is the curve of an LRU cache of that many
    free-for-reuse blocks; it says how the hit rate moves with N blocks
    more or fewer.  "refetched" are the references whose content had been
    cached before: misses (computed again) that a larger cache would have
    hit."""
    hit, cache = abi.LIFE.index("hit"), abi.LIFE.index("cache")
    sel = np.isin(ev.kind, (hit, cache)) & (ev.hash != 0) if ev.hash is not None else \
        np.zeros(len(ev), bool)
    if not sel.any():
        return None
    order = np.argsort(ev.ts_ns[sel], kind="stable")
    # one content per KV-cache group: the same hash in two groups is two blocks
    keys = ev.hash[sel][order] ^ (ev.group[sel][order].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    kinds = ev.kind[sel][order]
    d = stack_distances(keys)
    n = len(d)
    finite = np.sort(d[d >= 0])
    if sizes is None:
        top = int(finite[-1]) + 1 if len(finite) else 1
        sizes = sorted({max(1, int(round(top * f))) for f in
                        (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4,
                         7 / 8, 1)})
    curve = [[int(c), int(np.searchsorted(finite, c, side="left")) / n] for c in sizes]
    return {"references": int(n), "observed_hits": int(np.count_nonzero(kinds == hit)),
            "compulsory": int(np.count_nonzero(d < 0)),
            "refetched": int(np.count_nonzero((kinds == cache) & (d >= 0))),
            "curve": curve}


# -- live: attach --prometheus ---------------------------------------------

LIVE_OP_IDS = sorted(set(KIND_OF_OP) | {abi.OPS[o] for o in abi.REQUEST_OPS + abi.PREFIX_OPS})

# polls a chunk may wait for its op record (an op takes microseconds; a poll
# of the buffers reads for up to 100 ms)
EARLY_POLLS = 3


class StreamTap(records.Collector):
    """The index stream's collector while the residency histograms are live.

    The block ids of the plugin's events come only in the index stream, and
    the BPF program streams either every op's values or none (a compile-time
    switch): so the slot numbers of every write come too, and are the bulk.
    This keeps them no longer than one poll: each take() pulls out the
    block events' op records and their chunks for LiveResidency (and the
    step_rows and request-end ops, for its LiveRows) and, unless
    a Recorder consumes the whole stream (attach -o: keep_all), drops the
    rest.  The records are sorted and validated by Collector as always."""

    def __init__(self, keep_all: bool = False):
        super().__init__()
        self.keep_all = keep_all
        self._life = []  # RawBatches of block events, until LiveResidency takes them
        # chunks whose op record had not come yet (the reader caught the op
        # mid-way): (polls waited, header bytes, value bytes)
        self._early = []

    def take(self) -> records.RawBatch:
        batch = super().take()
        self._pick(batch)
        return batch

    def poll(self):
        """After each poll of the buffers: without a Recorder to take the
        stream, take it here, so that at most one poll's worth is held."""
        if not self.keep_all:
            self.take()

    def take_life(self) -> list:
        out, self._life = self._life, []
        return out

    def _pick(self, batch):
        ops = np.frombuffer(batch.ops, dtype=records.EVENT)
        # the block events; for the live miss classes (misses.LiveMisses) the
        # request ops and prefix_hashes of the same span; for the live derived
        # reads (derived_rows.LiveRows) the step_rows ops
        life = ops[np.isin(ops["op"], LIVE_OP_IDS + sorted(ROW_OP_IDS))]
        parts = [(0, batch.chunk_hdrs, batch.values), *self._early]
        hdr = np.concatenate([np.frombuffer(h, dtype=records.CHUNK_HDR) for _, h, _ in parts])
        vals = np.concatenate([np.frombuffer(v, dtype=stream.VALUE) for _, _, v in parts])
        waited = np.concatenate([np.full(len(h) // records.CHUNK_HDR.itemsize, n, np.int64)
                                 for n, h, _ in parts])
        count = hdr["count"].astype(np.int64)
        at = np.cumsum(count) - count  # where each chunk's values are in vals

        def chunks(mask):
            idx = np.flatnonzero(mask)
            return hdr[idx].tobytes(), vals[stream.ranges(at[idx], count[idx])].tobytes()

        mine = np.isin(hdr["seq"], life["seq"])
        if len(life):
            self._life.append(records.RawBatch(life.tobytes(), *chunks(mine)))
        # An op's chunks come before its op record (from the same CPU, or in
        # the ring buffer's order): a chunk whose record is not here yet is
        # of an op the reader caught mid-way, kept for the next polls, or,
        # after EARLY_POLLS, of an op whose record was lost (records_lost)
        early = ~np.isin(hdr["seq"], ops["seq"]) & ~mine
        stale = early & (waited >= EARLY_POLLS)
        self._early = [(int(n) + 1, *chunks(early & ~stale & (waited == n)))
                       for n in np.unique(waited[early & ~stale])]


class LiveResidency:
    """attach --prometheus: the residency histograms of every block, since
    attach, per process.  Fed from the tracing loop after each poll (tick());
    the exporter copies histograms() into its snapshot at each refresh.

    Events are added in time order, and a block event read late (the
    scheduler thread moved to another CPU, whose buffer the reader had
    already passed in that poll) could come after a later one: so events
    younger than HOLD_S are held back, and their samples come one HOLD_S
    later, once nothing older can still be in a buffer."""

    HOLD_S = 1.0
    # The loop polls the buffers up to a few hundred times a second (a
    # wake-up per 64 records): work is done at most every TICK_S, or as
    # soon as TAKE_BYTES of the stream wait (what that keeps in memory)
    TICK_S = 0.1
    TAKE_BYTES = 1 << 20

    def __init__(self, tap: StreamTap, bounds=RESIDENCY_BUCKETS, with_histograms: bool = True):
        self.tap = tap
        # False: the derived reads alone (attach without --prometheus shows
        # no residency histogram; each sample is a Python step per event)
        self.with_histograms = with_histograms
        self.bounds = bounds
        self.residency = Residency()
        # the plugin tier's reads, derived from its step_rows and block events
        self.rows = derived_rows.LiveRows()
        self._held = []  # OpStreams decoded and not yet added, in arrival order
        self._next = 0.0
        self._counts = {}  # pid -> {name: [per-bucket counts (np.int64), sum in seconds]}
        self.incomplete = 0  # block events left out: some of their ids did not arrive
        # misses.LiveMisses where attach serves the miss classes: fed the
        # same events, with the request and prefix_hashes records beside them
        self.misses = None

    def tick(self, now_ns: int = None, force: bool = False):
        """After a poll: take the stream, add the events older than HOLD_S.
        now_ns: the CLOCK_MONOTONIC time (the BPF program's clock) to hold
        back from; force: now, whenever the last tick was."""
        now = time.monotonic()
        if not force and now < self._next and self.tap.pending_bytes < self.TAKE_BYTES:
            return
        self._next = now + self.TICK_S
        self.tap.poll()
        batches = self.tap.take_life()
        if batches:
            self._held.append(stream.decode(batches))
        horizon = (time.monotonic_ns() if now_ns is None else now_ns) - int(self.HOLD_S * 1e9)
        due, held = [], []
        for o in self._held:
            ts = o.ops["ts_ns"].astype(np.int64)
            if not len(ts) or ts.max() <= horizon:
                due.append(o)
            elif ts.min() > horizon:
                held.append(o)
            else:
                due.append(o.select(ts <= horizon))
                held.append(_repacked(o.select(ts > horizon)))
        self._held = held
        if not due:
            return
        joined = _joined(due)
        ev = events(joined)
        self.incomplete += ev.incomplete
        # in seq order: a step's rows against the frees before it
        self.rows.add(joined.select(np.argsort(joined.ops["seq"], kind="stable")))
        if self.with_histograms:
            self.residency.add(ev)
        if self.misses is not None:
            self.misses.add(joined, ev)
        for pid, samples in self.residency.take().items():
            per = self._counts.setdefault(pid, {n: [np.zeros(len(self.bounds) + 1, np.int64), 0.0]
                                                for n in RESIDENCY})
            for name, ns in samples.items():
                seconds = np.array(ns, dtype=np.int64) / 1e9
                per[name][0] += bucket_counts(seconds, self.bounds)
                per[name][1] += float(seconds.sum())

    def histograms(self, pid: int) -> dict:
        """{name: ([(le, cumulative count)], sum in seconds)} of one
        process, zero before its first sample: new lists, for a snapshot
        that nobody changes."""
        out = {}
        for name in RESIDENCY:
            counts, total = self._counts.get(pid, {}).get(name, (None, 0.0))
            c = np.cumsum(counts).tolist() if counts is not None else \
                [0] * (len(self.bounds) + 1)
            out[name] = ([*zip(self.bounds, c[:-1]), ("+Inf", c[-1])], total)
        return out


def _joined(streams: list) -> stream.OpStream:
    """Decoded streams as one (each one's value offsets shifted)."""
    if len(streams) == 1:
        return streams[0]
    ops = np.concatenate([o.ops for o in streams])
    sizes = [len(o.values) for o in streams]
    shift = np.repeat(np.cumsum([0] + sizes[:-1]), [len(o.ops) for o in streams])
    ops["start"] += shift
    ops["stop"] += shift
    return stream.OpStream(ops, np.concatenate([o.values for o in streams]))


def _repacked(ops: stream.OpStream) -> stream.OpStream:
    """ops with only their own values, in a new array (what is held back
    must not keep the values of the events already added)."""
    o = ops.ops.copy()
    n = (o["stop"] - o["start"]).astype(np.int64)
    values = ops.values[stream.ranges(o["start"], n)]
    o["start"] = np.cumsum(n) - n
    o["stop"] = np.cumsum(n)
    return stream.OpStream(o, values)
