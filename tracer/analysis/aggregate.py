"""Turn a raw copy of the BPF maps into per-block histograms (numpy).

Pure logic: no bcc here, so views, exporters and tests can use it on any
machine.  The input is Tracer.read_maps()'s dict; the output is an Aggregate,
which also knows how to say whether its counts are exact and how to become
the --json document (docs/json-schema.md).
"""

from dataclasses import dataclass, field

import numpy as np

from .. import abi

JSON_SCHEMA = "kvtrace-bpf/aggregate"
JSON_VERSION = 1

# the ops whose probes carry a byte count (copies and swaps); elsewhere
# "bytes" is not measured
# the per-request totals of the plugin tier (struct kvtrace_request), as JSON
REQUEST_FIELDS = ("first_ns", "last_ns", "finish_ns", "prompt_tokens", "output_tokens",
                  "preemptions", "recomputed")
BYTES_OPS = frozenset(("copy_blocks", "swap_blocks", "swap_blocks_batch"))

OP_COUNTERS = ("calls", "items", "slots", "padding", "bytes", "truncated",
               "read_errors", "out_of_range")


@dataclass
class Layer:
    """One KV cache (one layer) of one process."""

    pid: int
    layer: int  # order of first appearance in the process
    cache_id: int
    index: int
    op: str
    block_size: int
    num_blocks: int
    calls: int
    slots: int
    padding: int
    out_of_range: int
    writes: np.ndarray  # uint64 per block: slots written into it
    # Block generations ended while attached, by tokens held (index = fill;
    # the last bin: that many or more); None where nothing counts them (a
    # trace file).  unseen: ended generations whose start the tracer did
    # not see, not in fill_ended; skipped: runs of slots whose fill may be
    # off (bpf/kvtrace.h struct kvtrace_fill_row)
    fill_ended: np.ndarray = None
    fill_unseen: int = 0
    fill_skipped: int = 0


GROUP_COUNTERS = ("steps", "layer_calls", "requests", "tokens", "reads", "distinct",
                  "held_tokens", "null_entries", "out_of_range", "truncated", "read_errors")


@dataclass
class ReadGroup:
    """Reads of one KV-cache group of one process (the vllm:block_table
    probe, docs/access.md).  Counted once per step for the group, at its
    leader layer; per-layer reads are reads x layers."""

    pid: int
    group: int  # order of first appearance in the process
    group_id: int
    index: int
    block_size: int
    num_blocks: int
    steps: int        # forward steps seen (tables read)
    layer_calls: int  # calls of all the group's layers
    requests: int     # request rows, summed over steps
    tokens: int       # seq_len summed over rows and steps
    reads: int        # (request, block) reads, summed over steps
    distinct: int     # distinct blocks read per step, summed over steps
    held_tokens: int  # tokens in those blocks, summed over steps
    null_entries: int
    out_of_range: int
    truncated: int
    read_errors: int
    reads_per_block: np.ndarray  # uint64 per block
    last_read_step: np.ndarray   # uint64 per block: step of its last read, 0 never

    @property
    def layers(self) -> int:
        """Layers calling per step: layer_calls / steps, a whole number.
        Every layer of a step reads the same table, but counters read while
        a step is under way (attach's refresh) or a trace that begins or
        ends inside one count some of its layers' calls and not the rest:
        the ratio is then off by less than one step's layers, and rounded
        (layers_note says so)."""
        return max(1, round(self.layer_calls / self.steps)) if self.steps else 0

    @property
    def layers_note(self):
        """Why layer_calls is not layers x steps, or None where it is."""
        if not self.steps or self.layer_calls == self.layers * self.steps:
            return None
        return (f"{self.layer_calls:,} layer calls over {self.steps:,} steps: steps under "
                "way when counted")


@dataclass
class Process:
    pid: int
    comm: str
    layers: list = field(default_factory=list)
    ops: dict = field(default_factory=dict)  # op -> {counter: n}
    moves: dict = field(default_factory=dict)  # move kind -> uint64 per block
    probe_files: list = field(default_factory=list)
    tier: str = ""  # 'usdt', 'uprobe' (stock vLLM) or 'none'
    parent: int = 0  # the traced process's parent pid (0: the root)
    calls_only: bool = False  # stock uprobes without a tensor layout
    # the kvtrace vLLM plugin's install outcome in it, one line
    # (docs/plugin.md, "What the tracer is told"); None without the plugin
    plugin_status: str = None
    # op names with a probe site attached in this process; None: not known
    # (a trace file from before they were kept).  An op outside it shows
    # "not probed on this build", not a 0 that reads as "did not happen".
    probed_ops: list = None
    groups: list = field(default_factory=list)  # ReadGroup: reads per KV-cache group
    # the plugin tier: lifecycle kind (abi.LIFE) -> uint64 per block, and
    # the per-request totals (dicts as session.read_maps gives them)
    life: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return max([len(l.writes) for l in self.layers] +
                   [len(m) for m in self.moves.values()] + [0])

    @property
    def tokens(self) -> np.ndarray:
        """Per block, the writes of the layer that wrote it most.

        Every layer of a step sees the same slot mapping, so this is the
        number of tokens written into the block, counted once and not once
        per layer (models whose layers differ in groups get the busiest one).
        """
        out = np.zeros(self.num_blocks, dtype=np.uint64)
        for layer in self.layers:
            np.maximum(out[:len(layer.writes)], layer.writes, out=out[:len(layer.writes)])
        return out

    @property
    def all_layer_writes(self) -> np.ndarray:
        out = np.zeros(self.num_blocks, dtype=np.uint64)
        for layer in self.layers:
            out[:len(layer.writes)] += layer.writes
        return out


def _trim(arr: np.ndarray, length: int) -> np.ndarray:
    """arr cut to `length` entries, or to its last non-zero one if unknown."""
    if length <= 0:
        nz = np.flatnonzero(arr)
        length = int(nz[-1]) + 1 if len(nz) else 0
    return arr[:length]


@dataclass
class Aggregate:
    time: float
    processes: dict  # pid -> Process
    log2: dict  # op -> {log2 slot: ops}
    globals: dict
    records: int
    lost: int

    @classmethod
    def from_maps(cls, raw: dict, comms: dict = None, probe_files: dict = None,
                  proc_info: dict = None):
        """proc_info: {pid: {"tier", "parent", "calls_only"}} (Process fields)."""
        comms, probe_files, proc_info = comms or {}, probe_files or {}, proc_info or {}
        procs = {}

        def proc(pid):
            if pid not in procs:
                procs[pid] = Process(pid, comms.get(pid, "?"),
                                     probe_files=list(probe_files.get(pid, [])),
                                     **proc_info.get(pid, {}))
            return procs[pid]

        for pid in raw.get("moves", {}):
            proc(pid)
        for pid, rows in raw.get("life", {}).items():
            if rows.any():  # processes without the plugin have no rows to show
                proc(pid).life = {kind: _trim(rows[i], 0) for i, kind in enumerate(abi.LIFE)}
        for r in raw.get("requests", []):
            proc(r["pid"]).requests.append(r)
        by_pid = {}
        for c in raw["caches"]:
            by_pid.setdefault(c["pid"], []).append(c)
        for pid, caches in by_pid.items():
            for n, c in enumerate(sorted(caches, key=lambda c: c["index"])):
                nb = int(c["num_blocks"])
                writes = c.get("writes")
                writes = (_trim(writes, min(nb, len(writes))) if writes is not None
                          else np.zeros(0, dtype=np.uint64))
                proc(pid).layers.append(Layer(
                    pid, n, int(c["cache_id"]), int(c["index"]), c["op"],
                    int(c["block_size"]), nb, int(c["calls"]), int(c["slots"]),
                    int(c["padding"]), int(c["out_of_range"]), writes,
                    c.get("fill_ended"), int(c.get("fill_unseen", 0)),
                    int(c.get("fill_skipped", 0))))
        by_pid = {}
        for g in raw.get("groups", []):
            by_pid.setdefault(g["pid"], []).append(g)
        for pid, groups in by_pid.items():
            for n, g in enumerate(sorted(groups, key=lambda g: g["index"])):
                nb = int(g["num_blocks"])
                arrays = []
                for name in ("reads_per_block", "last_read_step"):
                    a = g.get(name)
                    arrays.append(_trim(a, min(nb, len(a))) if a is not None
                                  else np.zeros(0, dtype=np.uint64))
                proc(pid).groups.append(ReadGroup(
                    pid, n, int(g["group_id"]), int(g["index"]), int(g["block_size"]), nb,
                    *(int(g[k]) for k in GROUP_COUNTERS), *arrays))
        for (pid, op), st in raw["op_stats"].items():
            proc(pid).ops[op] = {k: int(st.get(k, 0)) for k in OP_COUNTERS}
        for pid, rows in raw.get("moves", {}).items():
            p = proc(pid)
            length = max([l.num_blocks for l in p.layers] + [0])
            for kind, i in abi.MOVES.items():
                p.moves[kind] = _trim(rows[i], min(length, len(rows[i])) if length else 0)
        return cls(raw["time"], procs, raw["log2"], raw["globals"], raw["records"], raw["lost"])

    # -- totals and honesty ------------------------------------------------

    def op_totals(self) -> dict:
        totals = {}
        for p in self.processes.values():
            for op, st in p.ops.items():
                t = totals.setdefault(op, dict.fromkeys(OP_COUNTERS, 0))
                for k in OP_COUNTERS:
                    t[k] += st[k]
        return {op: totals[op] for op in sorted(totals, key=lambda o: abi.OPS.get(o, 99))}

    def inexact_reasons(self) -> list:
        """Why the per-block counts may differ from what the target did.

        Lost perf records are not a reason: the counts never come from them.
        """
        reasons = []
        if self.globals.get("empty_program"):
            reasons.append("KVTRACE_EMPTY_PROGRAM was set: the probes ran an empty program "
                           "and counted nothing")
        for p in self.processes.values():
            if p.calls_only:
                reasons.append(f"pid {p.pid}: torch's tensor layout is unknown, so its ops "
                               "are counted as calls only")
            status = p.plugin_status or ""
            if status.startswith("untested "):
                # the plugin's events are checked against a release's block
                # pool only for the releases of its conformance run
                reasons.append(f"pid {p.pid}: plugin tier on an {status.split('; ')[0]}")
            if "; not exact here: " in status:
                # a configuration whose pool changes the plugin does not report
                reasons.append(f"pid {p.pid}: plugin tier not exact here: "
                               + status.split("; not exact here: ", 1)[1])
        totals = self.op_totals()
        for key, what in (("truncated", "items beyond the per-op read limit"),
                          ("read_errors", "index arrays that could not be read"),
                          ("out_of_range", "blocks beyond --max-blocks")):
            n = sum(t[key] for t in totals.values())
            if n:
                reasons.append(f"{n} {what}")
        if self.globals.get("cache_full"):
            reasons.append(f"{self.globals['cache_full']} layers beyond --max-layers")
        if self.globals.get("group_full"):
            reasons.append(f"{self.globals['group_full']} KV-cache groups beyond the "
                           "read rows (their reads are not counted per block)")
        if self.globals.get("request_full"):
            reasons.append(f"{self.globals['request_full']} lifecycle events of requests "
                           "beyond the requests map (counted per block, not per request)")
        kept = sum(len(p.requests) for p in self.processes.values())
        if self.globals.get("requests_seen", 0) > kept:
            reasons.append(f"{self.globals['requests_seen'] - kept} requests' totals were "
                           "evicted from the requests map (least recently active first; "
                           "their blocks are counted per block)")
        skipped = sum(l.fill_skipped for p in self.processes.values() for l in p.layers)
        if skipped:
            reasons.append(f"{skipped} runs of slots whose block generations' fill may be off "
                           "(slots not consecutive, or an op beyond the read limit)")
        if self.globals.get("missed_hits"):
            reasons.append(f"{self.globals['missed_hits']} probe hits the kernel skipped "
                           "(another BPF program was running on that CPU)")
        return reasons

    # -- JSON ----------------------------------------------------------------

    def to_json(self, **meta) -> dict:
        def sparse(arr):
            # [[block, count], ...] of the counts that are not 0, as Python
            # ints: two tolist() calls, not a numpy scalar per value
            nz = np.flatnonzero(arr)
            counts = arr[nz] if arr.dtype.kind in "iu" else arr[nz].astype(np.int64)
            return [[b, n] for b, n in zip(nz.tolist(), counts.tolist())]

        def log2_rows(hist):
            return [[*log2_range(s), int(hist[s])] for s in sorted(hist)]

        def measured(ops):
            # only moves carry a byte count: a write op's bytes are unknown
            # (null), not zero
            return {op: {k: (v if k != "bytes" or op in BYTES_OPS else None)
                          for k, v in st.items()} for op, st in ops.items()}

        procs = []
        for p in sorted(self.processes.values(), key=lambda p: p.pid):
            procs.append({
                "pid": p.pid, "comm": p.comm, "parent": p.parent, "tier": p.tier,
                "calls_only": p.calls_only, "plugin_status": p.plugin_status,
                "probe_files": p.probe_files,
                "probed_ops": sorted(p.probed_ops) if p.probed_ops is not None else None,
                "ops": measured(p.ops),
                "layers": [{
                    "layer": l.layer, "cache_id": l.cache_id, "op": l.op,
                    "block_size": l.block_size, "num_blocks": l.num_blocks,
                    "calls": l.calls, "slots": l.slots, "padding": l.padding,
                    "out_of_range": l.out_of_range, "writes": sparse(l.writes),
                } for l in p.layers],
                "groups": [{
                    "group": g.group, "group_id": g.group_id, "block_size": g.block_size,
                    "num_blocks": g.num_blocks,
                    **{k: getattr(g, k) for k in GROUP_COUNTERS},
                    "reads_per_block": sparse(g.reads_per_block),
                    "last_read_step": sparse(g.last_read_step),
                } for g in p.groups],
                "blocks": {"num_blocks": p.num_blocks, "tokens": sparse(p.tokens),
                           **{k: sparse(v) for k, v in p.moves.items()}},
                "lifecycle": {
                    "blocks": {k: sparse(v) for k, v in p.life.items()},
                    "totals": {k: int(v.sum()) for k, v in p.life.items()},
                    "requests": [{
                        "req": f"{r['req']:016x}", "id": r["id"],
                        **{k: r[k] for k in REQUEST_FIELDS}, "blocks": r["blocks"],
                    } for r in sorted(p.requests, key=lambda r: (r["first_ns"], r["req"]))],
                } if p.life or p.requests else None,
            })
        reasons = self.inexact_reasons()
        return {
            "schema": JSON_SCHEMA, "version": JSON_VERSION, **meta,
            "records": self.records, "lost_records": self.lost,
            "exact": not reasons, "inexact_reasons": reasons,
            "dropped": {"foreign_process_hits": self.globals.get("foreign", 0),
                        "unknown_site_hits": self.globals.get("no_site", 0)},
            "ops": measured(self.op_totals()),
            "items_log2": {op: log2_rows(h) for op, h in sorted(self.log2.items())},
            "processes": procs,
        }


def log2_range(slot: int):
    """The values bcc's bpf_log2l() puts in `slot`: floor(log2 v) + 1, with
    0 and 1 both in slot 1."""
    return (0 if slot <= 1 else 1 << (slot - 1)), (1 << slot) - 1


def bucket(counts: np.ndarray, nbuckets: int):
    """Sum counts into at most nbuckets equal runs of blocks.

    Returns (sums, blocks_per_bucket)."""
    n = len(counts)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), 1
    per = max(1, -(-n // max(1, nbuckets)))
    starts = np.arange(0, n, per)
    return np.add.reduceat(counts.astype(np.uint64), starts), per


def rates(now: "Aggregate", before: "Aggregate") -> dict:
    """Per-op calls/s and items/s between two aggregates."""
    dt = now.time - before.time
    if dt <= 0:
        return {}
    a, b = now.op_totals(), before.op_totals()
    zero = dict.fromkeys(OP_COUNTERS, 0)
    return {op: {"calls": (a[op]["calls"] - b.get(op, zero)["calls"]) / dt,
                 "items": (a[op]["items"] - b.get(op, zero)["items"]) / dt}
            for op in a}
