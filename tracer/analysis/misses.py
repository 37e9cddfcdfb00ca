"""Why the prefix cache missed, why every block left, what eviction cost,
and how far LRU is from optimal: from a recording of the plugin tier
(docs/misses.md).

A request's prompt needs its full blocks (only full blocks are cached and
hit: vLLM hashes full blocks).  vLLM matches the longest cached prefix of
them when it admits the request (block_hit); the rest it computes, and
caches as they fill (block_cache, in block order, with their content
hashes).  Each prompt block it computed at its first admission is a miss,
put in one class (CAUSES), by the cache's history before that admission:

- capacity: the block's content (hash, KV-cache group, process) had been
  cached or hit before and its last copy was evicted since (block_evict):
  when, for whose allocation, and its reuse distance (the distinct other
  contents referenced since its last reference: Mattson's stack distance;
  an LRU cache of more free blocks than that would have kept it);
- resident: its content was cached when the request came, yet not
  matched: an earlier block of the request missed (a prefix match stops at
  its first miss), or the block ends the prompt (vLLM always computes the
  last prompt token);
- hash domain: never cached under this request's hash inputs, but an
  earlier request had the same tokens under other extra keys (cache salt,
  LoRA, multimodal inputs): the prefix_hashes probe's token-only hashes say
  so;
- below the block: never cached, and the request shared a prefix with an
  earlier one (same extra keys) that ended inside this block: those
  shareable tokens are recomputed though no full block could match;
- compulsory: none of the above: its content was new to the trace.

Hash domain and below the block need the prefix_hashes probe (hashes of
the prompt's tokens every few tokens, computed in vLLM's process: never
the tokens); without it those misses count as compulsory.
"""

import bisect
import heapq
from dataclasses import dataclass, field

import numpy as np

from .. import abi
from . import lifecycle

CAUSES = ("compulsory", "capacity", "below_block", "hash_domain", "resident")
# why a block left a request or the cache (removals())
REASONS = ("finished", "preempted", "window", "evicted", "reset")
# prefix_hashes, if the probe ABI has it (bpf/kvtrace.h)
PREFIX_OP = abi.OPS.get("prefix_hashes")
# requests named in the text report's worst-requests table
WORST_SHOWN = 12
# regret entries listed one by one (the totals count them all)
REGRET_LISTED = 200


@dataclass
class Prefix:
    """One request's prefix_hashes: chain hashes of its prompt's tokens
    (hashes[k] covers tokens [0, (k + 1) * tokens_per_hash)), the salt, LoRA
    and multimodal keys left out; domain: a hash of those extra keys."""
    ts_ns: int
    pid: int
    req: int
    tokens_per_hash: int
    block_size: int
    domain: int
    hashes: list = field(default_factory=list)


def prefix_records(ops) -> list:
    """The prefix_hashes records of a decoded stream, in time order
    (cache_id: the request, cache_index: tokens per hash, rows: the block
    size, held_tokens: the domain key, values: the hashes)."""
    if PREFIX_OP is None:
        return []
    o = ops.ops
    idx = np.flatnonzero((o["op"] == PREFIX_OP) & o["complete"])
    out = []
    for i in idx.tolist():
        r = o[i]
        out.append(Prefix(int(r["ts_ns"]), int(r["pid"]), int(r["cache_id"]),
                          int(r["cache_index"]), int(r["rows"]), int(r["held_tokens"]),
                          ops.values_of(i).astype(np.uint64).tolist()))
    out.sort(key=lambda p: p.ts_ns)
    return out


def _key(pid, group, h):
    return (int(pid), int(group), int(h))


def _kind(name):
    return abi.LIFE.index(name)


def _rows(ev: lifecycle.Events):
    """The events as Python rows in time order (the scheduler's order among
    equal times): (ts, kind, req, group, block, hash, pid, event)."""
    if not len(ev):
        return []
    order = np.lexsort((np.arange(len(ev)), ev.ts_ns))
    pid = ev.pid if ev.pid is not None else np.zeros(len(ev), np.int64)
    h = ev.hash if ev.hash is not None else np.zeros(len(ev), np.uint64)
    return list(zip(ev.ts_ns[order].tolist(), ev.kind[order].tolist(),
                    ev.req[order].tolist(), ev.group[order].tolist(),
                    ev.block[order].tolist(), h[order].tolist(), pid[order].tolist(),
                    ev.event[order].tolist()))


def _references(rows):
    """The reference stream of the miss-ratio curve (hits and caches with a
    hash), as keys in time order, and each reference's stack distance."""
    hit, cache = _kind("hit"), _kind("cache")
    at = [i for i, r in enumerate(rows) if r[1] in (hit, cache) and r[5]]
    keys = [_key(rows[i][6], rows[i][3], rows[i][5]) for i in at]
    ids = {}
    dense = np.array([ids.setdefault(k, len(ids)) for k in keys], np.int64)
    d = lifecycle.stack_distances(dense) if len(dense) else np.zeros(0, np.int64)
    return at, keys, dense, d


class _History:
    """What the cache held of each content (pid, group, hash), change by
    change, in time order: per content a list of (seq, copies, evicted ns,
    evicted for), seq the event's place in time order.  A cache adds a
    copy, an eviction drops one, and a hit proves one lives (a content
    cached before the trace began)."""

    def __init__(self):
        self.by_key = {}

    def ref(self, key, seq, is_cache):
        h = self.by_key.get(key)
        copies, ets, by = h[-1][1:] if h else (0, None, None)
        copies = copies + 1 if is_cache else max(copies, 1)
        (h if h is not None else self.by_key.setdefault(key, [])).append(
            (seq, copies, ets, by))

    def evict(self, key, seq, ts, req):
        h = self.by_key.get(key)
        if not h:  # a content the trace never saw referenced: nothing to judge by
            return
        h.append((seq, max(0, h[-1][1] - 1), ts, req))

    def at(self, key, seq):
        """(copies, evicted ns, evicted for) just before seq; None if the
        content was not referenced before it."""
        h = self.by_key.get(key)
        if not h:
            return None
        k = bisect.bisect_left(h, (seq,))
        return h[k - 1][1:] if k else None

    def prune(self, seq):
        """Forgets the changes no admission at or after seq can ask for."""
        for h in self.by_key.values():
            k = bisect.bisect_left(h, (seq,))
            if k > 1:
                del h[:k - 1]


KINDS = tuple(abi.LIFE.index(k) for k in ("hit", "cache", "evict"))


class Classifier:
    """The miss classes, request by request, fed in time order: request
    ops, prefix_hashes records and block events (classify() for a
    recording, LiveMisses for attach --prometheus).  A request's prompt
    blocks are judged by the cache as its first block event (its
    admission) found it."""

    def __init__(self, block_size: int = None, names: dict = None, detail: bool = True,
                 max_prefix_hashes: int = None):
        self.block_size = block_size
        self.names = names or {}
        self.detail = detail
        self.history = _History()
        self.totals = {c: {"blocks": 0, "tokens": 0, "requests": 0} for c in CAUSES}
        self.reqs = {}   # req -> its state (_new_req)
        self.seen = {}   # (pid, token chain hash) -> the domains that had it
        self.max_prefix_hashes = max_prefix_hashes
        self.any_prefix = False

    def _req(self, req):
        r = self.reqs.get(req)
        if r is None:
            r = self.reqs[req] = {
                "prompt": None, "adm": None, "adm_ns": None, "preempted": False,
                "shared": None, "bs": None, "hits": {}, "computed": {},
                "missed": dict.fromkeys(CAUSES, 0), "tokens": dict.fromkeys(CAUSES, 0),
                "misses": []}
        return r

    def request_op(self, req, what, n):
        r = self._req(req)
        if what == "arrive" and r["prompt"] is None:
            r["prompt"] = n
        elif what == "preempt":
            r["preempted"] = True

    def prefix(self, p: Prefix):
        """A request's prefix_hashes: what it shares with the requests
        before it, in its domain and in others."""
        self.any_prefix = True
        g = p.tokens_per_hash
        same = other = 0
        for k, hv in enumerate(p.hashes):
            doms = self.seen.get((p.pid, hv))
            if not doms:
                break
            if p.domain in doms:
                same = (k + 1) * g
            if doms - {p.domain}:
                other = (k + 1) * g
        r = self._req(p.req)
        r["shared"] = (same, other)
        if p.block_size > 0:
            r["bs"] = p.block_size
        for hv in p.hashes:
            self.seen.setdefault((p.pid, hv), set()).add(p.domain)
        cap = self.max_prefix_hashes
        if cap is not None and len(self.seen) > cap:  # the oldest prompts' first
            for key in list(self.seen)[:len(self.seen) - cap]:
                del self.seen[key]

    def event(self, seq, ts, kind, req, group, h, pid, distance=None):
        """One block of a block event, in time order (seq: its place)."""
        hit, cache, evict = KINDS
        key = _key(pid, group, h) if h else None
        if req:
            r = self._req(req)
            if r["adm"] is None:  # its admission: an eviction for it comes first
                r["adm"], r["adm_ns"] = seq, ts
            if kind in (hit, cache) and key is not None and not r["preempted"]:
                self._judge(r, kind, group, key, distance)
        if key is None:
            return
        if kind in (hit, cache):
            self.history.ref(key, seq, kind == cache)
        elif kind == evict:
            self.history.evict(key, seq, ts, req)

    def _judge(self, r, kind, group, key, distance):
        if kind == KINDS[0]:
            r["hits"][group] = r["hits"].get(group, 0) + 1
            return
        bs = self.block_size or r["bs"]
        nhit, pos = r["hits"].get(group, 0), r["computed"].get(group, 0)
        if r["prompt"] is not None and bs and nhit + pos >= r["prompt"] // bs:
            return  # a block of generated tokens, not of the prompt
        r["computed"][group] = pos + 1
        j = nhit + pos  # the block's place in the prompt
        cause, info = self._cause(self.history.at(key, r["adm"]), r["shared"], j, bs,
                                  distance)
        t = info.pop("tokens", bs or 0)
        if not r["missed"][cause]:
            self.totals[cause]["requests"] += 1
        r["missed"][cause] += 1
        r["tokens"][cause] += t
        self.totals[cause]["blocks"] += 1
        self.totals[cause]["tokens"] += t
        if self.detail:
            r["misses"].append({"group": int(group), "block": j, "cause": cause,
                                "tokens": t, **info})

    def _cause(self, state, shared, j, bs, distance):
        """The class of prompt block j, from its content's state when the
        request came, and what the request shared (module doc)."""
        if state is not None:
            copies, ets, by = state
            if copies == 0 and ets is not None:
                return "capacity", {"evicted_s": ets, "evicted_for": f"{by:016x}",
                                    "evicted_for_id": self.names.get(by, ""),
                                    "reuse_distance": distance}
            return "resident", {}
        if shared and bs:
            same, other = shared
            lo, hi = j * bs, (j + 1) * bs
            if other >= hi and same < hi:
                return "hash_domain", {}
            if lo < same < hi:
                return "below_block", {"tokens": same - lo, "shareable_tokens": same - lo}
        return "compulsory", {}

    def requests(self) -> list:
        """Every admitted request's figures, in admission order."""
        out = []
        for req, r in self.reqs.items():
            if r["adm"] is None or not (r["hits"] or r["computed"]):
                continue
            out.append({"req": f"{req:016x}", "id": self.names.get(req, ""),
                        "prompt_tokens": r["prompt"], "hit_blocks": sum(r["hits"].values()),
                        "missed_blocks": r["missed"], "recomputed_tokens": r["tokens"],
                        "misses": r["misses"], "admitted_s": r["adm_ns"]})
        out.sort(key=lambda x: x["admitted_s"])
        return out


def classify(ev: lifecycle.Events, req_events: list, prefixes: list = (),
             block_size: int = None, names: dict = None) -> dict:
    """Every prompt block a request computed at its first admission, in one
    class (module doc), per request and in total.  block_size: the pool's
    (else the one prefix_hashes said); without either, no request's prompt
    blocks are told from its generated ones and tokens are not counted."""
    rows = _rows(ev)
    at, _, _, dist = _references(rows)
    ref_dist = {i: int(dist[j]) for j, i in enumerate(at)}
    sizes = [p.block_size for p in prefixes if p.block_size > 0]
    if block_size is None and sizes:
        block_size = max(set(sizes), key=sizes.count)
    c = Classifier(block_size, names)
    # in time order; at a tie request ops first (they precede their blocks'
    # events), then prefix records, then block events in the scheduler's order
    feed = [(ts, 0, k) for k, (ts, _, _, _) in enumerate(req_events)]
    feed += [(p.ts_ns, 1, k) for k, p in enumerate(prefixes)]
    feed += [(row[0], 2, i) for i, row in enumerate(rows)]
    feed.sort()
    for _, what, k in feed:
        if what == 0:
            c.request_op(*req_events[k][1:])
        elif what == 1:
            c.prefix(prefixes[k])
        else:
            ts, kind, req, group, _, h, pid, _ = rows[k]
            c.event(k, ts, kind, req, group, h, pid, ref_dist.get(k))
    return {"block_size": block_size, "prefix_hashes": c.any_prefix,
            "totals": c.totals, "requests": c.requests()}


def removals(ev: lifecycle.Events, req_events: list, names: dict = None) -> dict:
    """Why each block left: a block_free is the request's end (finished:
    aborts included, req_finish does not tell them apart), its preemption,
    or a release while it runs (window: blocks a sliding window or a Mamba
    group skipped); a block_evict is for an allocation (naming the request
    it was evicted for) or, in no request's name, a reset of the prefix
    cache (or a KV connector's invalidation)."""
    names = names or {}
    free, evict = _kind("free"), _kind("evict")
    last_op = {}  # req -> sorted [(ts, what)]
    for ts, req, what, _ in req_events:
        if what in ("preempt", "finish"):
            last_op.setdefault(req, []).append((ts, what))
    for v in last_op.values():
        v.sort()
    counts = dict.fromkeys(REASONS, 0)
    evicted_for = {}
    for ts, kind, req in zip(ev.ts_ns.tolist(), ev.kind.tolist(), ev.req.tolist()):
        if kind == free:
            ops = last_op.get(req, ())
            k = _bisect(ops, ts)
            what = ops[k - 1][1] if k else None
            counts["finished" if what == "finish" else "preempted" if what == "preempt"
                   else "window"] += 1
        elif kind == evict:
            if req == 0:
                counts["reset"] += 1
            else:
                counts["evicted"] += 1
                evicted_for[req] = evicted_for.get(req, 0) + 1
    top = sorted(evicted_for.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"reasons": counts,
            "evicted_for": [{"req": f"{r:016x}", "id": names.get(r, ""), "blocks": n}
                            for r, n in top[:WORST_SHOWN]]}


def _bisect(pairs, ts):
    """How many (ts, _) of sorted pairs are at or before ts."""
    lo, hi = 0, len(pairs)
    while lo < hi:
        mid = (lo + hi) // 2
        if pairs[mid][0] <= ts:
            lo = mid + 1
        else:
            hi = mid
    return lo


def regret(classes: dict) -> dict:
    """Evicted blocks asked for again: each capacity miss, from the eviction
    (when, for whom) to the request that needed the content again."""
    entries = []
    for r in classes["requests"]:
        for m in r["misses"]:
            if m["cause"] == "capacity":
                entries.append({"evicted_s": m["evicted_s"], "evicted_for": m["evicted_for"],
                                "evicted_for_id": m["evicted_for_id"],
                                "needed_s": r["admitted_s"],
                                "needed_by": r["req"], "needed_by_id": r["id"],
                                "group": m["group"], "block": m["block"],
                                "tokens": m["tokens"], "reuse_distance": m["reuse_distance"]})
    return {"blocks": len(entries), "tokens": sum(e["tokens"] for e in entries),
            "entries": entries[:REGRET_LISTED]}


# -- the optimal (Belady) hit rate -------------------------------------------------

def optimal_hits(keys, capacity: int) -> int:
    """Hits of Belady's MIN over a reference stream with a cache of
    `capacity` entries: every referenced content is in the cache after its
    reference (demand caching, as LRU's stack distances assume), and when
    one must go it is the content referenced again farthest in the future
    (never, first).  O(n log n)."""
    keys = list(keys)
    n = len(keys)
    if capacity <= 0 or not n:
        return 0
    nxt = [n] * n
    last = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(keys[i], n + i)  # never again: farthest, by position
        last[keys[i]] = i
    resident = {}  # key -> its next reference (the heap's current entry)
    heap = []
    hits = 0
    for i, k in enumerate(keys):
        if k in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) == -far:
                    del resident[victim]
                    break
        resident[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return hits


def optimal_curve(ev: lifecycle.Events, sizes: list) -> list:
    """[[C, Belady's hit ratio]] over the miss-ratio curve's references
    (lifecycle.miss_ratio_curve: hits and caches with a hash, in time
    order, one content per group)."""
    hit, cache = _kind("hit"), _kind("cache")
    if ev.hash is None:
        return []
    sel = np.isin(ev.kind, (hit, cache)) & (ev.hash != 0)
    if not sel.any():
        return []
    order = np.argsort(ev.ts_ns[sel], kind="stable")
    keys = (ev.hash[sel][order] ^ (ev.group[sel][order].astype(np.uint64) *
                                   np.uint64(0x9E3779B97F4A7C15))).tolist()
    n = len(keys)
    return [[int(c), optimal_hits(keys, int(c)) / n] for c in sizes]


def figures(ev: lifecycle.Events, ops, names: dict = None, t0_ns: int = 0,
            mrc: dict = None, block_size: int = None) -> dict:
    """The report's "misses" part (docs/misses.md), or None without block
    events with hashes.  block_size: the pool's, where the block tables
    said it (the prefix_hashes probe says it too)."""
    if not len(ev) or ev.hash is None or not np.any(ev.hash != 0):
        return None
    req_events = lifecycle.request_events(ops)
    classes = classify(ev, req_events, prefix_records(ops), block_size=block_size,
                       names=names)

    def secs(ns):
        return round((ns - t0_ns) / 1e9, 6)

    for r in classes["requests"]:
        r["admitted_s"] = secs(r["admitted_s"])
        for m in r["misses"]:
            if "evicted_s" in m:
                m["evicted_s"] = secs(m["evicted_s"])
    out = {**classes, "removals": removals(ev, req_events, names),
           "regret": regret(classes)}
    if mrc:
        out["optimal_curve"] = optimal_curve(ev, [c for c, _ in mrc["curve"]])
    return out


# -- live: attach --prometheus -------------------------------------------------

class LiveMisses:
    """attach --prometheus: the miss classes since attach, per process, fed
    by lifecycle.LiveResidency with each batch of block events (in time
    order: it holds recent ones back) and the request and prefix_hashes
    records of the same span.  Totals only: a request's state is dropped
    when it finishes, and each content keeps only the history an open
    request's admission can still ask for."""

    PRUNE_EVERY = 1 << 14  # events between two prunings of the history
    MAX_PREFIX_HASHES = 1 << 20  # token chain hashes kept per process (oldest go)

    def __init__(self):
        self._by_pid = {}
        self._seq = 0
        self._since_prune = 0

    def _classifier(self, pid):
        c = self._by_pid.get(pid)
        if c is None:
            c = self._by_pid[pid] = Classifier(detail=False,
                                               max_prefix_hashes=self.MAX_PREFIX_HASHES)
        return c

    def add(self, ops, ev: lifecycle.Events):
        """One batch: ops, the decoded stream it came from (its request and
        prefix_hashes records), ev its block events."""
        o = ops.ops
        req_op = np.isin(o["op"], list(lifecycle.REQUEST_OP_IDS))
        feed = [(int(r["ts_ns"]), 0, ("op", int(r["pid"]), int(r["cache_id"]),
                                      lifecycle.REQUEST_EVENT[
                                          lifecycle.REQUEST_OP_IDS[int(r["op"])]],
                                      int(r["items"])))
                for r in o[req_op]]
        feed += [(p.ts_ns, 1, ("prefix", p)) for p in prefix_records(ops)]
        feed += [(row[0], 2, ("ev", row)) for row in _rows(ev)]
        feed.sort(key=lambda x: x[:2])
        free = _kind("free")
        for _, _, item in feed:
            if item[0] == "op":
                _, pid, req, what, n = item
                c = self._classifier(pid)
                if what == "finish":
                    c.reqs.pop(req, None)
                else:
                    c.request_op(req, what, n)
            elif item[0] == "prefix":
                self._classifier(item[1].pid).prefix(item[1])
            else:
                ts, kind, req, group, _, h, pid, _ = item[1]
                if kind == free:
                    continue  # a release: nothing to classify, nor to remember
                self._seq += 1
                self._classifier(pid).event(self._seq, ts, kind, req, group, h, pid)
                self._since_prune += 1
        if self._since_prune >= self.PRUNE_EVERY:
            self._since_prune = 0
            for c in self._by_pid.values():
                open_adm = [r["adm"] for r in c.reqs.values() if r["adm"] is not None]
                c.history.prune(min(open_adm, default=self._seq + 1))

    def totals(self, pid: int) -> dict:
        """{cause: {"blocks", "tokens", "requests"}} of one process, zero
        before its first miss."""
        c = self._by_pid.get(pid)
        return {k: dict(v) for k, v in c.totals.items()} if c else \
            {k: {"blocks": 0, "tokens": 0, "requests": 0} for k in CAUSES}
