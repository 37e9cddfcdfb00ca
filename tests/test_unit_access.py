"""tracer/analysis/access_*.py's pure functions, on hand-made reads (no tracer)."""

import numpy as np
import pytest

from tracer import abi
from tracer.analysis import access_requests, access_stream
from tracer.trace import stream


def test_idle_before_reuse_measures_from_the_last_read_strictly_before():
    # reads (step -> time): block 5 at 10 and 20, block 7 at 30, block 5 at 40
    step_of = np.array([0, 1, 2, 3])
    block = np.array([5, 5, 7, 5])
    ts_ns = np.array([10, 20, 30, 40])
    gen_block = np.array([5, 7, 5, 9, 7, 5])
    gen_start = np.array([25, 30, 5, 50, 31, 40])
    # (5, 25): read at 20; (7, 30): a read at the very start is not before
    # it; (5, 5): none yet; (9, 50): never read; (7, 31): 30; (5, 40): 20
    got = access_stream.idle_before_reuse(step_of, block, ts_ns, gen_block, gen_start)
    assert got.tolist() == [5, 1, 20]


def test_idle_before_reuse_without_reads_or_generations():
    empty = np.zeros(0, np.int64)
    assert access_stream.idle_before_reuse(empty, empty, empty, np.array([1]),
                                    np.array([3])).tolist() == []
    assert access_stream.idle_before_reuse(np.array([0]), np.array([1]), np.array([3]),
                                    empty, empty).tolist() == []


# -- the stream half, on hand-made op streams --------------------------------------

PID, GROUP, LEADER = 7, 100, 200
WRITE = abi.OPS["reshape_and_cache"]


def op_stream(records):
    """records: (op id, cache_id, values, complete) in seq order -> OpStream,
    with each op's values laid out in order (as stream.decode lays them)."""
    ops = np.zeros(len(records), stream.OP_TABLE)
    values, at = [], 0
    for i, (op, cache_id, vals, complete) in enumerate(records):
        ops[i]["seq"] = i + 1
        ops[i]["ts_ns"] = 1000 * (i + 1)
        ops[i]["pid"], ops[i]["op"], ops[i]["cache_id"] = PID, op, cache_id
        ops[i]["start"], ops[i]["stop"] = at, at + len(vals)
        ops[i]["complete"] = complete
        values += vals
        at += len(vals)
    return stream.OpStream(ops, np.array(values, np.int64))


def live_sets(values, bs):
    """The test's own reading of one block_table op: seq_len, then
    ceil(seq_len / bs) entries, row after row; a row cut short by the
    end keeps what it has."""
    rows, pos = [], 0
    while pos < len(values):
        seq = values[pos]
        n = max(-(-seq // bs), 0)
        rows.append((seq, list(values[pos + 1:pos + 1 + n])))
        pos += 1 + n
    return rows


def groups(bs):
    return [{"pid": PID, "group_id": GROUP, "block_size": bs, "leader": LEADER}]


def reuse_from_rows(ops, bs=4):
    """prefix_reuse of the one group's steps in ops, inferred from its rows
    and the leader layer's writes (no step_reqs)."""
    (st,) = access_stream.steps_of(ops, groups(bs))
    return access_requests.prefix_reuse(ops, access_stream.rows_of(ops, st), LEADER)


def test_rows_of_parses_every_row_as_a_plain_reading_does():
    rng = np.random.default_rng(5)
    bs = 4
    records, want = [], []
    for step in range(60):
        vals = []
        for _ in range(int(rng.integers(0, 6))):
            seq = int(rng.integers(0, 30))
            vals += [seq] + rng.integers(0, 50, -(-seq // bs)).tolist()
        if step % 7 == 3 and vals:
            vals = vals[:-1]  # a last row cut short
        complete = step % 11 != 5
        records.append((stream.TABLE_OP_ID, GROUP, vals, complete))
        want.append(live_sets(vals, bs) if complete else [])
    ops = op_stream(records)
    st = access_stream.steps_of(ops, groups(bs))[0]
    for layout in ("in order", "one op past the end", "reversed"):
        if layout == "one op past the end":
            # as a trace file's op that two batches split lies (stream.decode):
            # its place left holding other values, which must not be read
            k = next(i for i, (*_, v, c) in enumerate(records) if c and len(v) > 8 and i > 3)
            a, b = int(ops.ops["start"][k]), int(ops.ops["stop"][k])
            moved = ops.values.copy()
            moved[a:b] = 10**6  # neither a seq_len nor a block of this test's
            ops = stream.OpStream(ops.ops.copy(), np.concatenate([moved, ops.values[a:b]]))
            ops.ops["start"][k], ops.ops["stop"][k] = len(moved), len(moved) + b - a
        if layout == "reversed":  # no op's values in step order
            ops.ops["start"], ops.ops["stop"] = (ops.ops["start"][::-1].copy(),
                                                 ops.ops["stop"][::-1].copy())
            want = [live_sets(ops.values_of(i).tolist(), bs) if c else []
                    for i, (*_, c) in enumerate(records)]
        rows = access_stream.rows_of(ops, st)
        got = [[(int(rows.seq[r]), rows.entries[rows.start[r]:rows.start[r] + rows.length[r]]
                 .tolist()) for r in range(rows.row_lo[k], rows.row_lo[k + 1])]
               for k in range(len(st))]
        assert got == want
        flat = [(k, b) for k, rs in enumerate(want) for _, r in rs for b in r if b > 0]
        step_of, block = (np.array(c, np.int64).reshape(-1) for c in zip(*flat)) if flat \
            else (np.zeros(0, np.int64),) * 2
        # the one pass over the rows as they lie (nulls and blocks past
        # max_blocks found by place) equals scanning the plain reads
        gens = (np.arange(1, 50), 500 * np.arange(1, 50))
        for max_blocks in (40, 1000):
            got, plain = rows.scan(*gens, max_blocks=max_blocks), \
                access_stream.scan_reads(step_of, block, st.ts_ns, *gens, max_blocks=max_blocks)
            assert got.out_of_range == plain.out_of_range > (0 if max_blocks == 40 else -1)
            for field in ("reads_per_block", "last_read_step", "last_read_ns", "sharing", "idle"):
                assert getattr(got, field).tolist() == getattr(plain, field).tolist(), field


@pytest.mark.parametrize("times", ["in order", "out of order"])
def test_read_heatmap_from_runs_of_steps_equals_one_read_at_a_time(times, monkeypatch):
    """Report.read_runs sums a group's reads per block over each run of
    steps in one heatmap row (Rows.block_counts): the map it gives equals
    the map of every read on its own (the test's own reading of the
    tables), for whole, partial and empty time ranges, nulls and a block
    past max_blocks, steps out of time order, and reads counted a few
    values at a time."""
    from tracer.analysis.report import Report
    from tracer.analysis import heatmap
    rng = np.random.default_rng(21)
    bs, records = 4, []
    for step in range(70):
        vals = []
        for _ in range(int(rng.integers(0, 5))):
            seq = int(rng.integers(0, 25))
            vals += [seq] + rng.integers(-1, 60, -(-seq // bs)).tolist()
        if step == 33:
            vals += [4, 1 << 24]  # a garbage entry, past max_blocks
        records.append((stream.TABLE_OP_ID, GROUP, vals, True))
    ops = op_stream(records)
    if times == "out of order":
        ops.ops["ts_ns"] = ops.ops["ts_ns"] + 1000 * rng.integers(0, 11, len(records))
    (st,) = access_stream.steps_of(ops, groups(bs))
    rows = access_stream.rows_of(ops, st)
    rep = Report.__new__(Report)
    rep.t0, rep.steps, rep.rows, rep.scans = 0, [st], [rows], [rows.scan()]
    # every read on its own: (time since t0, block) of each positive entry
    # below max_blocks, from the test's own reading of each table
    at = ops.ops["ts_ns"].astype(np.int64) - rep.t0
    reads = [(at[k], b) for k, (_, vals, _) in enumerate((r[1], r[2], r[3]) for r in records)
             for _, entries in live_sets(vals, bs) for b in entries
             if 0 < b < access_stream.MAX_BLOCKS]
    t, b = (np.array(c, np.int64) for c in zip(*reads))
    for nrows, time_range in ((7, (0, int(at.max()) + 1)), (3, (20_000, 41_000)),
                              (5, (30_000, 30_000)), (4, (-10**6, 10**6))):  # [t, t): a step at t
        want = heatmap.compute(t, b, nrows, 9, time_range, (0, 59))
        for chunk in (access_stream._CHUNK_READS, 3):
            monkeypatch.setattr(access_stream, "_CHUNK_READS", chunk)
            got = heatmap.compute_chunks(rep.read_runs(nrows, time_range), nrows, 9,
                                         time_range, (0, 59))
            assert np.array_equal(got.cells, want.cells), (nrows, time_range, chunk)
    assert want.cells.sum() > 0


def test_scan_reads_per_block_figures():
    # step -> time: 0 -> 50, 1 -> 10, 2 -> 30 (the steps' times out of order)
    ts = np.array([50, 10, 30])
    step_of = np.array([0, 0, 0, 1, 1, 2, 2, 2, 0])
    block = np.array([4, 4, 6, 4, 9, 6, 6, 1 << 24, 4])
    sc = access_stream.scan_reads(step_of, block, ts, gen_block=[4, 6, 9], gen_start_ns=[40, 60, 5])
    assert sc.out_of_range == 1
    assert sc.reads_per_block.tolist() == [0, 0, 0, 0, 4, 0, 3, 0, 0, 1]
    assert sc.last_read_step.tolist() == [0, 0, 0, 0, 2, 0, 3, 0, 0, 2]
    assert sc.last_read_ns.tolist() == [0, 0, 0, 0, 50, 0, 50, 0, 0, 10]
    # block 4: three requests at step 0; block 6: two at step 2
    assert sc.sharing.tolist() == [0, 0, 0, 0, 3, 0, 2, 0, 0, 1]
    # (4, 40): last read before 40 is at 10; (6, 60): at 50; (9, 5): none
    assert sc.idle.tolist() == [30, 10]


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_scan_reads_in_time_order_a_few_values_at_a_time(chunk, monkeypatch):
    """Steps in time order: the scan casts and counts the reads a chunk of
    steps at a time (a step may straddle two chunks).  Its figures equal
    the test's own reading of every read, one at a time."""
    if chunk is not None:
        monkeypatch.setattr(access_stream, "_CHUNK_VALUES", chunk)
    rng = np.random.default_rng(7)
    ts = 10 * np.arange(1, 41)
    per_step = [rng.integers(1, 30, int(rng.integers(0, 9))).tolist() for _ in ts]
    per_step[3] = per_step[3] + per_step[3][:2]  # blocks read twice in one step
    step_of = np.array([k for k, bs in enumerate(per_step) for _ in bs], np.int64)
    block = np.array([b for bs in per_step for b in bs], np.int64)
    gen_block, gen_start = rng.integers(1, 30, 25), np.sort(rng.integers(0, 450, 25))
    gen_start[:3] = ts[[4, 4, 9]]  # a generation starting at a step's own time
    sc = access_stream.scan_reads(step_of, block, ts, gen_block, gen_start)
    reads, last, sharing = [0] * 30, [0] * 30, [0] * 30
    for k, bs in enumerate(per_step):
        for b in bs:
            reads[b] += 1
            last[b] = k + 1
            sharing[b] = max(sharing[b], bs.count(b))
    assert sc.reads_per_block.tolist() == reads[:len(sc.reads_per_block)]
    assert sc.last_read_step.tolist() == last[:len(sc.last_read_step)]
    assert sc.sharing.tolist() == sharing[:len(sc.sharing)]
    assert sc.last_read_ns.tolist() == [int(ts[s - 1]) if s else 0
                                        for s in last[:len(sc.last_read_ns)]]
    idle = []
    for b, g in zip(gen_block.tolist(), gen_start.tolist()):
        before = [int(ts[k]) for k, bs in enumerate(per_step) if b in bs and ts[k] < g]
        if before:
            idle.append(g - max(before))
    assert sc.idle.tolist() == idle and len(idle) > 5


def test_prefix_reuse_two_rows_wanting_one_earlier_row():
    # block size 4.  Step 1: request A, 5 tokens in blocks 1, 2 (writes
    # slots 4..8).  Step 2: B and C, both A's blocks and one more, each
    # writing its 9th token (slots 12 and 16).  B comes first and
    # continues A; C is a new request that found blocks 1 and 2 cached.
    ops = op_stream([
        (WRITE, LEADER, [4, 5, 6, 7, 8], True),
        (stream.TABLE_OP_ID, GROUP, [5, 1, 2], True),
        (WRITE, LEADER, [12, 16], True),
        (stream.TABLE_OP_ID, GROUP, [9, 1, 2, 3, 9, 1, 2, 4], True),
    ])
    got = reuse_from_rows(ops)
    assert got == {"requests": 2, "blocks": 2, "per_block": {1: 1, 2: 1},
                   "steps_without_writes": 0, "by": "rows"}


def test_prefix_reuse_a_new_request_on_a_finished_ones_blocks():
    # A (blocks 1, 2, 6 tokens) finishes; D gets the same blocks and writes
    # A's last token's slot (2 * 4 + 1 = 9) at its first step: D is new,
    # and block 2, written by D itself, is not reused; block 1 is.
    ops = op_stream([
        (WRITE, LEADER, [4, 5, 6, 7, 8, 9], True),
        (stream.TABLE_OP_ID, GROUP, [6, 1, 2], True),
        (WRITE, LEADER, [9, 10], True),
        (stream.TABLE_OP_ID, GROUP, [7, 1, 2], True),
        (stream.TABLE_OP_ID, GROUP, [8, 1, 2], True),  # no write before it
    ])
    got = reuse_from_rows(ops)
    assert got == {"requests": 2, "blocks": 1, "per_block": {1: 1},
                   "steps_without_writes": 1, "by": "rows"}


@pytest.mark.parametrize("layout", ["in order", "one op past the end"])
@pytest.mark.parametrize("wide, dtype", [
    (None, np.int16), (32766, np.int16), (-32768, np.int16), (32767, np.int32),
    (70000, np.int32), (-40000, np.int32), (2**31 - 2, np.int32), (2**31 - 1, np.int64),
    (2**40, np.int64), (-2**35, np.int64)])
def test_rows_of_keeps_every_entry_narrow_or_not(wide, dtype, layout, monkeypatch):
    """Entries are kept in the narrowest of int16 and int32 that every one
    fits below its highest value (so that the highest + 1 fits too), else as
    they came (int64): a garbage entry beyond an int32 is kept, not wrapped.
    The entry that does not fit comes late, after runs of ops already kept
    narrower (one op past the end: the ops lie in two runs, steps 0-5 and
    6-39, and the first is kept as int16 before step 17 needs more).
    Chunks of 7 values: every chunk edge falls somewhere in the rows."""
    monkeypatch.setattr(access_stream, "_CHUNK_VALUES", 7)
    rng = np.random.default_rng(9)
    bs, records, want = 4, [], []
    for step in range(40):
        vals = []
        for _ in range(int(rng.integers(1, 4))):
            seq = int(rng.integers(1, 30))
            vals += [seq] + rng.integers(0, 50, -(-seq // bs)).tolist()
        if wide is not None and step == 17:
            vals[-1] = wide
        records.append((stream.TABLE_OP_ID, GROUP, vals, True))
        want.append(live_sets(vals, bs))
    ops = op_stream(records)
    if layout == "one op past the end":  # step 5's op, as a split one lies
        a, b = int(ops.ops["start"][5]), int(ops.ops["stop"][5])
        ops = stream.OpStream(ops.ops.copy(), np.concatenate([ops.values, ops.values[a:b]]))
        ops.values[a:b] = 10**6  # not to be read
        ops.ops["start"][5], ops.ops["stop"][5] = len(ops.values) - (b - a), len(ops.values)
    st = access_stream.steps_of(ops, groups(bs))[0]
    rows = access_stream.rows_of(ops, st)
    assert rows.entries.dtype == dtype
    got = [[(int(rows.seq[r]), rows.entries[rows.start[r]:rows.start[r] + rows.length[r]]
             .tolist()) for r in range(rows.row_lo[k], rows.row_lo[k + 1])]
           for k in range(len(st))]
    assert got == want
    assert wide is None or wide in rows.entries.tolist()
    # the lowest and highest entry, found as they were copied (the read
    # scan's check that all are blocks in range), where narrowed
    every = [b for step in want for _, entries in step for b in entries]
    assert rows.bounds == ((min(every), max(every)) if dtype != np.int64 else None)


def step_reqs_and_tables(records, bs, ts_ns=None):
    """op_stream(records) with each step_reqs op's items (its rows: half its
    values), and the parsed tables of its one group; ts_ns: the ops' times
    (op_stream's own by default)."""
    ops = op_stream(records)
    if ts_ns is not None:
        ops.ops["ts_ns"] = ts_ns
    for i, (op, _, vals, _) in enumerate(records):
        if op == stream.STEP_REQS_OP_ID:
            ops.ops[i]["items"] = len(vals) // 2
    return ops, [access_stream.rows_of(ops, st) for st in access_stream.steps_of(ops, groups(bs))]


def columns(blocks: list) -> dict:
    """A request's per-block figures as the report gives them: a list per
    figure (docs/report-json.md), from a dict per block."""
    return {k: [b[k] for b in blocks] for k in (
        "group", "block", "tokens_written", "first_write_s", "last_write_s", "reads",
        "first_read_s", "last_read_s")}


def plain(got: dict) -> dict:
    """request_access' figures with each column, an array, as a list (a
    missing time, NaN, as None: the JSON's null).  Each must be an array
    the JSON writer takes as it is: C-contiguous, int64 or float64."""
    out = {}
    for r, fig in got.items():
        cols = {}
        for k, v in fig["blocks"].items():
            assert isinstance(v, np.ndarray) and v.flags.c_contiguous, (r, k)
            assert v.dtype == (np.float64 if k.endswith("_s") else np.int64), (r, k, v.dtype)
            cols[k] = [None if x != x else x for x in v.tolist()]  # NaN != NaN
        out[r] = {**fig, "blocks": cols}
    return out


def test_request_access_worked_by_hand():
    """step_reqs names each table row; each row writes [seq - new, seq).
    Block size 4; requests A and B; the third table has no step_reqs of its
    own (its record lost) and the fourth's names too few rows: neither is
    given to anyone."""
    bs, A, B = 4, 0xA1, 0xB2
    SR = stream.STEP_REQS_OP_ID
    records = [
        (SR, 0, [A, B, 6, 5], True),                   # step 1: A 6 new, B 5 new
        (stream.TABLE_OP_ID, GROUP, [6, 3, 4, 5, 7, 8], True),
        (SR, 0, [B, A, 1, 1], True),                   # step 2: rows swapped
        (stream.TABLE_OP_ID, GROUP, [6, 7, 8, 7, 3, 4], True),
        (stream.TABLE_OP_ID, GROUP, [8, 3, 4], True),  # step 3: unnamed
        (SR, 0, [A, 1], True),                         # step 4: 1 name, 2 rows
        (stream.TABLE_OP_ID, GROUP, [9, 3, 4, 0, 7, 8], True),
    ]
    ops, rows = step_reqs_and_tables(records, bs)
    got, stats = access_requests.request_access(ops, rows, t0_ns=0)
    got = plain(got)
    assert stats == {"steps": 2, "unmatched": 2}
    t1, t2 = 2e-6, 4e-6  # the tables' times (ts 1000 * (i + 1) ns)

    def blk(b, w, fw, lw, n, fr, lr):
        return {"group": GROUP, "block": b, "tokens_written": w, "first_write_s": fw,
                "last_write_s": lw, "reads": n, "first_read_s": fr, "last_read_s": lr}

    # A: step 1 writes tokens 0-5 (block 3: 4, block 4: 2), step 2 token 6
    # (block 4); steps 3 and 4 are nobody's; step 4's A counts as a step
    assert got[A] == {"steps": 3, "tokens_written": 8, "block_reads": 4, "blocks": columns(
        [blk(3, 4, t1, t1, 2, t1, t2), blk(4, 3, t1, t2, 2, t1, t2)])}
    assert got[B] == {"steps": 2, "tokens_written": 6, "block_reads": 4, "blocks": columns(
        [blk(7, 4, t1, t1, 2, t1, t2), blk(8, 2, t1, t2, 2, t1, t2)])}


@pytest.mark.parametrize("chunk_reads", [None, 5])
@pytest.mark.parametrize("times", ["in order", "out of order"])
def test_request_access_against_a_plain_reading(times, chunk_reads, monkeypatch):
    """Random steps, read back row by row and token by token here: rows
    that grow, null entries, and places that change block (a preempted
    request given new blocks) must all come out as a plain reading of
    step_reqs and the tables gives them.  Out of order: the ops' clock
    readings need not rise with their sequence (two CPUs), so first and
    last times are the earliest and latest, not the first and last seen.
    chunk_reads 5: the reads taken a row or two at a time, as a large
    trace's are taken millions at a time."""
    if chunk_reads:
        monkeypatch.setattr(access_stream, "_CHUNK_READS", chunk_reads)
    rng = np.random.default_rng(11)
    bs, SR = 4, stream.STEP_REQS_OP_ID
    reqs = [0x1000 + i for i in range(9)]
    held = {r: [] for r in reqs}  # each request's blocks, place by place
    records = []
    for step in range(80):
        names = sorted(rng.choice(reqs, int(rng.integers(1, 6)), replace=False).tolist())
        rows, new = [], []
        for r in names:
            if rng.random() < 0.1:  # preempted: new blocks from scratch
                held[r] = []
            # block 0 is null: a place that never held a block
            held[r] += rng.integers(0, 40, int(rng.integers(0, 3))).tolist()
            b = list(held[r])
            if b and rng.random() < 0.2:
                b[int(rng.integers(0, len(b)))] = 0  # a block a window dropped
            seq = len(b) * bs - int(rng.integers(0, bs)) if b else 0
            rows.append((max(seq, 0), b))
            new.append(int(rng.integers(0, 2 * bs)))
        records.append((SR, 0, names + new, True))
        records.append((stream.TABLE_OP_ID, GROUP,
                        [v for seq, b in rows for v in [seq] + b], True))
    ts_ns = 1000 * np.arange(1, len(records) + 1)
    if times == "out of order":
        ts_ns += 1000 * rng.integers(-3, 4, len(ts_ns))  # whole us: the report rounds to 1 us
    ops, tables = step_reqs_and_tables(records, bs, ts_ns)
    got, stats = access_requests.request_access(ops, tables, t0_ns=0)
    got = plain(got)
    assert stats == {"steps": 80, "unmatched": 0}

    want = {}
    for i in range(0, len(records), 2):
        vals = records[i][2]
        n = len(vals) // 2
        ts = int(ts_ns[i + 1]) / 1e9  # the table's time
        table = live_sets(records[i + 1][2], bs)
        for r, new, (seq, entries) in zip(vals[:n], vals[n:], table):
            w = want.setdefault(r, {"steps": 0, "tokens_written": 0, "blocks": {}})
            w["steps"] += 1
            w["tokens_written"] += new

            def touch(b, kind, t=ts, w=w):
                f = w["blocks"].setdefault(b, {"w": 0, "fw": None, "lw": None,
                                                "r": 0, "fr": None, "lr": None})
                f[kind] += 1
                first, last = "f" + kind, "l" + kind
                f[first] = t if f[first] is None else min(f[first], t)
                f[last] = t if f[last] is None else max(f[last], t)
            for b in entries:
                if b > 0:
                    touch(b, "r")
            for token in range(max(seq - new, 0), seq):
                if new > 0 and token // bs < len(entries) and entries[token // bs] > 0:
                    touch(entries[token // bs], "w")
    assert set(got) == set(want)
    for r, w in want.items():
        blocks = sorted(w["blocks"].items(),
                        key=lambda kv: (min(t for t in (kv[1]["fw"], kv[1]["fr"]) if t), kv[0]))
        assert got[r] == {
            "steps": w["steps"], "tokens_written": w["tokens_written"],
            "block_reads": sum(f["r"] for _, f in blocks),
            "blocks": columns([{"group": GROUP, "block": b, "tokens_written": f["w"],
                                "first_write_s": f["fw"], "last_write_s": f["lw"],
                                "reads": f["r"], "first_read_s": f["fr"], "last_read_s": f["lr"]}
                               for b, f in blocks])}, r
    # a view that shows a few requests asks for those alone: the same figures
    few = sorted(want)[::3]
    part, part_stats = access_requests.request_access(ops, tables, t0_ns=0, only=few)
    assert plain(part) == {r: got[r] for r in few} and part_stats == stats


@pytest.mark.xfail(strict=True, reason=(
    "a limit of inferring requests from the table alone (docs/access.md, "
    "'Prefix reuse'): a finished request whose row, its last block full, is a "
    "prefix of a later row is taken to continue into it"))
def test_prefix_reuse_the_next_turn_of_a_finished_conversation():
    # block size 4.  A: a 7-token prefill into blocks 1, 2, then its last
    # step writes its 8th token (slot 11): both blocks full, A finishes.
    # B, the conversation's next turn, starts with A's 8 tokens, finds
    # blocks 1 and 2 in the cache and computes 3 more into block 3.  B is
    # a new request that reused 2 blocks; the table alone cannot tell it
    # from A taking a 3-token chunk (a continuing row writes exactly that).
    ops = op_stream([
        (WRITE, LEADER, [4, 5, 6, 7, 8, 9, 10], True),
        (stream.TABLE_OP_ID, GROUP, [7, 1, 2], True),
        (WRITE, LEADER, [11], True),
        (stream.TABLE_OP_ID, GROUP, [8, 1, 2], True),
        (WRITE, LEADER, [12, 13, 14], True),
        (stream.TABLE_OP_ID, GROUP, [11, 1, 2, 3], True),
    ])
    got = reuse_from_rows(ops)
    assert got == {"requests": 2, "blocks": 2, "per_block": {1: 1, 2: 1},
                   "steps_without_writes": 0, "by": "rows"}


def test_prefix_reuse_a_request_left_out_of_a_step_keeps_its_row():
    # block size 4.  A prefills 6 tokens (blocks 1, 2); at step 2 only B
    # runs (block 3: A is waiting, as when the step's token budget ran
    # out); at step 3 A goes on into block 2.  A's row stays open while
    # nobody writes its last block: two requests, nothing reused.  (A row
    # is retired only when a step that does not continue it writes its
    # last block: a finished request's.)
    ops = op_stream([
        (WRITE, LEADER, [4, 5, 6, 7, 8, 9], True),
        (stream.TABLE_OP_ID, GROUP, [6, 1, 2], True),
        (WRITE, LEADER, [12, 13], True),
        (stream.TABLE_OP_ID, GROUP, [2, 3], True),
        (WRITE, LEADER, [10, 14], True),
        (stream.TABLE_OP_ID, GROUP, [7, 1, 2, 3, 3], True),
    ])
    got = reuse_from_rows(ops)
    assert got == {"requests": 2, "blocks": 0, "per_block": {},
                   "steps_without_writes": 0, "by": "rows"}


def test_prefix_reuse_a_finished_requests_row_retires_when_its_block_is_rewritten():
    # block size 4.  A (blocks 1, 2, 6 tokens) finishes; B gets block 2 and
    # writes it (slots 8, 9); then C, a new request, holds blocks 1 and 2
    # and writes a token into block 3.  A's row was retired at B's step, so
    # C is new and found blocks 1 and 2 cached; kept open, A's row would
    # have swallowed C as A going on.
    ops = op_stream([
        (WRITE, LEADER, [4, 5, 6, 7, 8, 9], True),
        (stream.TABLE_OP_ID, GROUP, [6, 1, 2], True),
        (WRITE, LEADER, [8, 9], True),
        (stream.TABLE_OP_ID, GROUP, [2, 2], True),
        (WRITE, LEADER, [12], True),
        (stream.TABLE_OP_ID, GROUP, [9, 1, 2, 3], True),
    ])
    got = reuse_from_rows(ops)
    assert got == {"requests": 3, "blocks": 2, "per_block": {1: 1, 2: 1},
                   "steps_without_writes": 0, "by": "rows"}


# -- prefix reuse by request id, where step_reqs names the rows ---------------------

SR = stream.STEP_REQS_OP_ID
A, B, C = 0xA1, 0xB2, 0xC3


def test_prefix_reuse_by_name_settles_the_next_turn():
    """The conversation above, with step_reqs naming each step's rows: B is
    new by its name, and found A's blocks 1 and 2 cached (11 tokens, 3
    computed: 8 = 2 blocks before them)."""
    records = [
        (SR, 0, [A, 7], True), (WRITE, LEADER, [4, 5, 6, 7, 8, 9, 10], True),
        (stream.TABLE_OP_ID, GROUP, [7, 1, 2], True),
        (SR, 0, [A, 1], True), (WRITE, LEADER, [11], True),
        (stream.TABLE_OP_ID, GROUP, [8, 1, 2], True),
        (SR, 0, [B, 3], True), (WRITE, LEADER, [12, 13, 14], True),
        (stream.TABLE_OP_ID, GROUP, [11, 1, 2, 3], True),
    ]
    ops, (rows,) = step_reqs_and_tables(records, 4)
    got = access_requests.prefix_reuse(ops, rows, LEADER, access_requests.step_requests(ops))
    assert got == {"requests": 2, "blocks": 2, "per_block": {1: 1, 2: 1},
                   "steps_without_writes": 0, "by": "request ids"}


# Block size 4.  Step 1: A prefills 6 tokens (blocks 3, 4).  Step 2: A and a
# sequence forked from it (A's name again, a second row on A's blocks).
# Step 3: C's first step, a chunk: 12 tokens, 4 computed, so 8 found cached,
# A's blocks 3 and 4 (A is not scheduled: preempted).  Step 4: A is back on
# its blocks, and C goes on.  New by name: A and C; reused: C's 2 blocks.
# The fork and A's return are not new.
STEPS_NAMED = [
    (SR, 0, [A, 6], True), (WRITE, LEADER, [12, 13, 14, 15, 16, 17], True),
    (stream.TABLE_OP_ID, GROUP, [6, 3, 4], True),
    (SR, 0, [A, A, 1, 0], True), (WRITE, LEADER, [18], True),
    (stream.TABLE_OP_ID, GROUP, [7, 3, 4, 6, 3, 4], True),
    (SR, 0, [C, 4], True), (WRITE, LEADER, [32, 33, 34, 35], True),
    (stream.TABLE_OP_ID, GROUP, [12, 3, 4, 8], True),
    (SR, 0, [A, C, 1, 4], True), (WRITE, LEADER, [19, 36, 37, 38, 39], True),
    (stream.TABLE_OP_ID, GROUP, [8, 3, 4, 16, 3, 4, 8, 9], True),
]
NAMED_WANT = {"requests": 2, "blocks": 2, "per_block": {3: 1, 4: 1},
              "steps_without_writes": 0, "by": "request ids"}


@pytest.mark.parametrize("leader", [LEADER, 0], ids=["op tier", "no layers"])
def test_prefix_reuse_by_name_forks_and_returns_are_not_new(leader):
    """A group with no layer of its own in the trace (the plugin tier's, in
    vLLM's engine core) gets the figure too: it needs no writes."""
    ops, (rows,) = step_reqs_and_tables(STEPS_NAMED, 4)
    assert access_requests.prefix_reuse(ops, rows, leader, access_requests.step_requests(ops)) == NAMED_WANT


def test_prefix_reuse_by_name_counts_only_the_requests_its_rows_name():
    """A fifth step's step_reqs names a request D whose table op came
    incomplete (no rows: its live set is not whole): D is in step_reqs,
    and no row of the group is D's, so it is no new request of the group."""
    D = 0xD0D0
    records = STEPS_NAMED + [(SR, 0, [D, 4], True), (WRITE, LEADER, [40, 41, 42, 43], True),
                             (stream.TABLE_OP_ID, GROUP, [4, 10], False)]
    ops, (rows,) = step_reqs_and_tables(records, 4)
    sr = access_requests.step_requests(ops)
    assert D in sr.req.tolist()
    assert access_requests.prefix_reuse(ops, rows, LEADER, sr) == NAMED_WANT


def test_prefix_reuse_falls_back_to_rows_when_a_step_is_unnamed():
    """Step 3's step_reqs record lost: step 3 is nobody's, so the names
    cannot say whose first step it was; the rows' reading is used, as
    without step_reqs at all; without a leader layer there is none."""
    records = STEPS_NAMED[:6] + STEPS_NAMED[7:]
    ops, (rows,) = step_reqs_and_tables(records, 4)
    sr = access_requests.step_requests(ops)
    got = access_requests.prefix_reuse(ops, rows, LEADER, sr)
    assert got["by"] == "rows" and got == access_requests.prefix_reuse(ops, rows, LEADER)
    # no leader layer (the plugin tier's groups have leader 0): no writes
    # to tell reuse from computing, so no figure rather than a wrong one
    assert access_requests.prefix_reuse(ops, rows, None, sr) is None
    assert access_requests.prefix_reuse(ops, rows, 0, sr) is None


@pytest.mark.parametrize("wide", [False, True])
def test_merged_sums_each_repeated_key_once(wide):
    """_merged against a dict: one row per (request, group, block), reads and
    tokens summed, the earliest and latest times kept, whichever row of a
    key carries it.  wide: keys whose product passes an int64 (every row
    through the merge, none found by the packed sort)."""
    rng = np.random.default_rng(5)
    n = 400
    ri = rng.integers(0, 6, n) + ((1 << 30) if wide else 0)
    blk = rng.integers(1, 9, n) + ((1 << 40) if wide else 0)
    gix = rng.integers(0, 2, n)
    cols = [ri, blk] + [rng.integers(0, 100, n) for _ in range(6)] + [gix]
    want = {}
    for row in zip(*(c.tolist() for c in cols)):
        r, b, reads, fr, lr, tw, fw, lw, g = row
        w = want.get((r, g, b))
        want[(r, g, b)] = (reads, fr, lr, tw, fw, lw) if w is None else (
            w[0] + reads, min(w[1], fr), max(w[2], lr), w[3] + tw, min(w[4], fw), max(w[5], lw))
    got_cols, kept = access_requests._merged([c.copy() for c in cols])
    if kept is None:
        kept = np.ones(n, bool)
    got = {}
    for row in zip(*(c[kept].tolist() for c in got_cols)):
        r, b, reads, fr, lr, tw, fw, lw, g = row
        assert (r, g, b) not in got
        got[(r, g, b)] = (reads, fr, lr, tw, fw, lw)
    assert len(got) < n and got == want


def test_merged_without_a_repeated_key_keeps_every_row():
    cols = [np.arange(5), np.arange(5) + 1] + [np.arange(5) for _ in range(6)] + [np.zeros(5, int)]
    got, kept = access_requests._merged([c.copy() for c in cols])
    assert kept is None and all(np.array_equal(a, b) for a, b in zip(got, cols))


def test_scan_of_rows_without_entries():
    """Steps whose rows hold no block (seq_len 0): no entries, no bounds, and
    a scan that finds nothing read."""
    ops = op_stream([(stream.TABLE_OP_ID, GROUP, [0, 0], True),
                     (stream.TABLE_OP_ID, GROUP, [0], True)])
    rows = access_stream.rows_of(ops, access_stream.steps_of(ops, groups(4))[0])
    assert len(rows.entries) == 0 and rows.bounds is None
    scan = rows.scan()
    assert len(scan.reads_per_block) == 0 and scan.out_of_range == 0
