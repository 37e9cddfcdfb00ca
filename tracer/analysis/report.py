"""The report's core: everything `report` shows, computed once from a trace
file's stream (Report), with numpy over the flat arrays: per-block
histograms (stream_aggregate), a heatmap of time x blocks, op sizes and
rates, occupancy from writes (occupancy.py), access patterns and the
plugin tier's figures.  Only complete ops are used for per-block figures;
what was left out is said (`exact`, `inexact_reasons`).  The outputs are
views/report_text.py, exporters/report_json.py and report_csv.py.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import abi
from ..errors import UsageError
from ..trace import stream, tracefile
from . import (access_counters, access_requests, access_stream, derived_rows, heatmap,
               lifecycle, misses, occupancy)
from .aggregate import Aggregate


class Report:
    """Everything the views need, computed once from a trace.

    with_lifecycle: compute the plugin tier's figures (`lifecycle`; None
    without the tier or when not asked), with the timelines and access of
    the first `timelines` requests (None: all of them).  meanwhile: a
    function of the report, called once everything but the plugin tier's
    figures is computed (its events and step_reqs, and the rows, included),
    while those still are (the views' heatmap and rates, JSON's other
    parts); what it returns is `self.meanwhile`.  access_as: a function
    that each request's access figures are put through, on the side that
    computes them (JSON's: serialized there, not at the end)."""

    def __init__(self, trace: tracefile.Trace, pid: int = None, with_lifecycle: bool = True,
                 timelines: int = None, meanwhile=None, access_as=None):
        self.trace = trace
        ops = trace.ops
        if pid is not None:
            if not np.any(ops.ops["pid"] == pid):
                raise UsageError(f"no ops of pid {pid} in {trace.path}")
            ops = ops.select(ops.ops["pid"] == pid)
        self.ops = ops
        self.t0 = int(trace.meta.get("created_monotonic_ns") or
                      (ops.ops["ts_ns"].min() if len(ops.ops) else 0))
        self.caches = [c for c in trace.caches if pid is None or c["pid"] == pid]
        self.layers = trace.layers()
        # reads: one Steps per KV-cache group, and every (request, block)
        # read of its complete steps as (step index, block)
        self.groups = [g for g in trace.groups if pid is None or g["pid"] == pid]
        self.steps = access_stream.steps_of(ops, self.groups)
        # the plugin tier's step_rows: each group's reads derived from its
        # row events (derived_rows), used where the group has no block_table
        # (the default); with both (--verify-rows), the counted ones are
        # used and the derived ones checked against them, step by step
        self.derived = derived_rows.replay_all(stream.step_rows(ops),
                                               derived_rows.row_events(ops))
        o = ops.ops
        tables = o[o["op"] == stream.TABLE_OP_ID]
        with_tables = set(zip(tables["pid"].tolist(), tables["cache_id"].tolist()))
        counted = derived_rows.pair_groups(
            self.derived, [(i, g["pid"], g["group_id"], int(g["block_size"]), len(st))
                           for i, (g, st) in enumerate(zip(self.groups, self.steps))
                           if (g["pid"], g["group_id"]) in with_tables])
        derived_only = [derived_rows.DerivedRows(d) for d in self.derived
                        if (d.pid, d.group) not in counted]
        n_counted = len(self.steps)
        self.steps = self.steps + [r.steps for r in derived_only]
        # Two sides, on two threads: numpy lets go of the GIL in its passes,
        # and the sides take about as long (on a large trace's JSON report,
        # a third less time for 0.4 GB more memory at its peak).
        # Beside: the rows, the plugin tier's events, step_reqs and figures.
        # Here: the generations, then (once the rows are there) the read scan.
        # Where the plugin tier's figures are few (text: the first requests'
        # alone; CSV: none), beside has time to spare, and computes the
        # generations of the caches that no read scan waits for (else beside
        # sits idle at the end of a text report)
        many_requests = with_lifecycle and timelines is None
        rows_ready, gens_ready, named, split = Future(), Future(), Future(), Future()

        def publish(future, compute):
            try:
                future.set_result(compute())
            except BaseException as e:
                future.set_exception(e)  # raised here too, not waited on
                raise

        def plugin_side():
            publish(rows_ready, lambda: [access_stream.rows_of(ops, st)
                                         for st in self.steps[:n_counted]] + derived_only)
            self.rows = rows_ready.result()
            publish(gens_ready, lambda: occupancy.computed_groups(split.result()[1]))

            def named_rows():
                # the plugin tier's block events (empty without the plugin),
                # and its step_reqs: whose each table row is (empty without it)
                self.life = lifecycle.events(ops)
                self.step_reqs = access_requests.step_requests(ops)
            publish(named, named_rows)
            if many_requests:  # the rest of the tier's figures are made here meanwhile
                per_req, attributed = report_request_access(self)
                if access_as is not None:
                    per_req = {r: access_as(f) for r, f in per_req.items()}
                return per_req, attributed
            return lifecycle_figures(self, timelines) if with_lifecycle else None

        def generation_groups():  # (here, there)
            gen_groups = occupancy.distinct_caches(ops, trace.block_sizes())
            keys = [c[0] for g in gen_groups for c in g]
            first = {self._first_layer(keys, pid) for pid in {k[0] for k in keys}}
            here, there = [], []
            for g in gen_groups:
                scanned = any(c[0] in first for c in g)
                (here if scanned or many_requests else there).append(g)
            return here, there

        with ThreadPoolExecutor(1) as beside:
            # beside's rows need nothing of the split, which is made here
            # meanwhile (beside waited for it when it was made first)
            figures = beside.submit(plugin_side)
            publish(split, generation_groups)
            self.gens = occupancy.computed_groups(split.result()[0])
            # one pass over each group's reads: per-block figures, and the idle
            # time before reuse of its process's first layer's generations
            self.scans = []
            for st, rows in zip(self.steps, rows_ready.result()):
                gens = self.first_layer_gens(st.pid)
                self.scans.append(rows.scan(*((gens.block, gens.start_ns)
                                              if gens is not None else ())))
            self.derived_check = derived_figures(self.derived, counted, self.steps,
                                                 rows_ready.result(), self.scans)
            self.gens = dict(sorted({**self.gens, **gens_ready.result()}.items(),
                                    key=lambda kv: kv[0]))
            # the rest needs nothing from beside but its step_reqs, and beside's
            # side takes longer, so it is done meanwhile
            self.agg = stream_aggregate(ops, self.caches, trace, self.steps, self.scans,
                                        self.gens, derived_only)
            # what the generations were computed from (a live set may replace it)
            self.occupancy_source = occupancy.FROM_WRITES
            self.reasons = stream_reasons(ops, trace, self.agg) + [
                r for d in self.derived if (d.pid, d.group) not in counted for r in d.reasons]
            named.result()  # the views made meanwhile may name rows
            # each process's block events per block, as attach's maps count
            # them: its JSON lifecycle is then no null where it fired events
            lifecycle_per_block(self.agg, self.life)
            self.meanwhile = meanwhile(self) if meanwhile else None
            # every request's figures (JSON): what each one wrote and read is
            # most of them, and beside's; the rest (timelines, the residency
            # times, the miss ratio curve) is made here, where this side had
            # been waiting for beside
            self.lifecycle = lifecycle_figures(self, None, beside=figures.result) \
                if many_requests else figures.result()

    def _first_layer(self, keys, pid):
        """Of these (pid, cache_id) keys, pid's first layer's (the lowest
        layer; of equal ones, the lowest key), or None."""
        return min((k for k in keys if k[0] == pid), key=lambda k: (self.layers[k], k),
                   default=None)

    def first_layer_gens(self, pid):
        """The block generations of pid's first layer (None without writes)."""
        key = self._first_layer(self.gens, pid)
        return None if key is None else self.gens[key]

    def duration_ns(self) -> int:
        end = self.trace.end or {}
        d = end.get("aggregate", {}).get("duration_s")
        last = int(self.ops.ops["ts_ns"].max()) - self.t0 + 1 if len(self.ops.ops) else 1
        return max(last, int(d * 1e9) if d else 0)

    def span_ns(self) -> tuple:
        """The time the ops cover, relative to the trace's start: the default
        range of the heatmap and the rates (not the seconds spent attaching)."""
        t = self.ops.ops["ts_ns"]
        if not len(t):
            return 0, 1
        return int(t.min()) - self.t0, int(t.max()) - self.t0 + 1

    def write_runs(self):
        """(time since start ns, block, slots) of every run of slots a
        complete op wrote to one block, a cache at a time: the runs the
        generations were computed from (one op's consecutive slots in one
        block; a prefill writes a block's slots in a row, several slots a
        run), blocks beyond tracefile.MAX_BLOCKS left out as
        in the histograms.  Only caches with a known block size have
        generations, and only they have blocks."""
        for g in self.gens.values():
            if not len(g.run_block) or int(g.run_block.max()) < tracefile.MAX_BLOCKS:
                yield g.run_ns - self.t0, g.run_block, g.run_writes  # (no mask to apply)
                continue
            keep = g.run_block < tracefile.MAX_BLOCKS
            yield g.run_ns[keep] - self.t0, g.run_block[keep], g.run_writes[keep]

    def read_runs(self, rows: int, time_range: tuple):
        """(time since start ns, block, reads) for every block read by a
        complete block_table op (once per (request, step)), for every group,
        summed over each run of steps that fall in one row of a heatmap of
        `rows` rows over time_range (ns since start), or outside it: the
        heatmap counts such steps' reads alike, so a run is
        one bincount of its entries (Rows.block_counts), not a pass per
        read (seconds on a large trace's `report --kind reads`).
        Blocks beyond tracefile.MAX_BLOCKS are left out, as in the read
        histograms (which count those out of range)."""
        t0 = int(time_range[0])
        t1 = max(int(time_range[1]), t0 + 1)  # heatmap.compute_chunks' own end
        for st, group_rows, scan in zip(self.steps, self.rows, self.scans):
            nb = len(scan.reads_per_block)  # the highest block read, in range, + 1
            if not len(st) or not nb:
                continue
            t = st.ts_ns.astype(np.int64) - self.t0
            # (where the asked range is empty, [t0, t0), only steps at t0
            # are in the map's and all of them are out of the asked one)
            row = np.where((t >= t0) & (t < t1), (t - t0) * rows // (t1 - t0), -1)
            edges = np.r_[0, np.flatnonzero(row[1:] != row[:-1]) + 1, len(st)].tolist()
            spans = list(zip(edges[:-1], edges[1:]))
            for (k0, _), counts in zip(spans, group_rows.block_counts(spans, nb)):
                blocks = np.flatnonzero(counts)
                yield np.full(len(blocks), t[k0]), blocks, counts[blocks]

    def heatmap(self, rows, cols, time_range=None, block_range=None,
                exact_cols=True, kind="writes") -> heatmap.Heatmap:
        """The write (or read) heatmap.  Without a block_range it zooms to
        the blocks written (read) in the time range (heatmap.block_window):
        vLLM may have 2048 blocks and use a dozen.  exact_cols=False (no
        --resol) lets a narrow range have fewer columns than cols, one
        block per column, rather than stretch a block over several."""
        if time_range is None:
            time_range = self.span_ns()
        else:
            time_range = (int(time_range[0] * 1e9), int(time_range[1] * 1e9))
        if kind == "writes":
            # the runs once, for both passes below (an eighth of the slots)
            runs = list(self.write_runs())
            named = {}
        else:
            # the reads summed per block over runs of steps in one row
            runs = list(self.read_runs(rows, time_range))
            named = {"what": "block reads (once per step per KV-cache group)", "key": "reads"}
        # one pass for the highest block and the blocks used in the time
        # range (the zoom), one for the cells
        used = heatmap.block_counts(runs, time_range)
        nb = max([c["num_blocks"] for c in self.caches + self.groups] + [len(used), 1])
        zoomed = block_range is None
        if zoomed:
            block_range = heatmap.block_window(np.concatenate(
                [used, np.zeros(nb - len(used), np.int64)]))
            zoomed = block_range != (0, nb - 1)
        if not exact_cols:
            cols = min(cols, block_range[1] - block_range[0] + 1)
        return heatmap.compute_chunks(runs, rows, cols, time_range, block_range,
                                      total_blocks=nb, zoomed=zoomed, **named)

    def op_rates(self, bins: int = 10, time_range=None) -> dict:
        ops = self.ops.ops
        t0, t1 = self.span_ns() if time_range is None else \
            (int(time_range[0] * 1e9), int(time_range[1] * 1e9))
        t1 = max(t1, t0 + 1)
        t = ops["ts_ns"].astype(np.int64) - self.t0
        keep = (t >= t0) & (t < t1)
        row = (t[keep] - t0) * bins // (t1 - t0)
        out = {}
        for op_id in np.unique(ops["op"][keep]):
            sel = ops["op"][keep] == op_id
            counts = np.bincount(row[sel], minlength=bins)
            out[abi.OP_NAMES.get(int(op_id), str(op_id))] = (counts / ((t1 - t0) / bins / 1e9)).tolist()
        return {"t0_ns": t0, "t1_ns": t1, "bin_s": (t1 - t0) / bins / 1e9, "calls_per_s": out}


def log2_slot(v: np.ndarray) -> np.ndarray:
    """bcc's bpf_log2l(): floor(log2 v) + 1, and 0 for 0."""
    v = v.astype(np.uint64)
    out = np.zeros(len(v), np.int64)
    nz = v > 0
    out[nz] = np.floor(np.log2(v[nz].astype(np.float64))).astype(np.int64) + 1
    # float log2 is exact on powers of two, but can round up just below them
    fix = nz & (np.left_shift(np.uint64(1), (out - 1).clip(0).astype(np.uint64)) > v)
    out[fix] -= 1
    return out


def stream_groups(steps: list, scans: list, trace, derived=()) -> list:
    """The reads of the stream as the maps have them (aggregate.ReadGroup's
    raw form): per group, per-block reads and last-read steps from the
    complete steps (access_stream.ReadScan); totals from every step's op record.
    layer_calls comes from the end record (only the leader layer's calls
    are streamed)."""
    end_groups = {}
    for p in ((trace.end or {}).get("aggregate") or {}).get("processes") or []:
        for g in (p.get("groups") or []) if isinstance(p, dict) else []:
            if isinstance(g, dict) and isinstance(g.get("layer_calls"), int):
                end_groups[(p.get("pid"), g.get("group_id"))] = g["layer_calls"]
    # the cache's blocks, as the group's document has them: the read panel
    # then says "of" the same count as the write panel above it, not the
    # highest block read + 1
    sizes = {(g["pid"], g["group_id"]): int(g.get("num_blocks") or 0) for g in trace.groups}
    for rows in derived:  # groups whose reads are derived: the pool step_rows gave
        sizes.setdefault((rows.derived.pid, rows.derived.group), rows.derived.num_blocks)
    out = []
    for index, (st, scan) in enumerate(zip(steps, scans)):
        nb = max(len(scan.reads_per_block), sizes.get((st.pid, st.group_id), 0))
        n = len(st)
        out.append(dict(
            pid=st.pid, group_id=st.group_id, index=index, block_size=st.block_size,
            num_blocks=nb, steps=n, layer_calls=end_groups.get((st.pid, st.group_id), n),
            requests=int(st.rows.sum()), tokens=int(st.tokens.sum()),
            reads=int(st.reads.sum()), distinct=int(st.distinct.sum()),
            held_tokens=int(st.held_tokens.sum()), null_entries=0,
            out_of_range=scan.out_of_range,
            # steps whose live set was lost or cut short are counted in the
            # totals but not per block: stream_reasons says so
            truncated=0, read_errors=0,
            reads_per_block=_padded(scan.reads_per_block, nb),
            last_read_step=_padded(scan.last_read_step, nb)))
    return out


def derived_figures(derived: list, counted: dict, steps: list, rows: list, scans: list) -> list:
    """Per (process, group) with step_rows: whether its reads are derived
    (`used`: it has no block_table), how exact the replay is, and where it
    has block_table too, derived_rows.verify's comparison (`verified`),
    which report --check holds to no difference (docs/report-json.md)."""
    out = []
    for d in derived:
        i = counted.get((d.pid, d.group))
        out.append({
            "pid": d.pid, "group_id": d.group, "used": i is None, "steps": len(d),
            "exact": d.exact, "mismatches": d.mismatches, "incomplete_steps": d.incomplete,
            "lost_frees": d.lost_frees,
            "verified": None if i is None else derived_rows.verify(
                d, d._t["pos"], steps[i], rows[i], scans[i])})
    return out


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate([a, np.zeros(n - len(a), a.dtype)])


def stream_aggregate(ops: stream.OpStream, caches: list, trace, steps=(),
                     scans=(), gens=None, derived=()) -> Aggregate:
    """The per-block histograms of the stream, as an Aggregate (the same
    shape as attach's, so the same views and JSON serve).  gens: the
    caches' generations (occupancy.by_cache), whose runs give the write
    counts without reading every slot again."""
    o = ops.ops
    values = ops.values
    raw_caches, moves, moves_beyond = [], {}, {}

    def values_of(mask):
        idx = np.flatnonzero(mask)
        return stream.gather(values, o["start"][idx], o["stop"][idx] - o["start"][idx])

    for c in caches:
        mine = (o["pid"] == c["pid"]) & (o["cache_id"] == c["cache_id"])
        writes_op = mine & np.isin(o["op"], list(stream.WRITE_OP_IDS))
        g = (gens or {}).get((c["pid"], c["cache_id"]))
        if g is not None and g.run_block is not None:
            # the runs of slot writes the generations read: complete ops,
            # slots >= 0, as below
            blocks, weights = g.run_block, g.run_writes
        else:
            slots = values_of(writes_op & o["complete"])
            bs = max(1, int(c["block_size"]))
            blocks = slots[slots >= 0] // bs
            weights = np.ones(len(blocks), np.int64)
        # a per-block array as long as the layer, or its highest block
        # written, but never longer than MAX_BLOCKS: what lies beyond (a
        # target's garbage slot numbers) is counted, as the maps count what
        # lies beyond --max-blocks
        beyond = blocks >= tracefile.MAX_BLOCKS
        out_of_range = int(weights[beyond].sum())
        blocks, weights = blocks[~beyond], weights[~beyond]
        nb = max(int(c["num_blocks"]), int(blocks.max()) + 1 if len(blocks) else 0)
        raw_caches.append(dict(
            pid=c["pid"], cache_id=c["cache_id"], index=c["index"], op=c["op"],
            block_size=c["block_size"], num_blocks=c["num_blocks"],
            calls=int(writes_op.sum()), slots=int(o["slots"][writes_op].sum()),
            padding=int(o["padding"][writes_op].sum()),
            out_of_range=out_of_range,
            writes=np.bincount(blocks, weights, minlength=nb).astype(np.uint64)))
    pids = sorted({c["pid"] for c in caches} | set(np.unique(o["pid"]).tolist()))
    for pid in pids:
        mine = (o["pid"] == pid) & o["complete"]
        nb = max([c["num_blocks"] for c in caches if c["pid"] == pid] + [1])

        def count(op, flag, side):
            # by op id, not a name made per op (a Python string for each of
            # a million ops)
            v = values_of(mine & (o["op"] == abi.OPS[op]) & ((o["flags"] & flag) == flag))[side::2]
            return v

        parts = [count("copy_blocks", 0, 0), count("copy_blocks", 0, 1),
                 count("swap_blocks", abi.EV_SWAP_OUT, 0), count("swap_blocks", abi.EV_SWAP_IN, 1)]
        # block numbers as the target passed them: bounded as the writes are
        for name, p in zip(("copy_blocks", "copy_blocks", "swap_blocks", "swap_blocks"), parts):
            moves_beyond[(pid, name)] = moves_beyond.get((pid, name), 0) + int(
                np.count_nonzero((p < 0) | (p >= tracefile.MAX_BLOCKS)))
        parts = [p[(p >= 0) & (p < tracefile.MAX_BLOCKS)] for p in parts]
        nb = max([nb] + [int(p.max()) + 1 for p in parts if len(p)])
        moves[pid] = np.stack([np.bincount(p, minlength=nb).astype(np.uint64) for p in parts])
    op_stats, log2 = {}, {}
    # each (process, op) once, in that order: one np.unique of the two as
    # one integer, not a set of Python pairs (one per op)
    pairs = np.unique((o["pid"].astype(np.uint64) << np.uint64(32)) | o["op"].astype(np.uint64))
    for pid, op_id in zip((pairs >> np.uint64(32)).tolist(),
                          (pairs & np.uint64(0xffffffff)).tolist()):
        sel = (o["pid"] == pid) & (o["op"] == op_id)
        name = abi.OP_NAMES.get(op_id, str(op_id))
        flags = o["flags"][sel]
        op_stats[(pid, name)] = {
            "calls": int(sel.sum()), "items": int(o["items"][sel].sum()),
            "slots": int(o["slots"][sel].sum()), "padding": int(o["padding"][sel].sum()),
            "bytes": int(o["bytes"][sel].sum()),
            "truncated": int(np.count_nonzero(flags & abi.EV_TRUNCATED)),
            "read_errors": int(np.count_nonzero(flags & abi.EV_READ_ERROR)),
            "out_of_range": moves_beyond.get((pid, name), 0)}
        slots_, counts = np.unique(log2_slot(o["items"][sel]), return_counts=True)
        h = log2.setdefault(name, {})
        for s, n in zip(slots_.tolist(), counts.tolist()):
            h[s] = h.get(s, 0) + n
    end = trace.end or {}
    lost = end.get("aggregate", {}).get("lost_records", 0)
    raw = dict(time=0.0, caches=raw_caches, groups=stream_groups(steps, scans, trace, derived),
               op_stats=op_stats, log2=log2, moves=moves, stacks=[], globals={},
               records=len(o), lost=lost)
    procs = trace.processes
    return Aggregate.from_maps(raw, comms={p: d.get("comm", "?") for p, d in procs.items()},
                               probe_files={p: [f["path"] for f in d.get("probe_files", [])]
                                            for p, d in procs.items()},
                               proc_info=process_info(trace))


def lifecycle_per_block(agg: Aggregate, ev: "lifecycle.Events"):
    """Fills each process's `life` (lifecycle kind -> uint64 per block, as
    attach's maps have it) from the plugin tier's events."""
    if not len(ev) or ev.pid is None:
        return
    for pid in np.unique(ev.pid).tolist():
        proc = agg.processes.get(pid)
        if proc is None:
            continue
        mine = ev.pid == pid
        nb = int(ev.block[mine].max()) + 1
        proc.life = {k: np.bincount(ev.block[mine & (ev.kind == i)], minlength=nb)
                     .astype(np.uint64) for i, k in enumerate(abi.LIFE)}


def process_info(trace) -> dict:
    """{pid: parent, tier, probed_ops} as attach had them: from the process
    documents, or for a trace written before they held them, the END
    record's aggregate (parent and tier only).  probed_ops stays None where
    unknown, so no op is called "not probed" without evidence."""
    end = ((trace.end or {}).get("aggregate") or {}).get("processes") or []
    out = {}
    for e in end:
        if isinstance(e, dict) and isinstance(e.get("pid"), int):
            info = out.setdefault(e["pid"], {})
            if isinstance(e.get("parent"), int):
                info["parent"] = e["parent"]
            if isinstance(e.get("tier"), str):
                info["tier"] = e["tier"]
    for pid, d in trace.processes.items():
        info = out.setdefault(pid, {})
        for key in ("parent", "tier", "probed_ops"):
            if key in d:
                info[key] = d[key]
    return out


def stream_reasons(ops: stream.OpStream, trace, agg: Aggregate) -> list:
    """Why figures from this stream may fall short of what the target did."""
    reasons = []
    beyond = sum(l.out_of_range for p in agg.processes.values() for l in p.layers) + \
        sum(st["out_of_range"] for p in agg.processes.values() for st in p.ops.values())
    if beyond:
        reasons.append(f"{beyond} block numbers below 0 or from {tracefile.MAX_BLOCKS} up "
                       "are left out")
    incomplete = int(np.count_nonzero(~ops.ops["complete"]))
    if incomplete:
        reasons.append(f"{incomplete} ops whose values were lost, truncated or unreadable "
                       "are left out")
    if ops.orphan_chunks:
        reasons.append(f"{ops.orphan_chunks} chunks of ops whose record was lost")
    end = (trace.end or {}).get("aggregate")
    if end is None:
        reasons.append("the trace has no end record: ops after its last batch are missing")
    else:
        if end.get("lost_records"):
            reasons.append(f"{end['lost_records']} records lost in the perf buffer")
        reasons += end.get("inexact_reasons", [])
    return reasons


def value_counts(a: np.ndarray) -> list:
    """[[value, count], ...] in value order.  Steps (lifetimes, reuse gaps)
    are small non-negative integers, counted by a bincount where np.unique
    sorted them (a tenth of the time on a large trace's reuse gaps)."""
    a = np.asarray(a)
    if len(a) and a.dtype.kind in "iu" and int(a.min()) >= 0 and int(a.max()) < 4 * len(a) + 1024:
        counts = np.bincount(a)
        v = np.flatnonzero(counts)
        n = counts[v]
    else:
        v, n = np.unique(a, return_counts=True)
    return [[x, y] for x, y in zip(v.tolist(), n.tolist())]


def _pcts(values) -> list:
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if not len(v):
        return []
    # one call for every percentile: one partition of the values for all of
    # them, not a call each; numpy's interpolation is the same either way
    return [[p, float(x)] for p, x in zip(access_counters.PERCENTILES,
                                          np.percentile(v, access_counters.PERCENTILES))]


def access_figures(rep: Report) -> list:
    """Per KV-cache group: the figures of docs/access.md, from the stream."""
    out = []
    for st, rows, scan in zip(rep.steps, rep.rows, rep.scans):
        proc = rep.agg.processes.get(st.pid)
        g = next((g for g in (proc.groups if proc else []) if g.group_id == st.group_id), None)
        if g is None:
            continue
        end_ns = int(st.ts_ns.max()) if len(st) else rep.t0
        last_ns = scan.last_read_ns
        read = np.flatnonzero(last_ns)
        sharing = scan.sharing
        idle = scan.idle
        layers = g.layers
        doc = next((d for d in rep.groups if d["pid"] == st.pid and
                    d["group_id"] == st.group_id), {})
        reuse = access_requests.prefix_reuse(rep.ops, rows, doc.get("leader"), rep.step_reqs)
        out.append({
            "pid": st.pid, "group": g.group, "group_id": st.group_id,
            "block_size": st.block_size, "steps": len(st), "layers": layers,
            "layers_note": g.layers_note, "reads": g.reads, "reads_all_layers": g.reads * layers,
            "distinct": g.distinct, "tokens": g.tokens, "held_tokens": g.held_tokens,
            "blocks_read": int(len(read)),
            "frequency": [list(x) for x in access_counters.frequency_histogram(g.reads_per_block)],
            "hottest": [list(x) for x in access_counters.most_read_blocks(g.reads_per_block)],
            "coldest": [list(x) for x in access_counters.least_read_blocks(g.reads_per_block)],
            "wss_blocks": _pcts(st.distinct),
            "utilization": _pcts(st.utilization),
            # 1 - utilization, its percentiles mirrored (p10 of one is p90 of
            # the other): not the occupancy's unwritten share (docs/glossary.md)
            "internal_fragmentation": [[100 - p, 1 - v] for p, v in
                                       reversed(_pcts(st.utilization))],
            "utilization_overall": g.held_tokens / (g.distinct * st.block_size)
            if g.distinct and st.block_size else None,
            "sharing_mean": g.reads / g.distinct if g.distinct else None,
            "sharing_max_by_block": [[int(d), int(n)] for d, n in zip(
                *np.unique(sharing[sharing > 0], return_counts=True))],
            "prefix_reuse": None if reuse is None else {
                "requests": reuse["requests"], "blocks": reuse["blocks"],
                "steps_without_writes": reuse["steps_without_writes"], "by": reuse["by"],
                "most_reused": sorted(([int(b), n] for b, n in reuse["per_block"].items()),
                                      key=lambda x: (-x[1], x[0]))[:5]},
            "age_s_at_end": _pcts((end_ns - last_ns[read]) / 1e9),
            "idle_before_reuse_s": _pcts(idle / 1e9), "reuses": int(len(idle)),
        })
    return out


def report_request_access(rep: Report, only=None) -> tuple:
    """What each request wrote and read (access_requests.request_access): step_reqs
    names the table rows.  only: the request hashes wanted (None: all)."""
    return access_requests.request_access(rep.ops, rep.rows, rep.t0, only=only, sr=rep.step_reqs)


def lifecycle_figures(rep: Report, timelines: int = None, beside=None) -> dict:
    """The plugin tier's figures (docs/lifecycle.md), or None without it.
    beside: a function that returns report_request_access(rep) of every request,
    where another thread computes it meanwhile (timelines None)."""
    ev = rep.life
    if not len(ev) and not ev.incomplete:
        return None
    names = lifecycle.request_names(((rep.trace.end or {}).get("aggregate")) or {})
    requests = lifecycle.timelines(ev, rep.t0, names, limit=timelines,
                                   requests=lifecycle.request_events(rep.ops))
    # the residency here, while beside makes report_request_access (made
    # beside after it, it ended the JSON report while this side waited)
    res = lifecycle.residency(ev)
    if beside is None:
        per_req, attributed = report_request_access(
            rep, None if timelines is None else [int(r["req"], 16) for r in requests])
    else:
        per_req, attributed = beside()
    for r in requests:
        r["access"] = per_req.get(int(r["req"], 16))
    mrc = lifecycle.miss_ratio_curve(ev)
    return {"summary": {**lifecycle.summary(ev), "access_steps": attributed},
            "residency_buckets_s": list(lifecycle.RESIDENCY_BUCKETS),
            **{name: {"count": int(len(v)), "sum_s": float(v.sum()),
                      "buckets": lifecycle.histogram(v)} for name, v in res.items()},
            "miss_ratio_curve": mrc,
            "misses": misses.figures(ev, rep.ops, names, rep.t0, mrc, _block_size(rep)),
            "requests": requests}


def _block_size(rep: Report):
    """The tokens per block the block tables said (None without them): the
    miss classes count tokens with it where no prefix_hashes says it."""
    sizes = {st.block_size for st in rep.steps if st.block_size > 0}
    return sizes.pop() if len(sizes) == 1 else None
