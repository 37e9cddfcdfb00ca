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


def classify(ev: lifecycle.Events, req_events: list, prefixes: list = (),
             block_size: int = None, names: dict = None) -> dict:
    """Every prompt block a request computed at its first admission, in one
    class (module doc), per request and in total.  block_size: the pool's
    (else the one prefix_hashes said); without either, no request's prompt
    blocks are told from its generated ones and tokens are not counted."""
    names = names or {}
    rows = _rows(ev)
    hit, cache, evict = _kind("hit"), _kind("cache"), _kind("evict")
    prompt = {}   # req -> prompt tokens
    preempt_at = {}  # req -> first preemption ns
    for ts, req, what, n in req_events:
        if what == "arrive":
            prompt.setdefault(req, n)
        elif what == "preempt":
            preempt_at.setdefault(req, ts)
    bs_of = {p.req: p.block_size for p in prefixes if p.block_size > 0}
    if block_size is None and bs_of:
        block_size = max(set(bs_of.values()), key=list(bs_of.values()).count)

    at, _, _, dist = _references(rows)
    ref_dist = {i: int(dist[j]) for j, i in enumerate(at)}

    # the cache's history per content: in time order, (row index, what,
    # request): "ref" (cached or hit), "evict"
    history = {}
    for i, (ts, kind, req, group, block, h, pid, _) in enumerate(rows):
        if not h:
            continue
        if kind in (hit, cache):
            history.setdefault(_key(pid, group, h), []).append((i, "ref", kind, req))
        elif kind == evict:
            history.setdefault(_key(pid, group, h), []).append((i, "evict", kind, req))

    # each request's first admission: its first block event (an eviction
    # for its allocation comes before the allocation's own event)
    first_at = {}
    per_req = {}  # req -> [(row index, kind, group, hash, pid)] before any preemption
    for i, (ts, kind, req, group, block, h, pid, _) in enumerate(rows):
        if req == 0:
            continue
        first_at.setdefault(req, i)
        if kind in (hit, cache) and ts < preempt_at.get(req, 1 << 63):
            per_req.setdefault(req, []).append((i, kind, group, h, pid))

    # earlier requests' token-only prefixes, for hash domain and below the
    # block: chain hash -> the domains that had it, in arrival order
    seen = {}
    shared = {}  # req -> (tokens shared in its domain, tokens shared in another)
    for p in prefixes:
        g = p.tokens_per_hash
        same = other = 0
        for k, hv in enumerate(p.hashes):
            doms = seen.get((p.pid, hv))
            if not doms:
                break
            if p.domain in doms:
                same = (k + 1) * g
            if doms - {p.domain}:
                other = (k + 1) * g
        shared[p.req] = (same, other, g)
        for hv in p.hashes:
            seen.setdefault((p.pid, hv), set()).add(p.domain)

    totals = {c: {"blocks": 0, "tokens": 0, "requests": 0} for c in CAUSES}
    requests = []
    for req, evs in per_req.items():
        adm = first_at[req]
        groups = sorted({e[2] for e in evs})
        missed = {c: 0 for c in CAUSES}
        tokens = {c: 0 for c in CAUSES}
        detail = []
        hits_total = 0
        for g in groups:
            mine = [e for e in evs if e[2] == g]
            nhit = sum(1 for e in mine if e[1] == hit)
            hits_total += nhit
            computed = [e for e in mine if e[1] == cache]
            if req in prompt and block_size:
                computed = computed[:max(0, prompt[req] // block_size - nhit)]
            for pos, (i, _, group, h, pid) in enumerate(computed):
                j = nhit + pos  # the block's place in the prompt
                cause, info = _cause(history.get(_key(pid, group, h), ()), adm, rows,
                                     shared.get(req), j, block_size, ref_dist.get(i), names)
                missed[cause] += 1
                t = info.pop("tokens", block_size or 0)
                tokens[cause] += t
                detail.append({"group": int(group), "block": j, "cause": cause,
                               "tokens": t, **info})
        if not detail and not hits_total:
            continue
        for c in CAUSES:
            totals[c]["blocks"] += missed[c]
            totals[c]["tokens"] += tokens[c]
            totals[c]["requests"] += 1 if missed[c] else 0
        requests.append({"req": f"{req:016x}", "id": names.get(req, ""),
                         "prompt_tokens": prompt.get(req), "hit_blocks": hits_total,
                         "missed_blocks": missed, "recomputed_tokens": tokens,
                         "misses": detail, "admitted_s": rows[adm][0]})
    requests.sort(key=lambda r: r["admitted_s"])
    return {"block_size": block_size, "prefix_hashes": len(prefixes) > 0,
            "totals": totals, "requests": requests}


def _cause(hist, adm, rows, shared, j, bs, distance, names):
    """The class of a prompt block (index j) computed by a request admitted
    at row adm, from its content's history (module doc)."""
    before = hist[:bisect.bisect_left(hist, (adm,))]  # in row order
    if any(h[1] == "ref" for h in before):
        copies, last_evict = 0, None
        for i, what, kind, req in before:
            if what == "ref":
                # a hit proves a copy lives (one cached before the trace)
                copies = copies + 1 if kind == _kind("cache") else max(copies, 1)
            else:
                copies = max(0, copies - 1)
                last_evict = (i, req)
        if copies == 0 and last_evict is not None:
            i, by = last_evict
            return "capacity", {"evicted_s": rows[i][0], "evicted_for": f"{by:016x}",
                                "evicted_for_id": names.get(by, ""),
                                "reuse_distance": distance}
        return "resident", {}
    if shared and bs:
        same, other, _ = shared
        lo, hi = j * bs, (j + 1) * bs
        if other >= hi and same < hi:
            return "hash_domain", {}
        if lo < same < hi:
            return "below_block", {"tokens": same - lo, "shareable_tokens": same - lo}
    return "compulsory", {}


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
