"""The KV-event audit (docs/kv-events.md): vLLM's own KV event stream
(BlockStored, BlockRemoved, AllBlocksCleared) against what its scheduler
did, as the plugin tier's block_cache and block_evict probes saw it.

vLLM's events carry content hashes, not block ids, so the two are matched
as sequences of (kind, KV-cache group, hash): the scheduler's cache and
evict events in the order it took them, the stream's events in its order
(seq, then place in the batch).  A longest matching (difflib, no junk
heuristic) pairs them; what the scheduler did that the stream does not
say is missing, what the stream says that did not happen is extra.  An
unmatched scheduler event and an unmatched stream event of the same key at
most WINDOW stream items apart are paired as reordered, not counted twice.

Beside the matching, both sides are replayed:

- real: the physical copies of each (group, hash), block by block;
- believed: what an indexer that trusts the stream holds (llm-d and Dynamo
  keep one entry per hash: BlockStored adds it, BlockRemoved drops it).

and the findings are:

- removed_while_resident: a BlockRemoved (matched) after which another
  physical copy of the hash is still cached: an indexer drops a hash that
  still hits;
- reuse_as_new: a BlockStored of a hash already resident for which the
  scheduler cached no new copy (vLLM's kv_cache_report_mode="full" announces
  prefix-cache hits this way): an indexer cannot tell it from a new block;
- stored_again: a BlockStored of a new physical copy of a hash that has a
  copy already (two requests computed the same block): true, but the
  stream has no way to say it is a second copy, and the removal of either
  copy will read as the hash's removal;
- drift: after each matched event, the hashes believed resident that are
  not (ghost) and the resident ones not believed (unseen); the max and the
  final.

Pure logic on plain tuples: the command (commands/audit_kv_events.py) feeds
it from a trace file and a ZMQ subscription or capture.
"""

import difflib
from dataclasses import dataclass

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
LIMIT = 50  # findings listed per kind (all are counted)
# stream items apart at most for an unmatched pair of one key to count as
# reordered (one step's events, a few batches), not as missing and extra
WINDOW = 64


@dataclass(frozen=True)
class Truth:
    """One block of a scheduler event: kind STORED (block_cache) or REMOVED
    (block_evict), its group, 64-bit hash, block id, and the request's hash
    (0: in no request's name: a reset or a KV connector's invalid blocks)."""
    kind: str
    group: int
    hash: int
    block: int
    req: int = 0
    ts_ns: int = 0


@dataclass(frozen=True)
class Said:
    """One hash of one stream event: kind, group, hash, the batch's seq and
    the event's place in it (CLEARED has group and hash 0)."""
    kind: str
    group: int
    hash: int
    seq: int
    index: int
    ts: float = 0.0  # the batch's, wall clock (vLLM's time.time() at publishing)


def stream_items(batches, media=("GPU", None)) -> tuple:
    """(Said items in stream order, facts about the stream).  batches:
    objects with seq, events (kind, group, hashes, medium): trace.kv_events's.
    Batches are taken in seq order; a seq seen twice is kept once and
    counted; the seqs missing between the first and the last are listed."""
    facts = {"batches": 0, "events": 0, STORED: 0, REMOVED: 0, CLEARED: 0,
             "other_medium": 0, "seq_repeats": 0, "seq_gaps": []}
    items, seen = [], set()
    last = None
    for b in sorted(batches, key=lambda b: b.seq):
        if b.seq in seen:
            facts["seq_repeats"] += 1
            continue
        seen.add(b.seq)
        if last is not None and b.seq != last + 1:
            facts["seq_gaps"].append([last + 1, b.seq - 1])
        last = b.seq
        facts["batches"] += 1
        for i, e in enumerate(b.events):
            facts["events"] += 1
            if e.kind == CLEARED:
                facts[CLEARED] += 1
                items.append(Said(CLEARED, 0, 0, b.seq, i, b.ts))
                continue
            if e.medium not in media:
                facts["other_medium"] += 1
                continue
            facts[e.kind] += len(e.hashes)
            items.extend(Said(e.kind, e.group, h, b.seq, i, b.ts) for h in e.hashes)
    return items, facts


class _State:
    """real copies and believed hashes, with the drift kept as they change."""

    def __init__(self):
        self.real = {}       # (group, hash) -> set of block ids
        self.believed = set()
        self.ghost = 0       # believed, not resident
        self.unseen = 0      # resident, not believed

    def _before(self, key):
        return bool(self.real.get(key)), key in self.believed

    def _after(self, key, was):
        r0, b0 = was
        r1, b1 = bool(self.real.get(key)), key in self.believed
        self.ghost += (b1 and not r1) - (b0 and not r0)
        self.unseen += (r1 and not b1) - (r0 and not b0)

    def truth(self, t: Truth):
        key = (t.group, t.hash)
        was = self._before(key)
        if t.kind == STORED:
            self.real.setdefault(key, set()).add(t.block)
        else:
            self.real.get(key, set()).discard(t.block)
        self._after(key, was)

    def said(self, s: Said):
        if s.kind == CLEARED:
            self.believed.clear()
            self.ghost = 0
            self.unseen = sum(1 for v in self.real.values() if v)
            return
        key = (s.group, s.hash)
        was = self._before(key)
        if s.kind == STORED:
            self.believed.add(key)
        else:
            self.believed.discard(key)
        self._after(key, was)


def _hex(h: int) -> str:
    return f"{h:016x}"


def audit(truth: list, said: list, facts: dict = None, limit: int = LIMIT,
          window: int = WINDOW, trace_end_ns: int = None) -> dict:
    """The audit of the stream `said` (Said items, stream order) against
    `truth` (Truth items, the scheduler's order).  trace_end_ns: when the
    recording ended (its clock, the truth's).  A dict (docs/kv-events.md)."""
    tk = [(t.kind, t.group, t.hash) for t in truth]
    sk = [(s.kind, s.group, s.hash) for s in said]
    pair = {}  # truth index -> stream index
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, tk, sk,
                                                        autojunk=False).get_opcodes():
        if tag == "equal":
            pair.update(zip(range(i1, i2), range(j1, j2)))
    used = set(pair.values())
    # where each unmatched scheduler event belongs in the stream: after the
    # stream item of the last matched event before it
    expect, last = [0] * len(truth), -1
    for i in range(len(truth)):
        if i in pair:
            last = pair[i]
        expect[i] = last + 1
    # Not judged: what comes before the first match (the tracer attaching,
    # the subscription starting), a scheduler event after the last batch
    # the auditor received (not yet published), and a stream event
    # published after the recording ended.  The clocks are tied by the
    # matched pairs: a batch is published after its events, so the wall
    # clock less the trace's is at most the least of (batch's ts - event's
    # ts_ns) over them (within a step's publishing delay).
    lo_t = min(pair) if pair else None
    lo_s = min(used) if used else None
    offset = min((said[j].ts * 1e9 - truth[i].ts_ns for i, j in pair.items()), default=None)
    last_ts = max((s.ts for s in said), default=None)

    def late_truth(t):
        return offset is not None and t.ts_ns + offset > last_ts * 1e9

    def late_said(s):
        return offset is not None and trace_end_ns is not None and \
            s.ts * 1e9 - offset > trace_end_ns
    # reordered: an unmatched scheduler event and an unmatched stream event
    # of the same key, at most `window` stream items apart
    free = {}
    for j, k in enumerate(sk):
        if j not in used:
            free.setdefault(k, []).append(j)
    reordered = 0
    for i in range(len(truth)):
        if i in pair:
            continue
        cands = [j for j in free.get(tk[i], ()) if abs(j - expect[i]) <= window]
        if cands:
            j = min(cands, key=lambda j: abs(j - expect[i]))
            free[tk[i]].remove(j)
            pair[i] = j
            used.add(j)
            reordered += 1
    cleared_at = [j for j, s in enumerate(said) if s.kind == CLEARED]

    # one timeline: a matched pair at its stream place, an unmatched stream
    # event at its place, an unmatched scheduler event just before the
    # stream item it should have been
    actions = [(j, 1, "said", j) for j in range(len(said)) if j not in used]
    actions += [(pair[i], 1, "pair", i) if i in pair else (expect[i], 0, "truth", i)
                for i in range(len(truth))]
    actions.sort()

    st = _State()
    out = {"matched": {STORED: 0, REMOVED: 0, CLEARED: 0}, "reordered": reordered,
           "truth": {"cached": sum(t.kind == STORED for t in truth),
                     "evicted": sum(t.kind == REMOVED for t in truth)},
           "stream": facts or {},
           "missing": [], "extra": [], "removed_while_resident": [], "reuse_as_new": [],
           "stored_again": [], "cleared_evictions": 0,
           "edge": {"truth": 0, "stream": 0}}
    counts = {k: 0 for k in ("missing", "extra", "removed_while_resident", "reuse_as_new",
                             "stored_again")}
    drift = {"ghost": 0, "unseen": 0, "ghost_at_seq": None, "unseen_at_seq": None}

    def note(kind, doc):
        counts[kind] += 1
        if len(out[kind]) < limit:
            out[kind].append(doc)

    def seq_near(j):  # the batch of stream item j (or the last one)
        return said[min(j, len(said) - 1)].seq if said else None

    for _, _, what, x in actions:
        if what == "pair":
            t, s = truth[x], said[pair[x]]
            key = (t.group, t.hash)
            others = sorted(st.real.get(key, set()) - {t.block})
            if t.kind == STORED and others:
                note("stored_again", {"group": t.group, "hash": _hex(t.hash), "seq": s.seq,
                                      "block": t.block, "also_in": others})
            st.truth(t)
            st.said(s)
            if t.kind == REMOVED and st.real.get(key):
                note("removed_while_resident",
                     {"group": t.group, "hash": _hex(t.hash), "seq": s.seq,
                      "block": t.block, "still_in": sorted(st.real[key])})
            out["matched"][t.kind] += 1
            for k in ("ghost", "unseen"):
                if getattr(st, k) > drift[k]:
                    drift[k], drift[f"{k}_at_seq"] = getattr(st, k), s.seq
        elif what == "truth":
            t = truth[x]
            st.truth(t)
            if lo_t is None or x < lo_t or late_truth(t):
                out["edge"]["truth"] += 1
            elif t.kind == REMOVED and t.req == 0 and any(
                    abs(j - expect[x]) <= window for j in cleared_at):
                out["cleared_evictions"] += 1
            else:
                note("missing", {"kind": t.kind, "group": t.group, "hash": _hex(t.hash),
                                 "block": t.block, "req": _hex(t.req),
                                 "near_seq": seq_near(expect[x])})
        else:
            s = said[x]
            if s.kind == CLEARED:
                out["matched"][CLEARED] += 1
            elif lo_s is None or x < lo_s or late_said(s):
                out["edge"]["stream"] += 1
            elif s.kind == STORED and st.real.get((s.group, s.hash)):
                note("reuse_as_new", {"group": s.group, "hash": _hex(s.hash), "seq": s.seq,
                                      "index": s.index,
                                      "resident_in": sorted(st.real[(s.group, s.hash)])})
            else:
                note("extra", {"kind": s.kind, "group": s.group, "hash": _hex(s.hash),
                               "seq": s.seq, "index": s.index})
            st.said(s)
    drift.update(final_ghost=st.ghost, final_unseen=st.unseen)
    out["drift"] = drift
    out["counts"] = counts
    gaps = (facts or {}).get("seq_gaps") or []
    out["clean"] = not (counts["missing"] or counts["extra"] or gaps
                        or counts["removed_while_resident"] or counts["reuse_as_new"])
    return out
