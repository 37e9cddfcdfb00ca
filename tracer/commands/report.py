"""`kvtrace-bpf report FILE`: what a recorded trace says, in the terminal
(rich), as JSON or as CSV.

Everything is computed from the trace's stream (the ops with their raw slot
numbers and block pairs) with numpy over the flat arrays: per-block
histograms, a heatmap of time x blocks, op sizes and rates, and occupancy
from writes (tracer/occupancy.py).  Only complete ops are used for
per-block figures; what was left out is said (`exact`, `inexact_reasons`).
"""

import argparse
import contextlib
import csv
import gc
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import orjson
from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import abi
from ..analysis import access_counters, access_requests, access_stream, heatmap, lifecycle, occupancy
from ..views import live
from ..trace import stream, tracefile
from ..analysis.aggregate import Aggregate
from ..errors import UsageError
from ..files import WatchedStdout

REPORT_SCHEMA = "kvtrace-bpf/report"
# 2: lifecycle.requests[].access.blocks is columns (a list per figure), not
# a list of one dict per block
REPORT_VERSION = 2
TABLES = ("blocks", "generations", "fragmentation", "heatmap", "access", "wss")
KINDS = ("writes", "reads")

EXAMPLES = """\
examples:
  kvtrace-bpf report run.kvt
  kvtrace-bpf report run.kvt --resol 30 100 --time-range 2 5 --block-range 0 1023
  kvtrace-bpf report run.kvt --format json > run.json
  kvtrace-bpf report run.kvt --format csv --table generations > gens.csv
  kvtrace-bpf report run.kvt --kind reads          # the read heatmap (temperature)
  kvtrace-bpf report run.kvt --format csv --table wss > wss.csv
"""


def add_parser(sub):
    p = sub.add_parser(
        "report", help="report a recorded trace: histograms, heatmap, fill from writes",
        description="Per-block histograms (writes, copies, swaps), a heatmap of time x\n"
                    "block range (zoomed to the blocks written), op size and rate\n"
                    "histograms, and occupancy from writes (written fill at each block\n"
                    "generation's end, the unwritten share of the blocks being written,\n"
                    "write span and write gap) of a trace file written by `record` or\n"
                    "`attach -o`. Writes alone do not show frees or blocks held but not\n"
                    "written. Definitions: docs/occupancy.md, docs/glossary.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="trace file")
    p.add_argument("--format", choices=("text", "json", "csv"), default="text")
    p.add_argument("--table", choices=TABLES, default="blocks",
                   help="with --format csv: which table (default blocks)")
    p.add_argument("--resol", nargs=2, type=int, metavar=("ROWS", "COLS"),
                   help="heatmap resolution, exactly (default 20 rows, and the "
                   "terminal's width or one column per block, whichever is fewer)")
    p.add_argument("--time-range", nargs=2, type=float, metavar=("START", "END"),
                   help="heatmap and rates: seconds from the start of the trace")
    p.add_argument("--block-range", nargs=2, type=int, metavar=("LO", "HI"),
                   help="heatmap: blocks LO to HI, inclusive (default: the blocks "
                   "written, a little padded)")
    p.add_argument("--kind", choices=KINDS, default="writes",
                   help="what the heatmap counts: slot writes, or block reads (once per "
                   "step per KV-cache group; docs/access.md) (default writes)")
    p.add_argument("--pid", type=int, help="only this process")
    p.add_argument("--layer", type=int, default=0,
                   help="layer shown in the terminal's occupancy section (default 0; "
                        "JSON and CSV have every layer)")
    p.add_argument("--partial", action="store_true",
                   help="read a damaged or cut-short trace up to the damage")
    p.set_defaults(run=run)
    return p


# -- from the stream to figures ------------------------------------------------

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
        # Two sides, on two threads: numpy lets go of the GIL in its passes,
        # and the sides take about as long (row 6's JSON report 10.0-10.7 ->
        # 6.2 s for 0.4 GB more at its peak; docs/bench.md, "Stop 35").
        # Beside: the rows, the plugin tier's events, step_reqs and figures.
        # Here: the generations, then (once the rows are there) the read scan.
        # Where the plugin tier's figures are few (text: the first requests'
        # alone; CSV: none), beside has time to spare, and computes the
        # generations of the caches that no read scan waits for (row 6's text
        # report: beside was idle its last 0.85 s; docs/bench.md, "Stop 41")
        many_requests = with_lifecycle and timelines is None
        rows_ready, gens_ready, named, split = Future(), Future(), Future(), Future()

        def publish(future, compute):
            try:
                future.set_result(compute())
            except BaseException as e:
                future.set_exception(e)  # raised here too, not waited on
                raise

        def plugin_side():
            publish(rows_ready, lambda: [access_stream.rows_of(ops, st) for st in self.steps])
            self.rows = rows_ready.result()
            publish(gens_ready, lambda: occupancy.computed_groups(split.result()[1]))

            def named_rows():
                # the plugin tier's block events (empty without the plugin),
                # and its step_reqs: whose each table row is (empty without it)
                self.life = lifecycle.events(ops)
                self.step_reqs = access_requests.step_requests(ops)
            publish(named, named_rows)
            if many_requests:  # the rest of the tier's figures are made here meanwhile
                per_req, attributed = request_access(self)
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
            # meanwhile (beside had waited 0.07 s of row 6's report for it)
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
            self.gens = dict(sorted({**self.gens, **gens_ready.result()}.items(),
                                    key=lambda kv: kv[0]))
            # the rest needs nothing from beside but its step_reqs, and beside's
            # side takes longer (row 6's JSON: 2.7 against 2.5 s of one CPU),
            # so it is done meanwhile
            self.agg = stream_aggregate(ops, self.caches, trace, self.steps, self.scans,
                                        self.gens)
            # what the generations were computed from (a live set may replace it)
            self.occupancy_source = occupancy.FROM_WRITES
            self.reasons = stream_reasons(ops, trace, self.agg)
            named.result()  # the views made meanwhile may name rows
            self.meanwhile = meanwhile(self) if meanwhile else None
            # every request's figures (JSON): what each one wrote and read is
            # most of them, and beside's; the rest (timelines, the residency
            # times, the miss ratio curve) is made here, where this side had
            # been waiting for beside (row 6's JSON report: 1.5 s,
            # docs/bench.md "Stop 44"; the residency since "Stop 47")
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
        block; a prefill writes a block's slots in a row, 8.4 slots a run
        on row 6's trace), blocks beyond tracefile.MAX_BLOCKS left out as
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
        one bincount of its entries (Rows.block_counts) where a pass per
        read took 3 s of row 6's `report --kind reads` ("Stop 33").
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
        the blocks written (read) in the time range (live.block_window):
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
            block_range = live.block_window(np.concatenate(
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


def _log2_slot(v: np.ndarray) -> np.ndarray:
    """bcc's bpf_log2l(): floor(log2 v) + 1, and 0 for 0."""
    v = v.astype(np.uint64)
    out = np.zeros(len(v), np.int64)
    nz = v > 0
    out[nz] = np.floor(np.log2(v[nz].astype(np.float64))).astype(np.int64) + 1
    # float log2 is exact on powers of two, but can round up just below them
    fix = nz & (np.left_shift(np.uint64(1), (out - 1).clip(0).astype(np.uint64)) > v)
    out[fix] -= 1
    return out


def stream_groups(steps: list, scans: list, trace) -> list:
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
    out = []
    for index, (st, scan) in enumerate(zip(steps, scans)):
        nb = len(scan.reads_per_block)
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
            reads_per_block=scan.reads_per_block, last_read_step=scan.last_read_step))
    return out


def stream_aggregate(ops: stream.OpStream, caches: list, trace, steps=(),
                     scans=(), gens=None) -> Aggregate:
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
            # row 6's 1M ops took 0.09 s)
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
    # one integer, where a set of Python pairs took 0.06 s of row 6's 1M ops
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
        slots_, counts = np.unique(_log2_slot(o["items"][sel]), return_counts=True)
        h = log2.setdefault(name, {})
        for s, n in zip(slots_.tolist(), counts.tolist()):
            h[s] = h.get(s, 0) + n
    end = trace.end or {}
    lost = end.get("aggregate", {}).get("lost_records", 0)
    raw = dict(time=0.0, caches=raw_caches, groups=stream_groups(steps, scans, trace),
               op_stats=op_stats, log2=log2, moves=moves, stacks=[], globals={},
               records=len(o), lost=lost)
    procs = trace.processes
    return Aggregate.from_maps(raw, comms={p: d.get("comm", "?") for p, d in procs.items()},
                               probe_files={p: [f["path"] for f in d.get("probe_files", [])]
                                            for p, d in procs.items()},
                               proc_info=process_info(trace))


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


# -- views -----------------------------------------------------------------------

def _value_counts(a: np.ndarray) -> list:
    """[[value, count], ...] in value order.  Steps (lifetimes, reuse gaps)
    are small non-negative integers, counted by a bincount where np.unique
    sorted them (row 6's 850k reuse gaps: 32 -> 3 ms)."""
    a = np.asarray(a)
    if len(a) and a.dtype.kind in "iu" and int(a.min()) >= 0 and int(a.max()) < 4 * len(a) + 1024:
        counts = np.bincount(a)
        v = np.flatnonzero(counts)
        n = counts[v]
    else:
        v, n = np.unique(a, return_counts=True)
    return [[x, y] for x, y in zip(v.tolist(), n.tolist())]


def _occupancy_json(rep: Report) -> list:
    # layers whose writes are the same values share one Generations
    # (occupancy.distinct_caches), and its figures are made once
    made = {}
    out = []
    for c in rep.caches:
        key = (c["pid"], c["cache_id"])
        g = rep.gens.get(key)
        if g is None:
            continue
        if id(g) not in made:
            made[id(g)] = _generations_json(g)
        out.append({
            "pid": c["pid"], "layer": rep.layers[key], "cache_id": c["cache_id"],
            "source": rep.occupancy_source.name, "caveat": rep.occupancy_source.caveat,
            **made[id(g)]})
    return out


def _generations_json(g: occupancy.Generations) -> dict:
    frag = g.fragmentation
    return {
        "block_size": g.block_size, "generations": len(g),
        "started_by": {k: int(np.count_nonzero(g.kind == i))
                       for i, k in enumerate(occupancy.KINDS)},
        "fill_hist": g.fill_hist.tolist(),  # generations by tokens held at their end
        "fill_level_mean": float(g.fill.mean() / g.block_size) if len(g) else None,
        "max_writes": g.max_writes,
        "lifetime_steps": _value_counts(g.lifetime_steps),
        "reuse_steps": _value_counts(g.reuse_steps[g.reuse_steps >= 0]),
        "steps": g.steps,
        "active_blocks": g.active_blocks.tolist(),
        "active_tokens": g.active_tokens.tolist(),
        "fragmentation_mean": float(np.nanmean(frag)) if np.any(~np.isnan(frag)) else None,
        "incomplete_ops": g.incomplete_ops,
    }


# -- access patterns (reads) -------------------------------------------------------

def _pcts(values) -> list:
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if not len(v):
        return []
    # one call for every percentile: one partition of the values for all of
    # them, where a call each was 0.06 s of row 6's JSON report (888k idle
    # times); numpy's interpolation is the same either way
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
            "block_size": st.block_size, "steps": len(st), "layers": round(layers, 3),
            "reads": g.reads, "reads_all_layers": round(g.reads * layers),
            "distinct": g.distinct, "tokens": g.tokens, "held_tokens": g.held_tokens,
            "blocks_read": int(len(read)),
            "frequency": [list(x) for x in access_counters.frequency_histogram(g.reads_per_block)],
            "hottest": [list(x) for x in access_counters.most_read_blocks(g.reads_per_block)],
            "coldest": [list(x) for x in access_counters.least_read_blocks(g.reads_per_block)],
            "wss_blocks": _pcts(st.distinct),
            "utilization": _pcts(st.utilization),
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


ACCESS_MEANS = ("reads: (request, block) pairs at a forward step, counted once per step "
                "for the group's layers (all layers: x layers); working set: distinct "
                "blocks read at a step; utilization: tokens held in them over their "
                "capacity; sharing: requests reading one block at a step; age: time since "
                "a block's last read; idle before reuse: last read to its next generation's "
                "first write (docs/access.md)")


def request_access(rep: Report, only=None) -> tuple:
    """What each request wrote and read (access_requests.request_access): step_reqs
    names the table rows.  only: the request hashes wanted (None: all)."""
    return access_requests.request_access(rep.ops, rep.rows, rep.t0, only=only, sr=rep.step_reqs)


def lifecycle_figures(rep: Report, timelines: int = None, beside=None) -> dict:
    """The plugin tier's figures (docs/lifecycle.md), or None without it.
    beside: a function that returns request_access(rep) of every request,
    where another thread computes it meanwhile (timelines None)."""
    ev = rep.life
    if not len(ev) and not ev.incomplete:
        return None
    names = lifecycle.request_names(((rep.trace.end or {}).get("aggregate")) or {})
    requests = lifecycle.timelines(ev, rep.t0, names, limit=timelines,
                                   requests=lifecycle.request_events(rep.ops))
    # the residency here, while beside makes request_access (made beside
    # after it, it ended row 6's JSON report while this side had waited 0.5
    # s; here, and with _merged's copies gone, 0.96 of that time:
    # docs/bench.md, "Stop 47")
    res = lifecycle.residency(ev)
    if beside is None:
        per_req, attributed = request_access(
            rep, None if timelines is None else [int(r["req"], 16) for r in requests])
    else:
        per_req, attributed = beside()
    for r in requests:
        r["access"] = per_req.get(int(r["req"], 16))
    return {"summary": {**lifecycle.summary(ev), "access_steps": attributed},
            "residency_buckets_s": list(lifecycle.RESIDENCY_BUCKETS),
            **{name: {"count": int(len(v)), "sum_s": float(v.sum()),
                      "buckets": lifecycle.histogram(v)} for name, v in res.items()},
            "miss_ratio_curve": lifecycle.miss_ratio_curve(ev),
            "requests": requests}


LIFE_SHOWN_REQUESTS = 12


def lifecycle_view(figs: dict, width: int) -> list:
    if not figs:
        return []
    s = figs["summary"]
    head = Text(", ".join(f"{n:,} {live.LIFE_WORDS[k]}" for k, n in s["blocks"].items()))
    if s["prefix_served_share"] is not None:
        head.append(f"; the prefix cache served {100 * s['prefix_served_share']:.1f}% of the "
                    "blocks requests needed")
    if s["incomplete_events"]:
        head.append(f"; {s['incomplete_events']:,} events with ids missing (left out)",
                    style="red")
    hist = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="block residency, every block "
                 "(vLLM's kv_block_* buckets, seconds; cumulative)", title_justify="left")
    hist.add_column("le", justify="right")
    names = ("lifetime", "idle_before_evict", "reuse_gap")
    for n in names:
        hist.add_column(f"{n}\n{figs[n]['count']:,}", justify="right")
    rows = list(zip(*(figs[n]["buckets"] for n in names)))
    last = None
    for row in rows:
        counts = tuple(c for _, c in row)
        if counts == last and row[0][0] != "+Inf":
            continue  # runs of equal rows say nothing
        last = counts
        hist.add_row(str(row[0][0]), *(f"{c:,}" for c in counts))
    reqs = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                 title=f"requests (the first {min(LIFE_SHOWN_REQUESTS, s['requests'])} of "
                       f"{s['requests']:,}; --format json has all, event by event)",
                 title_justify="left")
    shown = figs["requests"][:LIFE_SHOWN_REQUESTS]
    for col in ("request", "first (s)", "last (s)", *abi.LIFE, "preempted"):
        reqs.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    acc = None
    if any(r.get("access") for r in shown):
        a = s["access_steps"]
        acc = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                    title="what each request wrote and read: tokens written, the blocks "
                          "they went to, block reads in all and a step (step_reqs named "
                          f"the rows of {a['steps']:,} steps" +
                          (f"; {a['unmatched']:,} unnamed" if a["unmatched"] else "") + ")")
        for col in ("request", "steps", "tokens", "blocks", "reads", "a step"):
            acc.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    for r in shown:
        per = dict.fromkeys(abi.LIFE, 0)
        preempted = 0
        for _, kind, _, what in r["events"]:
            if kind in per:
                per[kind] += len(what)
            elif kind == "preempt":
                preempted += 1
        reqs.add_row(r["id"] or r["req"], f"{r['events'][0][0]:.3f}", f"{r['events'][-1][0]:.3f}",
                     *(f"{per[k]:,}" for k in abi.LIFE), f"{preempted:,}")
        a = r.get("access")
        if acc is not None:
            acc.add_row(r["id"] or r["req"], *(("-",) * 5 if not a else (
                f"{a['steps']:,}", f"{a['tokens_written']:,}",
                f"{np.count_nonzero(a['blocks']['tokens_written']):,}",
                f"{a['block_reads']:,}",
                f"{a['block_reads'] / a['steps']:.1f}" if a["steps"] else "-")))
    parts = [head, hist]
    mrc = figs.get("miss_ratio_curve")
    if mrc:
        m = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"miss-ratio curve (Mattson, LRU over {mrc['references']:,} block "
                        f"references; {mrc['refetched']:,} recomputed that a larger cache "
                        "would have hit)")
        m.add_column("cache blocks", justify="right")
        m.add_column("hit ratio", justify="right")
        for size, ratio in mrc["curve"]:
            m.add_row(f"{size:,}", f"{100 * ratio:.1f}%")
        parts.append(m)
    parts.append(reqs)
    if acc is not None:
        parts.append(acc)
    return [Panel(Group(*parts), title="block lifecycle (plugin tier)",
                  title_align="left", width=width)]


def access_view(figs: list, width: int) -> list:
    parts = []
    for f in figs:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_header=False)
        t.add_column("figure", no_wrap=True)
        t.add_column("value")

        def pct(pairs, fmt):
            return "  ".join(f"p{int(p)} {fmt(v)}" for p, v in pairs) or "-"

        t.add_row("steps", f"{f['steps']:,} ({f['layers']:g} layers a step)")
        t.add_row("block reads", f"{f['reads']:,} (x {f['layers']:g} layers: "
                                 f"{f['reads_all_layers']:,})")
        t.add_row("working set, blocks a step", pct(f["wss_blocks"], lambda v: f"{v:,.0f}"))
        t.add_row("utilization of the working set",
                  pct(f["utilization"], lambda v: f"{100 * v:.1f}%"))
        # the live set's internal fragmentation: what occupancy from writes
        # (below) can only estimate, as it sees neither frees nor held blocks
        t.add_row("internal fragmentation (live set)",
                  pct([[100 - p, 1 - v] for p, v in reversed(f["utilization"])],
                      lambda v: f"{100 * v:.1f}%"))
        if f["sharing_mean"] is not None:
            t.add_row("sharing (requests a block)", f"mean {f['sharing_mean']:.2f}; most at "
                      f"one step: " + ", ".join(f"{d}: {n} blocks" for d, n in
                                                f["sharing_max_by_block"][-4:]))
        t.add_row("blocks read", f"{f['blocks_read']:,}")
        r = f["prefix_reuse"]
        if r is not None:
            how = "by request id" if r["by"] == "request ids" else "inferred from rows"
            t.add_row(f"prefix reuse ({how})", f"{r['blocks']:,} blocks found cached by "
                      f"{r['requests']:,} requests at their first step" +
                      (f"; most reused block:times " + ", ".join(
                          f"{b}:{n}" for b, n in r["most_reused"]) if r["most_reused"] else ""))
        t.add_row("hottest block:reads", ", ".join(f"{b}:{n:,}" for b, n in f["hottest"]))
        t.add_row("coldest block:reads", ", ".join(f"{b}:{n:,}" for b, n in f["coldest"]))
        t.add_row("age at the end (s)", pct(f["age_s_at_end"], lambda v: f"{v:.3g}"))
        t.add_row("idle before reuse (s)", f"{f['reuses']:,} reuses: " +
                  pct(f["idle_before_reuse_s"], lambda v: f"{v:.3g}"))
        freq = _distribution_rows(f["frequency"])
        parts.append(Panel(Group(t, freq), title=f"pid {f['pid']}, group {f['group']}: "
                           "access patterns (reads)", title_align="left", width=width))
    if parts:
        parts.append(Text(ACCESS_MEANS, style="dim"))
    return parts


def _distribution_rows(rows: list) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="access frequency: blocks by reads",
              title_justify="left", title_style="bold")
    for col in ("reads", "blocks", ""):
        t.add_column(col, justify="right" if col else "left")
    top = max([n for _, _, n in rows] + [0])
    for lo, hi, n in rows:
        t.add_row(f"{lo}-{hi}" if lo != hi else f"{lo}", f"{n:,}", _bar(n, top))
    return t


def document(rep: Report, hm: heatmap.Heatmap, rates: dict) -> dict:
    """The JSON document but its last part, "lifecycle" (the plugin tier's
    figures, rep.lifecycle): what the main side can make (and serialize:
    json_parts) while those are computed beside it."""
    t = rep.trace
    blocks = rep.agg.to_json()
    blocks["inexact_reasons"] = rep.reasons
    blocks["exact"] = not rep.reasons
    return {
        "schema": REPORT_SCHEMA, "version": REPORT_VERSION,
        "trace": {"path": t.path, "format_version": t.meta["version"],
                  "host": t.meta["host"], "kernel": t.meta["kernel"],
                  "created_utc": t.meta["created_utc"], "target": t.meta["target"],
                  "processes": list(t.processes.values()), "complete": t.complete,
                  "damage": t.damage, "duration_s": rep.duration_ns() / 1e9},
        "stream": {"ops": len(rep.ops.ops), "values": int(rep.ops.values_decoded),
                   "incomplete_ops": int(np.count_nonzero(~rep.ops.ops["complete"])),
                   "orphan_chunks": rep.ops.orphan_chunks},
        "blocks": blocks,
        "op_rates": rates,
        "heatmap": hm.to_json(),
        "occupancy": _occupancy_json(rep),
        "access": access_figures(rep),
    }


def json_parts(doc: dict) -> dict:
    """The document's parts, each already serialized (orjson.Fragment): the
    same bytes in write_json, which then only copies them."""
    return {k: _json_fragment(v) for k, v in doc.items()}


# numpy arrays as they are (request_access' columns: no Python object per
# value); dict keys that are numbers as strings, as json made them
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _json_fragment(value) -> orjson.Fragment:
    """value serialized now, to be copied as it is into write_json's bytes
    (every request's access columns: 0.1 s at the end of row 6's JSON
    report, made on the side that computes them; docs/bench.md "Stop 44")."""
    return orjson.Fragment(orjson.dumps(value, option=_JSON_OPTIONS))


def write_json(doc: dict, out):
    """The document, compact, on one line.  orjson rather than the standard
    library's encoder: row 6's 66 MB document in 0.2 s where json.dumps took
    1.1 s, the same bytes (docs/design.md, "The report's JSON").  A NaN is
    null, where json wrote NaN, which is no JSON.

    Written a piece at a time (_json_pieces), the same bytes as one
    orjson.dumps(doc): the whole document as one bytes object, grown as it
    was made, was the last of row 6's report's fresh memory (66 MB and more,
    at 2-3 us a page first touched on these VMs; docs/bench.md, "Stop 48")."""
    # the CLI's stdout notes a failed write; WatchedStdout also knows how to
    # put bytes on any text stream (to its buffer, or decoded without one)
    w = out if isinstance(out, WatchedStdout) else WatchedStdout(out)
    # pieces gathered into writes of a MiB or more: a small write the file's
    # buffer kept would meet a full disk again when the file is closed
    pending, size = [], 0
    for piece in _json_pieces(doc):
        pending.append(piece)
        size += len(piece)
        if size >= _JSON_WRITE_BYTES:
            w.write_bytes(b"".join(pending))
            pending, size = [], 0
    w.write_bytes(b"".join(pending + [b"\n"]))


# the items of a long list serialized at once by _json_pieces (row 6's 6000
# requests in pieces of about 0.7 MB), and the least bytes write_json writes
# at once (but the last)
_JSON_LIST_PIECE = 64
_JSON_WRITE_BYTES = 1 << 20


def _json_pieces(value, depth: int = 0):
    """orjson.dumps(value)'s bytes, in pieces: the members of a dict (of
    string keys, the document and its parts, two levels deep) one by one,
    the items of a long list _JSON_LIST_PIECE at a time, anything else
    whole.  orjson's compact form has no space between tokens, so the
    pieces joined are its bytes for the whole (tests/test_unit_report.py)."""
    if depth < 2 and isinstance(value, dict) and value and all(type(k) is str for k in value):
        sep = b"{"
        for k, v in value.items():
            yield sep + orjson.dumps(k) + b":"
            yield from _json_pieces(v, depth + 1)
            sep = b","
        yield b"}"
    elif isinstance(value, list) and len(value) > _JSON_LIST_PIECE:
        for i in range(0, len(value), _JSON_LIST_PIECE):
            part = orjson.dumps(value[i:i + _JSON_LIST_PIECE], option=_JSON_OPTIONS)
            yield (b"," if i else b"[") + part[1:-1]  # the items, without their brackets
        yield b"]"
    else:
        yield orjson.dumps(value, option=_JSON_OPTIONS)


def write_csv(rep: Report, table: str, hm: heatmap.Heatmap, out):
    w = csv.writer(out, lineterminator="\n")
    if table == "blocks":
        w.writerow(["pid", "block", "tokens", "all_layer_writes", "copy_src", "copy_dst",
                    "swap_out", "swap_in"])
        for p in sorted(rep.agg.processes.values(), key=lambda p: p.pid):
            n = p.num_blocks
            cols = [p.tokens, p.all_layer_writes] + [p.moves.get(k, np.zeros(0)) for k in
                                                     ("copy_src", "copy_dst", "swap_out", "swap_in")]
            cols = [np.pad(c.astype(np.int64), (0, n - len(c))) for c in cols]
            m = np.stack(cols, axis=1)
            nz = np.flatnonzero(m.any(axis=1))
            w.writerows([[p.pid, int(b), *m[b].tolist()] for b in nz])
    elif table == "generations":
        w.writerow(["pid", "layer", "block", "kind", "start_step", "last_step", "start_ns",
                    "last_ns", "inherited", "fill", "writes", "reuse_steps"])
        for key, g in sorted(rep.gens.items()):
            cols = np.stack([g.block, g.start_step, g.last_step, g.start_ns - rep.t0,
                             g.last_ns - rep.t0, g.inherited, g.fill, g.writes,
                             g.reuse_steps], axis=1).tolist()
            kinds = [occupancy.KINDS[k] for k in g.kind]
            w.writerows([[key[0], rep.layers[key], r[0], k, *r[1:]]
                         for r, k in zip(cols, kinds)])
    elif table == "fragmentation":
        w.writerow(["pid", "layer", "step", "active_blocks", "active_tokens", "fragmentation"])
        for key, g in sorted(rep.gens.items()):
            frag = g.fragmentation
            w.writerows([[key[0], rep.layers[key], k, int(b), int(t),
                          "" if np.isnan(f) else f"{f:.6f}"]
                         for k, (b, t, f) in enumerate(zip(g.active_blocks, g.active_tokens, frag))])
    elif table == "access":
        w.writerow(["pid", "group", "block", "reads", "last_read_s", "max_sharing"])
        for st, scan in zip(rep.steps, rep.scans):
            proc = rep.agg.processes[st.pid]
            g = next(g for g in proc.groups if g.group_id == st.group_id)
            last, share = scan.last_read_ns, scan.sharing
            for b in np.flatnonzero(g.reads_per_block):
                w.writerow([st.pid, g.group, int(b), int(g.reads_per_block[b]),
                            f"{(int(last[b]) - rep.t0) / 1e9:.6f}", int(share[b])])
    elif table == "wss":
        w.writerow(["pid", "group", "step", "t_s", "requests", "reads", "working_set",
                    "tokens", "held_tokens", "utilization"])
        for n, st in enumerate(rep.steps):
            util = st.utilization
            for i in range(len(st)):
                w.writerow([st.pid, n, i, f"{(st.ts_ns[i] - rep.t0) / 1e9:.6f}",
                            int(st.rows[i]), int(st.reads[i]), int(st.distinct[i]),
                            int(st.tokens[i]), int(st.held_tokens[i]),
                            "" if np.isnan(util[i]) else f"{util[i]:.6f}"])
    elif table == "heatmap":
        w.writerow(["row", "col", "t_start_s", "t_end_s", "block_lo", "block_hi", hm.key])
        for r in range(hm.rows):
            ts = (hm.t0_ns + r * hm.ns_per_row) / 1e9
            for c in range(hm.cols):
                lo, hi = hm.col_blocks(c)
                w.writerow([r, c, f"{ts:.6f}", f"{ts + hm.ns_per_row / 1e9:.6f}", lo, hi,
                            int(hm.cells[r, c])])


def _header(rep: Report) -> Text:
    t, m = rep.trace, rep.trace.meta
    text = Text()
    text.append(f"{t.path}\n", style="bold")
    release = (m['kernel'].split() + ["?", "?"])[1]  # "Linux RELEASE VERSION"
    text.append(f"recorded {m['created_utc']} on {m['host']} ({release})\n")
    text.append(f"{rep.duration_ns() / 1e9:.1f} s, {len(rep.ops.ops):,} ops, "
                f"{rep.ops.values_decoded:,} index values\n")
    for pid, p in sorted(t.processes.items()):
        ids = ", ".join(f"{f['path'].rsplit('/', 1)[-1]} build-id {(f.get('build_id') or '?')[:12]}"
                        for f in p.get("probe_files", []))
        proc = rep.agg.processes.get(pid)
        who = live.describe(proc) if proc is not None else f"pid {pid} ({p.get('comm', '?')})"
        text.append(f"{who}: {ids}\n")
    text.append("stream: ")
    text.append("complete" if not rep.reasons else "NOT complete: " + "; ".join(rep.reasons),
                style="green" if not rep.reasons else "bold red")
    return text


def _bar(v, top, width=16):
    return "*" * max(1 if v else 0, round(width * v / top)) if top else ""


def _moves_histograms(rep: Report, width: int) -> list:
    parts = []
    for p in sorted(rep.agg.processes.values(), key=lambda p: p.pid):
        for kind, arr in p.moves.items():
            if arr.any():
                parts += [Text(f"pid {p.pid}: {kind} per block, all layers", style="bold"),
                          live.histogram(arr, width, rows=4, what=kind)]
    return parts


def _rates_table(rates: dict) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False,
              title=f"calls/s per {rates['bin_s']:.3g} s, all layers",
              title_justify="left", title_style="bold")
    t.add_column("from s", justify="right")
    ops = list(rates["calls_per_s"])
    for op in ops:
        t.add_column(op, justify="right")
    nbins = len(next(iter(rates["calls_per_s"].values()), []))
    digits = max(0, 1 - int(np.floor(np.log10(rates["bin_s"])))) if rates["bin_s"] > 0 else 0
    for i in range(nbins):
        t.add_row(f"{(rates['t0_ns'] / 1e9 + i * rates['bin_s']):.{digits}f}",
                  *(live._rate(rates["calls_per_s"][op][i]) for op in ops))
    return t


def _distribution(title: str, pairs: list, unit: str) -> Table:
    """Value counts bucketed in log2 ranges (exact counts)."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left",
              title_style="bold")
    for col in (unit, "generations", ""):
        t.add_column(col, justify="right" if col != "" else "left")
    if not pairs:
        return t
    v = np.array([p[0] for p in pairs])
    n = np.array([p[1] for p in pairs])
    slot = _log2_slot(v)
    agg = np.bincount(slot, weights=n).astype(np.int64)
    top = agg.max()
    for s in np.flatnonzero(agg):
        lo, hi = (0, 0) if s == 0 else (1 << (s - 1), (1 << s) - 1)
        t.add_row(f"{lo}-{hi}", f"{agg[s]:,}", _bar(agg[s], top))
    return t


def _mean(a: np.ndarray) -> float:
    """The mean, or NaN for none (which numpy would warn about)."""
    return float(a.mean()) if len(a) else float("nan")


GENERATION_MEANS = ("generation: one use of a block, from a write at its offset 0 (or a "
                    "copy or swap into it) to the block's next such start")


def _occupancy_view(rep: Report, layer: int, width: int) -> list:
    parts = []
    src = rep.occupancy_source
    by_pid = {}
    for (pid, cache_id), g in rep.gens.items():
        by_pid.setdefault(pid, []).append((rep.layers[(pid, cache_id)], g))
    for pid, layers in sorted(by_pid.items()):
        layers.sort(key=lambda x: x[0])
        chosen = [g for n, g in layers if n == layer]
        if not chosen:
            parts.append(Text(f"pid {pid}: no layer {layer}", style="yellow"))
            continue
        g = chosen[0]
        same = sum(1 for _, o in layers if np.array_equal(o.fill, g.fill)
                   and np.array_equal(o.block, g.block))
        parts.append(occupancy_panel(g, src, f"pid {pid}, layer {layer}",
                                     f"{same} of {len(layers)} layers have the same generations",
                                     width))
    return parts


def occupancy_panel(g: occupancy.Generations, src: occupancy.Source, where: str, note: str,
                    width: int) -> Panel:
    """One layer's generations, named by src (occupancy.Source), its caveat
    at the top: the figures mean what the source can see."""
    fill = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=src.fill,
                 title_justify="left", title_style="bold")
    for col in ("tokens", "fill", "generations", ""):
        fill.add_column(col, justify="right" if col != "" else "left")
    hist = g.fill_hist
    top = hist.max() if len(hist) else 0
    for tok in np.flatnonzero(hist):
        fill.add_row(str(tok), f"{tok / g.block_size:.0%}", f"{hist[tok]:,}",
                     _bar(hist[tok], top))
    frag = g.fragmentation
    spark = Text()
    if g.steps:
        bins = min(g.steps, max(10, width - 20))
        edges = np.linspace(0, g.steps, bins + 1).astype(int)
        for a, b in zip(edges[:-1], edges[1:]):
            seg = frag[a:max(b, a + 1)]
            seg = seg[~np.isnan(seg)]
            spark.append(live._BARS[int(round(seg.mean() * 8))] if len(seg) else " ",
                         style="magenta")
    mean = float(np.nanmean(frag)) if np.any(~np.isnan(frag)) else float("nan")
    body = []
    if src.caveat:
        body.append(Text(src.caveat + " (docs/occupancy.md)", style="yellow"))
    body += [Text(f"{len(g):,} generations (" + ", ".join(
                f"{int(np.count_nonzero(g.kind == i)):,} by {k}"
                for i, k in enumerate(occupancy.KINDS) if np.any(g.kind == i)) +
                f"); mean {src.fill} {_mean(g.fill) / g.block_size:.1%} of {g.block_size} "
                f"tokens; most writes in one generation: {g.max_writes}"
                + (" (more than block_size!)" if g.max_writes > g.block_size else "")),
             Text(note), fill,
             Text(f"{src.fragmentation}, over {g.steps:,} steps (mean {mean:.1%}; "
                  "bar height 0-100%)", style="bold"), spark]
    grid = Table.grid(padding=(0, 4))
    span, gap = (x.split(" (")[0] for x in (src.span, src.gap))
    grid.add_row(_distribution(span, _value_counts(g.lifetime_steps), "steps"),
                 _distribution(gap, _value_counts(g.reuse_steps[g.reuse_steps >= 0]), "steps"))
    body.append(grid)
    body.append(Text(f"{GENERATION_MEANS}. {src.span}; {src.gap}.", style="dim"))
    if g.incomplete_ops:
        body.append(Text(f"{g.incomplete_ops} ops left out (values lost)", style="red"))
    return Panel(Group(*body), title=f"{src.title}: {where}", title_align="left", width=width)


def render(rep: Report, hm: heatmap.Heatmap, rates: dict, width: int, layer: int) -> Group:
    parts = [_header(rep),
             live.render(rep.agg, None, title="per-block histograms (from the stream)",
                         elapsed=rep.duration_ns() / 1e9, width=width)]
    parts += _moves_histograms(rep, max(10, width - 12))
    if rates["calls_per_s"]:
        parts.append(_rates_table(rates))
    parts += [Text(f"{hm.what}: time (rows) x blocks (columns)", style="bold"),
              heatmap.render(hm)]
    parts += access_view(access_figures(rep), width)
    parts += lifecycle_view(rep.lifecycle, width)
    parts += _occupancy_view(rep, layer, width)
    return Group(*parts)


# --resol and --time-range bounds: the heatmap has at most 4M cells (32 MB),
# and times x rows stay within an int64: a span of 2 x tracefile.MAX_SPAN_NS
# (2**53) times fewer than 1024 rows
MAX_ROWS, MAX_COLS = 1000, 4096


def check_args(args):
    """Bad flag values, found before the trace is read (it may be large)."""
    if args.resol and not (0 < args.resol[0] <= MAX_ROWS and 0 < args.resol[1] <= MAX_COLS):
        raise UsageError(f"--resol ROWS COLS needs 1 <= ROWS <= {MAX_ROWS} and "
                         f"1 <= COLS <= {MAX_COLS}")
    if args.time_range:
        start, end = args.time_range
        if not 0 <= start < end <= tracefile.MAX_SPAN_NS / 1e9:
            raise UsageError("--time-range START END needs 0 <= START < END <= "
                             f"{tracefile.MAX_SPAN_NS / 1e9:.0f} seconds")
    if args.block_range and not 0 <= args.block_range[0] <= args.block_range[1] < \
            tracefile.MAX_BLOCKS:
        raise UsageError(f"--block-range LO HI needs 0 <= LO <= HI < {tracefile.MAX_BLOCKS}")
    if args.table != "blocks" and args.format != "csv":
        raise UsageError("--table goes with --format csv")


@contextlib.contextmanager
def no_cycle_collection():
    """The cyclic garbage collector paused: the report makes a million
    Python objects (every request's events, in JSON) and keeps them all,
    so its full collections, each a walk over every object alive, found
    nothing and took 0.54 s of row 6's JSON report (and held the GIL from
    the other thread meanwhile).  Reference counting still frees what
    the report drops; the collector is back on when the report is done
    (the fuzz tests run it many times in one process)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run(args) -> int:
    with no_cycle_collection():
        return _run(args)


def _run(args) -> int:
    check_args(args)
    trace = tracefile.load(args.file, partial=args.partial,
                           warn=lambda m: print(f"kvtrace-bpf: {m}", file=sys.stderr))
    # the plugin tier's figures: every request's in JSON, the first few in
    # the terminal, none in CSV (no table has them)
    console = Console(highlight=False)
    width = min(console.width, 120)

    def views(rep):  # the heatmap and the rates: Report computes them meanwhile
        if args.resol:
            rows, cols = args.resol
        else:
            t0, t1 = rep.span_ns() if args.time_range is None else \
                (int(args.time_range[0] * 1e9), int(args.time_range[1] * 1e9))
            rows, cols = 20, width - heatmap.label_width(t0, t1)
        hm = rep.heatmap(rows, cols, args.time_range, args.block_range,
                         exact_cols=bool(args.resol), kind=args.kind)
        rates = rep.op_rates(time_range=args.time_range)
        # JSON: the document but the plugin tier's figures, serialized while
        # those are computed (row 6's trace: 0.25 s that followed them)
        parts = json_parts(document(rep, hm, rates)) if args.format == "json" else None
        return hm, rates, parts

    rep = Report(trace, args.pid, with_lifecycle=args.format != "csv",
                 timelines=LIFE_SHOWN_REQUESTS if args.format == "text" else None,
                 meanwhile=views, access_as=_json_fragment if args.format == "json" else None)
    hm, rates, parts = rep.meanwhile
    if args.format == "json":
        # everything is made: the file's pages are let go beside the writing
        threading.Thread(target=trace.let_go_of_pages, daemon=True).start()
        write_json({**parts, "lifecycle": rep.lifecycle}, sys.stdout)
    elif args.format == "csv":
        write_csv(rep, args.table, hm, sys.stdout)
    else:
        wide = hm.cols + heatmap.label_width(hm.t0_ns, hm.t1_ns)
        if wide > console.width:
            # --resol is honoured exactly, even wider than the terminal
            # (without it the map is never wider: cols come from the width)
            console = Console(highlight=False, width=wide)
        console.print(render(rep, hm, rates, width, args.layer))
    return 0
