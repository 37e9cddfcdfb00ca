"""tracer/analysis/derived_rows.py against a plain reading of the same row
events: a scheduler simulated here emits step_rows rows (each request's
new entries only) and block events, and the test expands every row at every
step from the probe's definition (a request reads the entries j <
ceil(seq_len / block_size) of its row, 0 never) to count what the derived
figures must equal.  Fakes of StepRows and RowEvents: pure logic."""

import random

import numpy as np
import pytest

from tracer.analysis import access_stream, derived_rows, invariants
from tracer.trace import stream

PID, GROUP = 11, 0


class Sim:
    """A small scheduler: requests with rows of block ids, a pool with
    reference counts (prefix hits share blocks), chunked prefill,
    lookahead blocks beyond seq_len, sliding-window nulls, preemption,
    finishing, requests left out of a step, and (shrink) seq_len going
    back a few tokens within a row's life, as rejected draft tokens do.  It records step_rows ops and
    block events in one op order, as the plugin fires them."""

    def __init__(self, rng, bs, nblocks=64, window=None, shrink=False):
        self.rng, self.bs, self.window, self.shrink = rng, bs, window, shrink
        self.free = list(range(1, nblocks))
        self.ref = {}
        self.rows = {}  # req -> row (block ids, 0 nulled)
        self.reported = {}  # req -> the row length its last step_rows gave
        self.computed = {}  # req -> tokens computed
        self.prompt = {}
        self.ops = []  # ("rows", [(req, seq, new, row_len, tail_from, tail)]) | ("free", req, [b]) | ("reset", req)
        self.next_req = 1

    def alloc(self):
        if not self.free:
            return None
        b = self.free.pop(self.rng.randrange(len(self.free)))
        self.ref[b] = 1
        return b

    def release(self, req, blocks):
        blocks = [b for b in blocks if b > 0]
        if not blocks:
            return
        self.ops.append(("free", req, blocks))
        for b in blocks:
            self.ref[b] -= 1
            if not self.ref[b]:
                del self.ref[b]
                self.free.append(b)

    def end(self, req):
        self.ops.append(("reset", req))
        self.release(req, self.rows.pop(req)[::-1])
        self.reported.pop(req, None)

    def step(self):
        rng, bs = self.rng, self.bs
        if rng.random() < 0.5 and len(self.rows) < 6:
            req = self.next_req * 0x9E3779B97F4A7C15 % (1 << 64)
            self.next_req += 1
            self.prompt[req] = rng.randrange(1, 6 * bs)
            self.computed[req] = 0
            row = []
            # a prefix hit: the full blocks of a running request's row
            donors = [r for r in self.rows if self.computed[r] >= bs]
            if donors and rng.random() < 0.5:
                d = rng.choice(donors)
                full = min(self.computed[d] // bs, self.prompt[req] // bs)
                shared = [b for b in self.rows[d][:full] if b > 0]
                if len(shared) == full and full:
                    for b in shared:
                        self.ref[b] += 1
                    row = list(shared)
                    self.computed[req] = full * bs
            self.rows[req] = row
        sched = []
        for req in list(self.rows):
            if rng.random() < 0.15:
                continue  # left out of this step
            row = self.rows[req]
            c = self.computed[req]
            if self.shrink and c > bs and rng.random() < 0.2:
                c -= rng.randrange(1, bs + 1)  # tokens given back (a rejected draft)
            new = min(self.prompt[req] - c, rng.choice([3, 5, 2 * bs])) if c < self.prompt[req] \
                else 1
            seq = c + new
            want = -(-seq // bs) + (1 if rng.random() < 0.2 else 0)  # lookahead
            ok = True
            while len(row) < want:
                b = self.alloc()
                if b is None:
                    ok = False
                    break
                row.append(b)
            if not ok:  # preempted: the row ends, computed tokens lost
                self.end(req)
                self.rows[req] = []
                self.computed[req] = 0
                continue
            if self.window and c > self.window * bs:
                drop = [j for j in range((c - self.window * bs) // bs) if row[j] > 0]
                if drop:
                    self.release(req, [row[j] for j in drop])
                    for j in drop:
                        row[j] = 0
            sched.append((req, seq, new))
        recs = []
        for req, seq, new in sched:
            row = self.rows[req]
            t = self.reported.get(req, 0)
            recs.append((req, seq, new, len(row), t, list(row[t:])))
            self.reported[req] = len(row)
            self.computed[req] = seq
        self.ops.append(("rows", recs))
        for req, seq, new in sched:
            if seq >= self.prompt[req] + rng.randrange(2, 12):
                self.end(req)
                del self.computed[req]


def fakes(ops, bs, nblocks=64):
    """(StepRows, RowEvents) of a Sim's ops: op i is at position 2i (2i + 1
    is left for the verify mode's tables)."""
    pos, lo, req, seq, new, rl, tf, tail_lo, tail = [], [0], [], [], [], [], [], [0], []
    fp, fr, fb, rp, rr = [], [], [], [], []
    for i, op in enumerate(ops):
        i *= 2
        if op[0] == "rows":
            pos.append(i)
            for r, s, n, l, t, tl in op[1]:
                req.append(r), seq.append(s), new.append(n), rl.append(l), tf.append(t)
                tail += tl
                tail_lo.append(len(tail))
            lo.append(len(req))
        elif op[0] == "lost":
            continue
        elif op[0] == "free":
            fp += [i] * len(op[2])
            fr += [op[1]] * len(op[2])
            fb += op[2]
        else:
            rp.append(i), rr.append(op[1])
    K = len(pos)
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    sr = stream.StepRows(
        pos=i64(pos), pid=np.full(K, PID, np.uint32), ts_ns=(i64(pos) * 1000 + 5).astype(np.uint64),
        group=np.full(K, GROUP, np.int64), block_size=np.full(K, bs, np.int64),
        num_blocks=np.full(K, nblocks, np.int64), complete=np.ones(K, bool), lo=i64(lo),
        req=np.array(req, np.uint64), seq_len=i64(seq), new_tokens=i64(new), row_len=i64(rl),
        tail_from=i64(tf), tail_lo=i64(tail_lo), tail=np.array(tail, np.int32))
    ev = derived_rows.RowEvents(i64(fp), np.full(len(fp), PID, np.int64),
                                np.array(fr, np.uint64), np.full(len(fp), GROUP, np.int64),
                                i64(fb), i64(rp), np.full(len(rp), PID, np.int64),
                                np.array(rr, np.uint64))
    return sr, ev


def plain(ops, bs):
    """Every row at every step, expanded, from the probe's definition."""
    rows, steps, mismatches = {}, [], 0
    for op in ops:
        if op[0] == "lost":
            continue
        if op[0] == "free":
            row = rows.get(op[1])
            if row is not None:
                for b in op[2]:
                    rows[op[1]] = row = [0 if e == b else e for e in row]
        elif op[0] == "reset":
            rows.pop(op[1], None)
        else:
            step = []
            for req, seq, new, row_len, tail_from, tail in op[1]:
                cur = rows.get(req, [])
                if (tail_from != len(cur) and tail_from) or len(tail) != row_len - tail_from:
                    mismatches += 1  # (a row sent from 0 is whole: no mismatch)
                cur = cur[:tail_from] + [-1] * (tail_from - len(cur)) + list(tail)
                rows[req] = cur
                n = -(-seq // bs)
                read = [(j, cur[j], bs if j != n - 1 else seq - (n - 1) * bs)
                        for j in range(min(n, len(cur))) if cur[j] > 0]
                step.append((seq, read, [cur[j] if j < len(cur) and cur[j] > 0 else 0
                                         for j in range(n)]))
            steps.append(step)
    return steps, mismatches


def plain_figures(steps, bs):
    out = {"reads": [], "distinct": [], "held": [], "tokens": [], "rows": []}
    per_block, last, sharing = {}, {}, {}
    step_of, block_of = [], []
    for k, step in enumerate(steps):
        fill, count = {}, {}
        for seq, read, _ in step:
            for j, b, f in read:
                fill.setdefault(b, f)  # the first row that reads it
                count[b] = count.get(b, 0) + 1
                per_block[b] = per_block.get(b, 0) + 1
                last[b] = k + 1
                step_of.append(k)
                block_of.append(b)
        for b, c in count.items():
            sharing[b] = max(sharing.get(b, 0), c)
        out["reads"].append(sum(count.values()))
        out["distinct"].append(len(count))
        out["held"].append(sum(fill.values()))
        out["tokens"].append(sum(s for s, _, _ in step))
        out["rows"].append(len(step))
    return out, per_block, last, sharing, np.array(step_of, np.int64), \
        np.array(block_of, np.int64)


def dense(d, n):
    a = np.zeros(n, np.int64)
    for k, v in d.items():
        a[k] = v
    return a


@pytest.mark.parametrize("seed", range(40))
def test_derived_figures_equal_every_row_expanded(seed):
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    sim = Sim(rng, bs, nblocks=rng.choice([12, 40, 200]), window=rng.choice([None, None, 2, 3]),
              shrink=seed % 4 == 3)
    for _ in range(rng.randrange(5, 60)):
        sim.step()
    sr, ev = fakes(sim.ops, bs)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    steps, mismatches = plain(sim.ops, bs)
    fig, per_block, last, sharing, step_of, block_of = plain_figures(steps, bs)
    assert d.mismatches == mismatches == 0 and d.exact
    assert d.reads.tolist() == fig["reads"]
    assert d.distinct.tolist() == fig["distinct"]
    assert d.held_tokens.tolist() == fig["held"]
    assert d.tokens.tolist() == fig["tokens"]
    assert d.rows.tolist() == fig["rows"]
    nb = max(per_block, default=-1) + 1
    assert len(d.reads_per_block) == nb
    assert d.reads_per_block.astype(np.int64).tolist() == dense(per_block, nb).tolist()
    assert d.last_read_step.astype(np.int64).tolist() == dense(last, nb).tolist()
    assert d.sharing.tolist() == dense(sharing, nb).tolist()
    ts = d.ts_ns.astype(np.int64)
    want_ns = np.where(dense(last, nb) > 0, ts[np.maximum(dense(last, nb) - 1, 0)], 0)
    assert d.last_read_ns.tolist() == want_ns.tolist()
    # idle before reuse: generations at random blocks and times
    gb = np.array([rng.randrange(1, max(nb, 2)) for _ in range(30)], np.int64)
    gs = np.array([rng.randrange(0, int(ts.max()) + 2000) for _ in range(30)], np.int64)
    # (a generation starts in the latest step at or before its start: the
    # reads before it are those of the steps before that one)
    want = []
    for b, g in zip(gb.tolist(), gs.tolist()):
        k = max([i for i, t in enumerate(ts.tolist()) if t <= g], default=0)
        before = [s for s, x in zip(step_of.tolist(), block_of.tolist()) if x == b and s < k]
        if before:
            want.append(g - int(ts[max(before)]))
    assert d.idle_before_reuse(gb, gs).tolist() == want
    # every row as the replay holds it
    flat = [r for step in steps for r in step]
    seqs, first, entries = d.row_entries()
    assert len(seqs) == len(flat)
    for i, (pseq, _, pe) in enumerate(flat):
        assert seqs[i] == pseq
        assert entries[first[i]:first[i] + len(pe)].tolist() == pe


def test_a_shared_partial_block_is_filled_as_its_first_reader_sees_it():
    # two forks of one request share its last, partial block: the first
    # row in the step reads 3 tokens in it, the second 1 (it is behind)
    bs = 4
    ops = [("rows", [(1, 7, 7, 2, 0, [5, 6]), (2, 5, 5, 2, 0, [5, 6])])]
    sr, ev = fakes(ops, bs)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    assert d.distinct.tolist() == [2] and d.reads.tolist() == [4]
    assert d.held_tokens.tolist() == [4 + 3]
    assert d.sharing.tolist() == [0, 0, 0, 0, 0, 2, 2]
    ops = [("rows", [(2, 5, 5, 2, 0, [5, 6]), (1, 7, 7, 2, 0, [5, 6])])]
    d = derived_rows.replay(*fakes(ops, bs), PID, GROUP)
    assert d.held_tokens.tolist() == [4 + 1]


def test_a_row_that_does_not_continue_the_replay_is_counted():
    bs = 4
    ops = [("rows", [(1, 4, 4, 1, 0, [3])]),
           ("rows", [(1, 9, 5, 3, 2, [8])]),  # the entry at 1 never came
           ("rows", [(1, 10, 1, 3, 3, [])])]
    d = derived_rows.replay(*fakes(ops, bs), PID, GROUP)
    assert d.mismatches == 1 and not d.exact
    assert "did not continue" in d.reasons[0]
    # what came is still read: block 3 at every step, 8 at the last two
    assert d.reads_per_block.astype(int).tolist()[3] == 3
    assert d.reads_per_block.astype(int).tolist()[8] == 2


@pytest.mark.parametrize("seed", range(8))
def test_a_lost_step_rows_op_shows_as_mismatches(seed):
    # a step's rows lost: a request whose tail came in it continues from a
    # length the replay never held, which it counts, and says inexact
    rng = random.Random(1000 + seed)
    sim = Sim(rng, 4, nblocks=16)
    for _ in range(60):
        sim.step()
    ops = sim.ops

    def continued(i):  # a row of op i that gained entries, reported on from there
        for rec in ops[i][1]:
            if not rec[5]:
                continue
            for o in ops[i + 1:]:
                if o[0] == "reset" and o[1] == rec[0]:
                    break
                if o[0] == "rows":
                    nxt = [r for r in o[1] if r[0] == rec[0]]
                    if nxt:
                        if nxt[0][4] > 0:
                            return True
                        break
        return False

    lost = [i for i, op in enumerate(ops) if op[0] == "rows" and continued(i)]
    assert lost  # (the seeds are fixed: each has such a step)
    broken = [op if i != lost[0] else ("lost",) for i, op in enumerate(ops)]
    d = derived_rows.replay(*fakes(broken, 4), PID, GROUP)
    assert d.mismatches >= 1 and not d.exact
    assert d.mismatches == plain(broken, 4)[1]
    live = derived_rows.LiveRows()
    live.add_rows(*fakes(broken, 4))
    assert live.snapshot()[0]["mismatches"] == d.mismatches


def test_a_row_sent_again_from_0_is_a_fresh_start():
    # (kvsim's swap-in: the row's blocks moved, no reset seen)
    ops = [("rows", [(1, 8, 8, 2, 0, [3, 4])]),
           ("rows", [(1, 9, 1, 3, 2, [5])]),
           ("rows", [(1, 10, 1, 3, 0, [6, 7, 8])])]
    d = derived_rows.replay(*fakes(ops, 4), PID, GROUP)
    assert d.exact and d.mismatches == 0
    rpb = d.reads_per_block.astype(int).tolist()
    assert rpb[3:9] == [2, 2, 1, 1, 1, 1]


def counted(steps, bs, sr, after=True):
    """What the verify mode's block_table gives for the same steps, built
    from the plain expansion: the steps' op-record figures, and their rows
    (seq_len, then the entries read, 0 for a null), each table just after
    its step_rows op (after) or just before it."""
    fig, per_block, last, sharing, _, _ = plain_figures(steps, bs)
    K = len(steps)
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    st = access_stream.Steps(PID, GROUP, bs, sr.ts_ns.astype(np.int64) + 1, i64(fig["rows"]),
                             i64(fig["reads"]), i64(fig["distinct"]), i64(fig["tokens"]),
                             i64(fig["held"]), np.ones(K, bool), sr.pos + (1 if after else -1))
    flat = [r for step in steps for r in step]
    length = i64([len(e) for _, _, e in flat])
    rows = access_stream.Rows(st, np.r_[0, np.cumsum(fig["rows"])].astype(np.int64),
                              i64([s for s, _, _ in flat]), np.cumsum(length) - length, length,
                              i64([b for _, _, e in flat for b in e]))
    nb = max(per_block, default=-1) + 1
    scan = access_stream.ReadScan(dense(per_block, nb).astype(np.uint64), None, None, None, 0,
                                  np.zeros(0, np.int64))
    return st, rows, scan


def sim_ops(seed, steps=40):
    rng = random.Random(seed)
    sim = Sim(rng, 4, nblocks=30, window=rng.choice([None, 2]))
    for _ in range(steps):
        sim.step()
    return sim.ops


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("after", [True, False])
def test_verify_finds_derived_equal_to_counted(seed, after):
    ops = sim_ops(seed)
    sr, ev = fakes(ops, 4)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    st, rows, scan = counted(plain(ops, 4)[0], 4, sr, after)
    v = derived_rows.verify(d, sr.pos, st, rows, scan)
    assert v["steps"] == len(st) and v["rows"] == int(st.rows.sum()) > 0
    assert (v["steps_differ"], v["rows_differ"], v["blocks_differ"], v["unmatched"]) == \
        (0, 0, 0, 0), v["first"]
    doc = {"derived_reads": [{"pid": PID, "group_id": GROUP, "used": False, "steps": len(d),
                              "exact": True, "mismatches": 0, "incomplete_steps": 0,
                              "lost_frees": 0, "verified": v}]}
    assert invariants.derived_equals_counted(doc)[0]


@pytest.mark.parametrize("seed", range(6))
def test_verify_catches_a_free_the_replay_missed(seed):
    # sliding-window frees lost (and not counted as lost): the replay reads
    # blocks the table has nulled, and the check says so
    rng = random.Random(seed)
    sim = Sim(rng, 4, nblocks=30, window=2)
    for _ in range(60):
        sim.step()
    ops = sim.ops
    frees = [i for i, op in enumerate(ops) if op[0] == "free" and ops[i - 1][0] != "reset"]
    assert frees
    st, rows, scan = counted(plain(ops, 4)[0], 4, fakes(ops, 4)[0])
    broken = [op if i not in frees else ("lost",) for i, op in enumerate(ops)]
    sr, ev = fakes(broken, 4)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    v = derived_rows.verify(d, sr.pos, st, rows, scan)
    doc = {"derived_reads": [{"pid": PID, "group_id": GROUP, "used": False, "steps": len(d),
                              "exact": d.exact, "mismatches": d.mismatches,
                              "incomplete_steps": 0, "lost_frees": 0, "verified": v}]}
    ok, detail = invariants.derived_equals_counted(doc)
    assert not ok and "differ" in detail, detail


def test_verify_of_a_table_whose_step_rows_was_lost():
    ops = sim_ops(1, 10)
    sr, ev = fakes(ops, 4)
    st, rows, scan = counted(plain(ops, 4)[0], 4, sr)
    lost = [i for i, op in enumerate(ops) if op[0] == "rows"][3]
    sr, ev = fakes([op if i != lost else ("lost",) for i, op in enumerate(ops)], 4)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    v = derived_rows.verify(d, sr.pos, st, rows, scan)
    assert v["unmatched"] >= 1 and v["steps"] + v["unmatched"] == len(st)


def plain_request_access(ops, bs, ts):
    """Per (request, block): [reads, first read, last read, tokens written,
    first write, last write] (times: the step's), every row expanded."""
    rows, out, k = {}, {}, -1
    for op in ops:
        if op[0] == "free":
            if op[1] in rows:
                rows[op[1]] = [0 if e in op[2] else e for e in rows[op[1]]]
        elif op[0] == "reset":
            rows.pop(op[1], None)
        elif op[0] == "rows":
            k += 1
            for req, seq, new, row_len, tail_from, tail in op[1]:
                cur = rows.get(req, [])
                cur = cur[:tail_from] + [-1] * (tail_from - len(cur)) + list(tail)
                rows[req] = cur
                n = -(-seq // bs)
                for j in range(min(n, len(cur))):
                    if cur[j] > 0:
                        f = out.setdefault((req, cur[j]), [0, None, None, 0, None, None])
                        f[0] += 1
                        f[1] = ts[k] if f[1] is None else f[1]
                        f[2] = ts[k]
                lo = max(seq - new, 0)
                for p in range(lo // bs, min((seq - 1) // bs, n - 1) + 1):
                    if new > 0 and p < len(cur) and cur[p] > 0:
                        f = out.setdefault((req, cur[p]), [0, None, None, 0, None, None])
                        f[3] += min(seq, (p + 1) * bs) - max(lo, p * bs)
                        f[4] = ts[k] if f[4] is None else f[4]
                        f[5] = ts[k]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_request_access_of_a_derived_group(seed):
    from tracer.analysis import access_requests
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    sim = Sim(rng, bs, nblocks=40, window=rng.choice([None, 2]))
    for _ in range(40):
        sim.step()
    sr, ev = fakes(sim.ops, bs)
    d = derived_rows.replay(sr, ev, PID, GROUP)
    z = np.zeros(0, np.int64)
    none = access_requests.StepRequests(z, z, np.zeros(1, np.int64), np.zeros(0, np.uint64), z,
                                        np.zeros(0, np.uint64), z)
    ops = stream.OpStream(np.zeros(0, stream.OP_TABLE), z)
    got, stats = access_requests.request_access(ops, [derived_rows.DerivedRows(d)], 0, sr=none)
    # (the columns' seconds are rounded to the microsecond)
    us = [round(t / 1000) for t in d.ts_ns.astype(np.int64).tolist()]
    want = plain_request_access(sim.ops, bs, us)
    flat = {}
    sec = lambda v: None if np.isnan(v) else round(v * 1e6)  # noqa: E731
    for req, fig in got.items():
        b = fig["blocks"]
        for i in range(len(b["block"])):
            flat[(req, int(b["block"][i]))] = [
                int(b["reads"][i]), sec(b["first_read_s"][i]), sec(b["last_read_s"][i]),
                int(b["tokens_written"][i]), sec(b["first_write_s"][i]),
                sec(b["last_write_s"][i])]
        assert fig["block_reads"] == sum(v[0] for k, v in want.items() if k[0] == req)
    assert flat == want
    scheduled = {}
    for op in sim.ops:
        if op[0] == "rows":
            for r in op[1]:
                s = scheduled.setdefault(r[0], [0, 0])
                s[0] += 1
                s[1] += r[2]
    assert {r: [f["steps"], f["tokens_written"]] for r, f in got.items()} == scheduled
    assert stats["steps"] == len(d)


@pytest.mark.parametrize("seed", range(8))
def test_prefix_reuse_of_a_derived_group(seed):
    # a request's first row: the blocks it holds below seq_len - new tokens
    rng = random.Random(seed)
    sim = Sim(rng, 4, nblocks=60)
    for _ in range(40):
        sim.step()
    d = derived_rows.replay(*fakes(sim.ops, 4), PID, GROUP)
    rows, seen, per_block = {}, set(), {}
    for op in sim.ops:
        if op[0] == "reset":
            rows.pop(op[1], None)
        elif op[0] == "free":
            if op[1] in rows:
                rows[op[1]] = [0 if e in op[2] else e for e in rows[op[1]]]
        elif op[0] == "rows":
            for req, seq, new, _, tail_from, tail in op[1]:
                cur = rows.get(req, [])[:tail_from] + list(tail)
                rows[req] = cur
                if req in seen:
                    continue
                seen.add(req)
                for b in cur[:min(max(seq - new, 0) // 4, -(-seq // 4))]:
                    if b > 0:
                        per_block[b] = per_block.get(b, 0) + 1
    got = derived_rows.DerivedRows(d).prefix_reuse()
    assert got["requests"] == len(seen) and got["per_block"] == per_block
    assert got["blocks"] == sum(per_block.values()) > 0


@pytest.mark.parametrize("seed", range(30))
def test_live_rows_equal_the_replay(seed):
    # LiveRows, fed the same ops in batches, ends with the replay's figures
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    sim = Sim(rng, bs, nblocks=rng.choice([12, 40]), window=rng.choice([None, 2]),
              shrink=seed % 3 == 2)
    for _ in range(rng.randrange(5, 50)):
        sim.step()
    ops = sim.ops
    d = derived_rows.replay(*fakes(ops, bs), PID, GROUP)
    live = derived_rows.LiveRows()
    cut = sorted(rng.sample(range(len(ops) + 1), min(4, len(ops) + 1)))
    for a, b in zip([0] + cut, cut + [len(ops)]):
        batch = [op if a <= i < b else ("lost",) for i, op in enumerate(ops)]
        live.add_rows(*fakes(batch, bs))
    snap = live.snapshot()
    if not len(d):
        assert snap == []
        return
    g, = snap
    assert (g["steps"], g["requests"], g["tokens"], g["reads"], g["distinct"],
            g["held_tokens"]) == (len(d), int(d.rows.sum()), int(d.tokens.sum()),
                                  int(d.reads.sum()), int(d.distinct.sum()),
                                  int(d.held_tokens.sum()))
    nb = len(d.reads_per_block)
    assert g["reads_per_block"][:nb].tolist() == d.reads_per_block.tolist()
    assert not g["reads_per_block"][nb:].any()
    assert g["last_read_step"][:nb].tolist() == d.last_read_step.tolist()
    assert g["mismatches"] == 0


def test_live_groups_of_processes_the_kernel_counts_no_reads_of():
    rng = random.Random(3)
    sim = Sim(rng, 4, nblocks=30)
    for _ in range(20):
        sim.step()
    live = derived_rows.LiveRows()
    live.add_rows(*fakes(sim.ops, 4))
    counted = {"pid": PID + 1, "group_id": 5, "index": 0}
    raw = live.merge_into({"groups": [counted], "time": 1.0})
    assert raw["groups"][0] is counted and len(raw["groups"]) == 2
    g = raw["groups"][1]
    assert (g["pid"], g["group_id"]) == (PID, GROUP) and g["index"] > 16
    assert g["reads"] == int(g["reads_per_block"].sum()) > 0
    # a process whose reads the kernel counts (--verify-rows; kvsim's
    # table, named otherwise) keeps its counted reads
    for gid in (GROUP, 0xdead):
        counted = {"pid": PID, "group_id": gid, "index": 0}
        assert live.merge_into({"groups": [counted]})["groups"] == [counted]


def test_groups_pair_by_id_or_as_a_process_only_ones():
    d = derived_rows.replay(*fakes(sim_ops(2, 10), 4), PID, GROUP)
    n = len(d)
    # the same id (the plugin's block_table and step_rows)
    assert derived_rows.pair_groups([d], [(3, PID, GROUP, 4, n), (4, PID, 99, 4, n)]) == \
        {(PID, GROUP): 3}
    # the process's only ones, of one block size and as many steps (kvsim)
    assert derived_rows.pair_groups([d], [(5, PID, 0xdead, 4, n)]) == {(PID, GROUP): 5}
    assert derived_rows.pair_groups([d], [(5, PID, 0xdead, 8, n)]) == {}
    assert derived_rows.pair_groups([d], [(5, PID, 0xdead, 4, n + 1)]) == {}
    assert derived_rows.pair_groups([d], [(5, PID + 1, GROUP, 4, n)]) == {}
    assert derived_rows.pair_groups([d], [(5, PID, 7, 4, n), (6, PID, 8, 4, n)]) == {}
