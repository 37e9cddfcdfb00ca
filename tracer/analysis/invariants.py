"""Cross-figure invariants over the report's JSON (docs/report-json.md): what
one figure says about another, so that no two figures on a screen, or in
the document, contradict each other.  `report --check` runs them on a
user's recording; every end-to-end test that makes a recording runs them
(tests/conftest.py).  Pure logic over the document, no trace needed.

Each check is a function of the document that returns (ok, detail), or None
where the document has nothing it applies to (no reads, no plugin tier).
"""

from .. import abi

# the tracer's own command name: a traced process never has it (the child
# of `record -- CMD` carries it from fork to exec)
TRACER_COMM = "kvtrace-bpf"


def _groups(doc):
    for p in doc["blocks"]["processes"]:
        for g in p["groups"]:
            yield p, g


def _highest(sparse):
    return max((b for b, _ in sparse), default=-1)


def panel_headers_agree(doc):
    """A process's read panels count blocks of the same cache as its write
    panel ("of N"), and every histogram fits under its header's N."""
    bad, seen = [], 0
    for p in doc["blocks"]["processes"]:
        cache = max([l["num_blocks"] for l in p["layers"]] + [0])
        for l in p["layers"]:
            seen += 1
            if _highest(l["writes"]) >= l["num_blocks"]:
                bad.append(f"pid {p['pid']} layer {l['layer']}: block "
                           f"{_highest(l['writes'])} written, of {l['num_blocks']}")
        for g in p["groups"]:
            seen += 1
            if _highest(g["reads_per_block"]) >= g["num_blocks"]:
                bad.append(f"pid {p['pid']} group {g['group']}: block "
                           f"{_highest(g['reads_per_block'])} read, of {g['num_blocks']}")
            if cache and g["num_blocks"] != cache:
                bad.append(f"pid {p['pid']}: reads of group {g['group']} are of "
                           f"{g['num_blocks']} blocks, writes of {cache}")
    if not seen:
        return None
    return not bad, "; ".join(bad) or f"{seen} panels: every block within its header's count"


def hottest_coldest_disjoint(doc):
    """No block is both among the hottest and the coldest."""
    if not doc["access"]:
        return None
    bad = []
    for f in doc["access"]:
        both = {b for b, _ in f["hottest"]} & {b for b, _ in f["coldest"]}
        if both:
            bad.append(f"pid {f['pid']} group {f['group']}: blocks {sorted(both)} in both")
    return not bad, "; ".join(bad) or "hottest and coldest blocks disjoint in every group"


def _exact(doc) -> bool:
    """Whether the stream holds every op's values: the per-block figures
    come from complete ops, the totals from every op record, so only then
    are the two equal (else the per-block ones are at most the totals, and
    the report says why: blocks.inexact_reasons)."""
    return bool(doc["blocks"]["exact"])


def working_set_within_cache(doc):
    """The working set of a step never exceeds the cache's blocks, nor
    (where the stream is exact) the blocks read at all."""
    groups = {(p["pid"], g["group"]): g for p, g in _groups(doc)}
    if not doc["access"]:
        return None
    bad = []
    for f in doc["access"]:
        top = max((v for _, v in f["wss_blocks"]), default=0)
        g = groups.get((f["pid"], f["group"]))
        # a step's distinct blocks are counted from its op record, the
        # blocks read from the complete steps' tables
        caps = ([g["num_blocks"]] if g else []) + ([f["blocks_read"]] if _exact(doc) else [])
        cap = min(caps, default=top)
        if top > cap:
            bad.append(f"pid {f['pid']} group {f['group']}: {top:g} blocks a step, of "
                       f"{f['blocks_read']} read and {g['num_blocks'] if g else '?'} in the cache")
    return not bad, "; ".join(bad) or "the largest working set is within the blocks read"


def shares_within_0_1(doc):
    """Utilization, fill and unwritten share are shares: 0 to 100%."""
    vals = []
    for f in doc["access"]:
        vals += [(f"pid {f['pid']} utilization p{p:g}", v) for p, v in f["utilization"]]
        vals += [(f"pid {f['pid']} internal fragmentation p{p:g}", v)
                 for p, v in f.get("internal_fragmentation", [])]
        if f["utilization_overall"] is not None:
            vals.append((f"pid {f['pid']} utilization overall", f["utilization_overall"]))
    for o in doc["occupancy"]:
        for k in ("fill_level_mean", "unwritten_share_mean"):
            if o.get(k) is not None:
                vals.append((f"pid {o['pid']} layer {o['layer']} {k}", o[k]))
    if not vals:
        return None
    bad = [f"{what} {v:.4g}" for what, v in vals if not 0 <= v <= 1]
    return not bad, "; ".join(bad) or f"{len(vals)} shares within 0-100%"


def layers_whole(doc):
    """A group's layer count is an integer (else its reason is given)."""
    if not doc["access"]:
        return None
    bad = [f"pid {f['pid']} group {f['group']}: {f['layers']} layers"
           for f in doc["access"]
           if f["layers"] != int(f["layers"]) and not f.get("layers_note")]
    return not bad, "; ".join(bad) or "every group's layer count is whole"


def process_names(doc):
    """Each traced process is named by its own command, not the tracer's."""
    bad = [f"pid {p['pid']} named {p['comm']!r}" for p in doc["blocks"]["processes"]
           if p["comm"] == TRACER_COMM]
    bad += [f"pid {p['pid']} named {p['comm']!r}" for p in doc["trace"]["processes"]
            if p.get("comm") == TRACER_COMM]
    return not bad, "; ".join(bad) or "no process carries the tracer's name"


def lifecycle_per_process(doc):
    """A process whose block events are counted has its lifecycle figures
    (not null), and they are the op table's blocks, kind by kind; the
    processes' sums are the summary's."""
    life = doc.get("lifecycle")
    counted = {}
    bad = []
    exact = _exact(doc)
    for p in doc["blocks"]["processes"]:
        blocks = {k: p["ops"].get(op, {}).get("slots", 0) for op, k in
                  zip(abi.LIFE_OPS, abi.LIFE)}
        if not any(blocks.values()):
            continue
        pl = p["lifecycle"]
        if pl is None:
            bad.append(f"pid {p['pid']}: {sum(blocks.values()):,} block events, lifecycle null")
            continue
        for k, n in blocks.items():
            got = pl["totals"].get(k, 0)
            counted[k] = counted.get(k, 0) + got
            # an op whose ids were lost is in the op table, not per block
            if got != n if exact else got > n:
                bad.append(f"pid {p['pid']}: {n:,} {k} blocks in the op table, {got:,} "
                           "in its lifecycle")
    if not counted and not bad:
        return None
    if life is not None and not bad:
        for k, n in life["summary"]["blocks"].items():
            if counted.get(k, 0) != n:
                bad.append(f"{k}: {counted.get(k, 0):,} over the processes, {n:,} in the summary")
    return not bad, "; ".join(bad) or (
        "every process's block events agree with the summary" if exact else
        "every process's block events agree with the summary, and are at most the op "
        "table's (the stream is not exact)")


def request_sums(doc):
    """The requests' events, kind by kind, sum to the summary's blocks."""
    life = doc.get("lifecycle")
    if not life:
        return None
    per = dict.fromkeys(abi.LIFE, 0)
    for r in life["requests"]:
        for _, kind, _, what in r["events"]:
            if kind in per:
                per[kind] += len(what)
    want = life["summary"]["blocks"]
    bad = [f"{k}: {per[k]:,} over the requests, {want.get(k, 0):,} in all"
           for k in abi.LIFE if per[k] != want.get(k, 0)]
    return not bad, "; ".join(bad) or f"{len(life['requests']):,} requests sum to the totals"


def residency_counts(doc):
    """idle_before_evict has one sample per re-allocation (vLLM's definition:
    any block handed out again, cached or not), lifetime at most as many;
    evictions from the prefix cache are at most the allocations; each
    histogram's +Inf bucket is its count."""
    life = doc.get("lifecycle")
    if not life:
        return None
    bad = []
    s = life["summary"]
    for n in ("lifetime", "idle_before_evict", "reuse_gap"):
        h = life[n]
        if h["buckets"][-1][1] != h["count"]:
            bad.append(f"{n}: +Inf bucket {h['buckets'][-1][1]:,}, count {h['count']:,}")
    if life["idle_before_evict"]["count"] != s["reallocated"]:
        bad.append(f"idle_before_evict has {life['idle_before_evict']['count']:,} samples, "
                   f"{s['reallocated']:,} blocks re-allocated")
    if life["lifetime"]["count"] > life["idle_before_evict"]["count"]:
        bad.append("more lifetimes than re-allocations")
    if s["blocks"]["evict"] > s["blocks"]["alloc"]:
        bad.append(f"{s['blocks']['evict']:,} evicted, {s['blocks']['alloc']:,} allocated")
    return not bad, "; ".join(bad) or (
        f"{s['reallocated']:,} re-allocations, {s['blocks']['evict']:,} of them evictions "
        "from the prefix cache")


def miss_ratio_curve(doc):
    """The curve rises from 0 to 100% at most, and at its largest size
    misses only the compulsory references (first ones), which no cache
    hits: so its top is (references - compulsory) / references; the
    recomputed blocks a larger cache would have hit are among the rest."""
    mrc = (doc.get("lifecycle") or {}).get("miss_ratio_curve")
    if not mrc:
        return None
    bad = []
    ratios = [r for _, r in mrc["curve"]]
    if any(b < a for a, b in zip(ratios, ratios[1:])) or not all(0 <= r <= 1 for r in ratios):
        bad.append(f"hit ratios {ratios} not rising within 0-100%")
    n, comp = mrc["references"], mrc["compulsory"]
    top = (n - comp) / n if n else 0
    if ratios and abs(ratios[-1] - top) > 1e-9:
        bad.append(f"largest cache hits {ratios[-1]:.4f}, all but the {comp:,} compulsory "
                   f"misses is {top:.4f}")
    if mrc["refetched"] > n - comp:
        bad.append(f"{mrc['refetched']:,} recomputed of {n - comp:,} non-compulsory references")
    return not bad, "; ".join(bad) or (
        f"the curve tops at {100 * top:.1f}%: all but the {comp:,} first references")


def miss_causes(doc):
    """The miss classes (docs/misses.md) add up: the requests' misses to the
    totals, each request's hit and missed blocks to no more than its
    prompt's full blocks; every removal has one reason (the reasons are the
    summary's frees and evictions); the regret is the capacity misses; and
    the optimal cache hits at least as much as LRU at every size."""
    lc = doc.get("lifecycle") or {}
    m = lc.get("misses")
    if not m:
        return None
    bad = []
    per = {}
    for r in m["requests"]:
        for x in r["misses"]:
            b, t = per.get(x["cause"], (0, 0))
            per[x["cause"]] = (b + 1, t + x["tokens"])
        bs = m["block_size"]
        if bs and r["prompt_tokens"] is not None and \
                r["hit_blocks"] + len(r["misses"]) > r["prompt_tokens"] // bs * \
                max(1, len({x["group"] for x in r["misses"]})):
            bad.append(f"{r['id'] or r['req']}: {r['hit_blocks']} hit + {len(r['misses'])} "
                       f"missed blocks, of a {r['prompt_tokens']}-token prompt")
    for c, t in m["totals"].items():
        if per.get(c, (0, 0)) != (t["blocks"], t["tokens"]):
            bad.append(f"{c}: the requests' misses {per.get(c, (0, 0))}, the total "
                       f"{(t['blocks'], t['tokens'])}")
    rem, blocks = m["removals"]["reasons"], lc["summary"]["blocks"]
    if rem["finished"] + rem["preempted"] + rem["window"] != blocks["free"] or \
            rem["evicted"] + rem["reset"] != blocks["evict"]:
        bad.append(f"removal reasons {rem} for {blocks['free']:,} frees and "
                   f"{blocks['evict']:,} evictions")
    if m["regret"]["blocks"] != m["totals"]["capacity"]["blocks"]:
        bad.append(f"regret {m['regret']['blocks']:,} blocks, capacity misses "
                   f"{m['totals']['capacity']['blocks']:,}")
    mrc = lc.get("miss_ratio_curve")
    if mrc and m.get("optimal_curve"):
        low = [c for (c, lru), (_, opt) in zip(mrc["curve"], m["optimal_curve"])
               if opt < lru - 1e-12]
        if low:
            bad.append(f"the optimal cache hits less than LRU at {low} blocks")
    n = sum(t["blocks"] for t in m["totals"].values())
    return not bad, "; ".join(bad) or (
        f"{n:,} missed blocks in {len(m['requests']):,} requests add up; every removal "
        "has a reason; optimal never below LRU")


def derived_equals_counted(doc):
    """Where a recording has both step_rows and block_table for a group
    (--verify-rows), the reads derived from row events equal the counted
    ones: every step's rows (seq_len and the blocks read), its figures,
    and the reads per block (docs/design.md, "Reads derived from row
    events")."""
    checked = [d for d in doc.get("derived_reads") or [] if d.get("verified")]
    if not checked:
        return None
    bad = []
    for d in checked:
        v = d["verified"]
        where = f"pid {d['pid']} group {d['group_id']}"
        if not d["exact"]:
            bad.append(f"{where}: the replay is not exact ({d['mismatches']} rows that did not "
                       f"continue it, {d['incomplete_steps']} steps lost, {d['lost_frees']} "
                       "frees lost)")
        if v["unmatched"] or not v["steps"]:
            bad.append(f"{where}: {v['unmatched']} of {v['unmatched'] + v['steps']} tables "
                       "with no step_rows op to compare")
        if v["steps_differ"] or v["rows_differ"] or v["blocks_differ"]:
            bad.append(f"{where}: {v['steps_differ']} steps, {v['rows_differ']} rows and "
                       f"{v['blocks_differ']} blocks differ; first: {v['first']}")
    return not bad, "; ".join(bad) or (
        f"{sum(d['verified']['steps'] for d in checked):,} steps and "
        f"{sum(d['verified']['rows'] for d in checked):,} rows derived as counted")


CHECKS = (panel_headers_agree, hottest_coldest_disjoint, working_set_within_cache,
          shares_within_0_1, layers_whole, process_names, lifecycle_per_process,
          request_sums, residency_counts, miss_ratio_curve, miss_causes,
          derived_equals_counted)


def check(doc) -> list:
    """[(name, ok, detail)] of every check that applies to doc."""
    out = []
    for c in CHECKS:
        try:
            r = c(doc)
        except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as e:
            r = False, f"the document lacks what it needs ({type(e).__name__}: {e})"
        if r is not None:
            out.append((c.__name__, r[0], r[1]))
    return out


def failures(doc) -> list:
    return [(n, d) for n, ok, d in check(doc) if not ok]
