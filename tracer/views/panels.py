"""The terminal views: the per-process panels of an aggregate, drawn live by
`attach`, in its summary, and in `report`'s per-block section.

render() is a pure function of Aggregates, so it is unit-tested with a
fixed-width Console; attach only decides when to call it.  Words on screen
are those of docs/glossary.md; every count says whether it is per layer or
summed over all layers.

A process's panel is built from PROCESS_PANELS, a list of functions
(process, width, full, seen) -> list of renderables (empty: nothing to
show); full: every part (the summary, attach --full), else the live
view's short form; seen: what earlier panels of the frame drew.  Reads
(the block_table probe) slot in as one more entry, reads_panel, which draws
from Process.groups when the aggregate has them.
"""

import os

import numpy as np
from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import abi
from ..analysis import access_counters, aggregate, heatmap
from ..analysis.aggregate import Aggregate, bucket, log2_range, rates

_BARS = " ▁▂▃▄▅▆▇█"
HIST_ROWS = 6
# The live view by default (attach without --full) fits a 50-row terminal
# with two traced processes (vLLM's engine core and its worker): shorter
# histograms, the hottest blocks on one line, and the tables that only the
# summary needs (the hottest blocks', copies and swaps, items per op) left
# to --full and the summary at the end.
COMPACT_ROWS = 3
FIT_ROWS = 50
LABEL = 6  # the y-axis label's width, left of the bars

# ops that move whole blocks: their "items" are block pairs (batch: entries),
# and only they carry a byte count (docs/glossary.md)
MOVE_OPS = ("copy_blocks", "swap_blocks", "swap_blocks_batch")
BYTES_OPS = aggregate.BYTES_OPS
# which op fills which per-block move counter (bpf/kvtrace.bpf.c)
MOVE_SOURCE = {"copy_src": "copy_blocks", "copy_dst": "copy_blocks",
               "swap_out": "swap_blocks", "swap_in": "swap_blocks"}
NOT_PROBED = "not probed on this build"

# What "exact" promises, and what breaks it (Aggregate.inexact_reasons):
# printed under every view where the verdict is shown.
EXACT_MEANS = ("exact: the per-block counters hold every slot of every probe hit. Not "
               "exact if an op is truncated, an index array unreadable, a block beyond "
               "--max-blocks, a layer beyond --max-layers, or a hit skipped by the kernel; "
               "lost perf records never change the counts.")
LEGEND = ("tokens: per layer (the busiest layer; each token once). slots, padding, pairs: "
          "summed over all layers. padding: negative slot-mapping entries (batch "
          "padding), nothing written. pairs: blocks moved (swap_blocks_batch: entries). "
          "items per op: tokens of one call (one layer), or its pairs.")

SHORT_LEGEND = ("tokens: per layer; slots, padding, pairs: all layers; exact: every slot "
                "of every probe hit (the summary and docs/glossary.md say more)")


# The width a view is drawn at where stdout is no terminal (a pipe, a
# file): rich's own default there, 80 columns, wrapped the report's tables
# and lines that the views draw for up to 120.  COLUMNS, when set, wins.
PIPE_WIDTH = 120


def output_console() -> Console:
    """A Console for stdout: a terminal's own width, else COLUMNS, else
    PIPE_WIDTH."""
    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        console = Console(highlight=False, width=PIPE_WIDTH)
    return console


def _n(x) -> str:
    return f"{int(x):,}"


def _rate(x) -> str:
    x = float(x)
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _bytes(x) -> str:
    x = float(x)
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{int(x)}B"


def ops_probed_anywhere(agg: Aggregate):
    """The ops that have a probe site in some traced process, or None when
    the aggregate does not say (a trace file written before it was kept)."""
    known = [p.probed_ops for p in agg.processes.values() if p.probed_ops is not None]
    if not known:
        return None
    return set().union(*known)


def traced_anything(agg: Aggregate) -> bool:
    return any(st["calls"] for st in agg.op_totals().values())


def ops_table(agg: Aggregate, prev: Aggregate = None, elapsed: float = 0.0,
              width: int = 100, full: bool = True) -> Table:
    """Ops with their call rates: over the last refresh interval (live, with
    a previous aggregate), or the mean over the whole run (a summary).
    Counts are printed whole, never rounded; a narrow terminal drops the
    padding column instead."""
    if prev is not None:
        r = rates(agg, prev)
        basis = f"last {agg.time - prev.time:.1f}s"
    else:
        r = {op: {"calls": st["calls"] / elapsed}
             for op, st in agg.op_totals().items()} if elapsed > 0 else {}
        basis = "mean"
    totals = agg.op_totals()
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, collapse_padding=True,
              title="ops, all processes", title_justify="left", title_style="bold",
              show_edge=full)
    t.add_column("op", no_wrap=True, min_width=len("cpu_attn_reshape_and_cache"))
    heads = {"calls": "calls", "calls/s": f"calls/s\n{basis}", "slots": "slots\nall layers",
             "padding": "padding\nall layers", "pairs": "pairs\nmoved", "bytes": "bytes\nmoved",
             "blocks": "blocks\n(plugin)"}
    cols = ["calls", "calls/s", "slots", "padding"]
    if width < 100:
        cols.remove("padding")
    if any(op in MOVE_OPS for op in totals):
        cols.append("pairs")
    if any(op in abi.LIFE_OPS for op in totals):
        cols.append("blocks")
    cols.append("bytes")
    for col in cols:
        t.add_column(heads[col], justify="right", no_wrap=True)
    for op, st in totals.items():
        rr = r.get(op, {})
        writes = op in abi.WRITE_OPS
        # a write op moves nothing, a move (or a read op) writes no slots:
        # "-", not a 0 that reads as "measured, none"
        cells = {"calls": _n(st["calls"]), "calls/s": _rate(rr.get("calls", 0)),
                 "slots": _n(st["slots"]) if writes else "-",
                 "padding": _n(st["padding"]) if writes else "-",
                 "pairs": _n(st["items"]) if op in MOVE_OPS else "-",
                 # lifecycle events: the block ids counted (null ids not)
                 "blocks": _n(st["slots"]) if op in abi.LIFE_OPS else "-",
                 "bytes": _bytes(st["bytes"]) if op in BYTES_OPS else "-"}
        t.add_row(op, *(cells[c] for c in cols))
    if not t.row_count:
        t.add_row("(no ops yet)", *("" for _ in cols))
    return t


def not_probed_line(agg: Aggregate) -> Text:
    """The ops no traced process has a probe site for: their absence from
    the table means "not seen", not "none happened"."""
    probed = ops_probed_anywhere(agg)
    if probed is None:
        return None
    missing = [op for op in abi.OPS if op not in probed]
    if not missing or not agg.processes:
        return None
    return Text(f"{NOT_PROBED}: " + ", ".join(missing), style="dim")


def histogram(counts: np.ndarray, width: int, rows: int = HIST_ROWS, what: str = "tokens",
              block_range: tuple = None, full: bool = True) -> Text:
    """A vertical bar chart of counts per block, bucketed to at most `width`
    columns.  By default it zooms to the blocks in use (heatmap.block_window); a
    block_range (lo, hi inclusive) overrides.  The footer says which blocks
    are drawn and what one column's height sums (not full: on one line)."""
    n = len(counts)
    if not n or not counts.any():
        return Text(f"(no {what} yet)", style="dim")
    lo, hi = heatmap.block_window(counts) if block_range is None else block_range
    sums, per = bucket(counts[lo:hi + 1], width)
    top = int(sums.max())
    text = Text()
    # eighths of a row per column
    heights = np.ceil(sums.astype(float) / max(top, 1) * rows * 8).astype(int)
    for r in range(rows - 1, -1, -1):
        line = "".join(_BARS[min(8, max(0, h - r * 8))] for h in heights)
        label = _rate(top) if r == rows - 1 else ""
        text.append(f"{label:>{LABEL}} ", style="dim")
        text.append(line + "\n", style="green")
    axis = f"{lo}{'':{max(1, len(sums) - len(str(lo)) - len(str(hi)))}}{hi}"
    text.append(f"{'':>{LABEL}} {axis}\n", style="dim")
    shown = f"blocks {lo}-{hi} of {n}" + (" (zoomed to those in use)"
                                           if (lo, hi) != (0, n - 1) and block_range is None
                                           else "")
    height = (f"{what} per block" if per == 1 else
              f"{what} summed over {per} blocks per column")
    sep = f"\n{'':>{LABEL}} " if full else "; "
    text.append(f"{'':>{LABEL}} {shown}{sep}height: {height}; top {_n(top)}",
                style="dim")
    return text


def most_written_blocks(proc, top: int = 8) -> Table:
    tokens = proc.tokens
    all_layers = proc.all_layer_writes
    probed = proc.probed_ops
    cols = [("block", None), ("tokens", None), ("all layers", None),
            ("copy src/dst", "copy_blocks"), ("swap out/in", "swap_blocks")]
    # a move column only where its op is probed (or nobody knows)
    cols = [c for c, op in cols if op is None or probed is None or op in probed]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in cols:
        t.add_column(col, justify="right")
    if not len(tokens):
        return t
    order = np.argsort(tokens, kind="stable")[::-1][:top]

    def mv(kind, b):
        arr = proc.moves.get(kind)
        return int(arr[b]) if arr is not None and b < len(arr) else 0

    for b in order:
        if tokens[b] == 0:
            break
        cells = {"block": str(b), "tokens": _n(tokens[b]), "all layers": _n(all_layers[b]),
                 "copy src/dst": f"{mv('copy_src', b)}/{mv('copy_dst', b)}",
                 "swap out/in": f"{mv('swap_out', b)}/{mv('swap_in', b)}"}
        t.add_row(*(cells[c] for c in cols))
    return t


def moves_table(proc) -> Table:
    """Copies and swaps per kind, for the kinds whose op is probed (or all,
    when that is not known)."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("move", "blocks moved", "distinct", "most on one"):
        t.add_column(col, justify="left" if col == "move" else "right")
    for kind, arr in proc.moves.items():
        if kind in unprobed_moves(proc):
            continue
        t.add_row(kind, _n(arr.sum()), _n(np.count_nonzero(arr)),
                  _n(arr.max()) if len(arr) else "0")
    return t


def unprobed_moves(proc) -> list:
    """Move kinds whose op has no probe site in this process."""
    if proc.probed_ops is None:
        return []
    return [k for k in proc.moves if MOVE_SOURCE.get(k) not in proc.probed_ops]


def moves_part(proc):
    head = Text("copies and swaps, all layers", style="bold")
    missing = unprobed_moves(proc)
    if missing and len(missing) == len(proc.moves):
        return Group(head, Text(f"{NOT_PROBED}:\ncopy_blocks, swap_blocks", style="dim"))
    parts = [head, moves_table(proc)]
    if missing:
        parts.append(Text(f"{', '.join(missing)}: {NOT_PROBED}", style="dim"))
    return Group(*parts)


def log2_table(agg: Aggregate) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="items per op (log2)",
              title_justify="left", title_style="bold")
    for col in ("op", "items", "ops", ""):
        t.add_column(col, justify="right" if col in ("ops",) else "left")
    for op, hist in sorted(agg.log2.items()):
        peak = max(hist.values()) if hist else 1
        for s in sorted(hist):
            lo, hi = log2_range(s)
            t.add_row(op, f"{lo} -> {hi}", _n(hist[s]), "*" * max(1, round(24 * hist[s] / peak)))
            op = ""
    return t


# -- a process's panel ----------------------------------------------------------

TIER_WORDS = {"plugin": "plugin USDT", "usdt": "fork USDT", "uprobe": "stock uprobe",
              "none": "no probes"}


def describe(proc) -> str:
    """pid, name, where it sits in the traced tree and how it is probed."""
    bits = [f"pid {proc.pid} ({proc.comm})"]
    if proc.parent:
        bits.append(f"child of {proc.parent}")
    if proc.tier:
        bits.append(TIER_WORDS.get(proc.tier, proc.tier))
    status = getattr(proc, "plugin_status", None)
    if status and not status.startswith("tested "):
        bits.append(status)  # "untested vLLM release X", or a refusal's reason
    return ", ".join(bits)


def is_idle(proc) -> bool:
    """No probe of this process has fired: nothing to draw for it."""
    return not proc.layers and not any(st["calls"] for st in proc.ops.values()) \
        and not any(a.any() for a in proc.moves.values()) \
        and not getattr(proc, "groups", None) \
        and not getattr(proc, "life", None) and not getattr(proc, "requests", None)


def writes_panel(proc, width: int, full: bool = True, seen: dict = None) -> list:
    """Tokens written per block, the hottest blocks, copies and swaps; not
    full: a shorter histogram, the hottest blocks on one line and the moves
    only where some happened."""
    if not proc.layers and not any(a.any() for a in proc.moves.values()):
        return []
    if not full:
        return compact_writes(proc, width)
    hot = Group(Text("hottest blocks: tokens per layer, slots of all layers", style="bold"),
                most_written_blocks(proc))
    moved = moves_part(proc)
    body = [Text("tokens written per block (per layer: the busiest layer)", style="bold"),
            histogram(proc.tokens, max(10, width - 12), what="tokens"), Text("")]
    if width >= 110:  # side by side only where both fit
        grid = Table.grid(padding=(0, 4))
        grid.add_row(hot, moved)
        body.append(grid)
    else:
        body += [hot, moved]
    return body


def compact_writes(proc, width: int) -> list:
    body = [Text("tokens written per block (per layer: the busiest layer)", style="bold"),
            histogram(proc.tokens, max(10, width - 12), rows=COMPACT_ROWS, what="tokens",
                      full=False)]
    tokens = proc.tokens
    if len(tokens) and tokens.any():
        order = np.argsort(tokens, kind="stable")[::-1][:6]
        body.append(Text("hottest block:tokens " + ", ".join(
            f"{b}:{_n(tokens[b])}" for b in order if tokens[b])))
    moved = [(k, int(a.sum())) for k, a in proc.moves.items()
             if k not in unprobed_moves(proc) and a.any()]
    if moved:
        body.append(Text("copies and swaps, all layers (blocks moved): " +
                         ", ".join(f"{k} {_n(n)}" for k, n in moved)))
    return body


def reads_panel(proc, width: int, full: bool = True, seen: dict = None) -> list:
    """Reads per block of each KV-cache group (the block_table probe), from
    Process.groups: a histogram of reads per block, the working set (blocks
    read at the last step against blocks read ever) and the hottest and
    coldest blocks.  Empty for a process without read groups.  Not full: a
    group an earlier panel drew (vLLM's engine core counts the group's reads
    from the plugin, its worker from the op) is one line with its own
    counts, and no coldest.  The same group: the same index, blocks and
    block size, not the same counts: the scheduler counts a step before its
    worker runs it, so mid-run they differ by the steps in flight (at the
    end they are equal, tests/test_e2e_plugin.py)."""
    groups = getattr(proc, "groups", None) or []
    body = []
    for g in groups:
        reads = np.asarray(g.reads_per_block, dtype=np.uint64)
        if not full and seen is not None:
            key = ("reads", g.group, len(reads), getattr(g, "block_size", None))
            if key in seen:
                body.append(Text(f"reads per block, group {g.group}: {_n(g.steps)} steps, "
                                 f"{_n(g.reads)} block reads (the same group as pid "
                                 f"{seen[key]}'s, drawn above)", style="bold"))
                continue
            seen[key] = proc.pid
        last = np.asarray(g.last_read_step, dtype=np.uint64)
        read_ever = int(np.count_nonzero(reads))
        # the working set now: blocks whose last read is the latest read step
        # (whatever base last_read_step counts from, the latest is the max)
        now = int(np.count_nonzero((reads > 0) & (last == last[reads > 0].max()))) \
            if read_ever else 0
        # a group's layers all read the same blocks at a step: counted once
        layers = getattr(g, "layers", 0)
        note = getattr(g, "layers_note", None)
        per = (f"the group's {layers} layer{'s' if layers != 1 else ''}"
               + (f"; {note}" if note else "") if layers else "all the group's layers")
        head = (f"reads per block, group {g.group}: {_n(g.steps)} steps, {_n(g.reads)} "
                f"block reads (once per step for {per})")
        body += [Text(head, style="bold"),
                 histogram(reads, max(10, width - 12), rows=4 if full else COMPACT_ROWS,
                           what="reads", full=full),
                 Text(f"working set: {_n(now)} blocks read at the last step, "
                      f"{_n(read_ever)} read at least once, of {_n(len(reads))}")]
        summ = access_counters.group_summary(g) if g.steps else None
        if summ is not None and summ["utilization"] is not None and len(last):
            # the true figure the write-derived occupancy cannot give: tokens
            # held in the blocks attention reads, over their capacity
            ages = access_counters.age_steps(last, int(last.max()))
            idle = ages[ages > 0]
            body.append(Text(
                f"live set: {summ['distinct_per_step']:,.1f} blocks a step (mean), "
                f"utilization {100 * summ['utilization']:.1f}% (tokens held / capacity), "
                f"sharing {summ['sharing']:.2f} requests a block; "
                f"{len(idle):,} blocks idle, median {np.median(idle) if len(idle) else 0:,.0f} "
                "steps since their last read"))
        if read_ever:
            order = np.argsort(reads, kind="stable")
            read = order[reads[order] > 0]
            hot = ", ".join(f"{b}:{_n(reads[b])}" for b in read[::-1][:6])
            # never a block of the hottest six: fewer than twelve blocks read
            # list fewer coldest
            cold = ", ".join(f"{b}:{_n(reads[b])}" for b in read[:max(0, len(read) - 6)][:6]) \
                or "-"
            body.append(Text(f"hottest block:reads {hot}" +
                             (f"\ncoldest read block:reads {cold}" if full else "")))
        problems = [f"{_n(getattr(g, k))} {what}" for k, what in (
            ("truncated", "entries truncated"), ("read_errors", "tables unreadable"),
            ("out_of_range", "entries beyond --max-blocks")) if getattr(g, k, 0)]
        if problems:
            body.append(Text("reads NOT exact: " + ", ".join(problems), style="bold red"))
    return body


# Each entry: (process, width) -> renderables; an empty list draws nothing.
LIFE_WORDS = {"alloc": "allocated", "hit": "prefix hits", "cache": "cached",
              "free": "freed", "evict": "evicted from the prefix cache"}


def lifecycle_panel(proc, width: int, full: bool = True, seen: dict = None) -> list:
    """The plugin tier (the scheduler's view): block events per kind, the
    share of the blocks requests needed that the prefix cache served, the
    requests and their preemptions, and the blocks hit most.  Empty for a
    process without the plugin's probes."""
    life = getattr(proc, "life", None) or {}
    reqs = getattr(proc, "requests", None) or []
    if not life and not reqs:
        return []
    totals = {k: int(np.asarray(v, dtype=np.uint64).sum()) for k, v in life.items()}
    line = Text("lifecycle (scheduler): ", style="bold")
    line.append(", ".join(f"{_n(totals.get(k, 0))} {w}" for k, w in LIFE_WORDS.items()))
    needed = totals.get("hit", 0) + totals.get("alloc", 0)
    if needed:
        # a request's blocks come from the prefix cache (hit) or the free
        # queue (alloc): the share served by the cache, in blocks
        line.append(f"\nprefix cache served {100 * totals.get('hit', 0) / needed:.1f}% of "
                    f"the {_n(needed)} blocks requests needed")
    body = [line]
    if reqs:
        done = sum(1 for r in reqs if r["finish_ns"])
        pre = sum(r["preemptions"] for r in reqs)
        rl = Text(f"requests: {_n(len(reqs))} seen, {_n(len(reqs) - done)} running, "
                  f"{_n(done)} finished, {_n(pre)} preemptions")
        if pre:
            rl.append(f" ({_n(sum(r['recomputed'] for r in reqs))} tokens to recompute)")
        body.append(rl)
    hits = np.asarray(life.get("hit", []), dtype=np.uint64)
    if hits.any() and full:
        top = np.argsort(hits, kind="stable")[::-1][:8]
        body.append(Text("hit most: " + "  ".join(
            f"b{int(b)} x{_n(hits[b])}" for b in top if hits[b]), style="dim"))
    return body


PROCESS_PANELS = [writes_panel, reads_panel, lifecycle_panel]


def process_panel(proc, width: int, full: bool = True, seen: dict = None) -> Panel:
    nl = len(proc.layers)
    # a process that only reads (the engine core's scheduler tables) has no
    # layer written, but its read panels are of a cache of blocks all the same
    nb = max([proc.num_blocks] + [g.num_blocks for g in getattr(proc, "groups", None) or []])
    what = f"{nl} layer{'s' if nl != 1 else ''}" if nl else "no layer written"
    head = f"{describe(proc)}: {what}, {nb} blocks"
    body = []
    for build in PROCESS_PANELS:
        part = build(proc, width, full, seen)
        if part:
            if body and full:
                body.append(Text(""))
            body += part
    if not body:
        body = [Text("(probes fired, nothing counted per block)", style="dim")]
    return Panel(Group(*body), title=head, title_align="left", width=width)


def idle_line(procs: list) -> Text:
    """Processes whose probes never fired, folded into one line (vLLM's API
    server maps the library too, and would otherwise take a whole panel)."""
    who = "; ".join(describe(p) for p in procs)
    return Text(f"{len(procs)} traced process{'es' if len(procs) != 1 else ''} with no "
                f"probe hit yet: {who}", style="dim")


def verdict(agg: Aggregate) -> Text:
    """'counts: exact' only once something was counted; the reasons otherwise."""
    reasons = agg.inexact_reasons()
    text = Text("counts: ")
    if reasons:
        text.append("NOT exact: " + "; ".join(reasons), style="bold red")
    elif not traced_anything(agg):
        text.append("nothing traced yet", style="yellow")
    else:
        text.append("exact", style="green")
        text.append(" (every slot of every probe hit, per block; see the foot)")
    return text


def render(agg: Aggregate, prev: Aggregate = None, *, title: str, elapsed: float,
           width: int = 100, note: str = "", full: bool = True) -> Group:
    """The live frame (with prev) or the summary; not full: the live view
    that fits FIT_ROWS rows (attach without --full)."""
    status = Text()
    status.append(title, style="bold")
    status.append(f"   {elapsed:.1f}s   ")
    # per-op records exist only with a stream (-o, --prometheus); without
    # one, a "records 0" would read as nothing traced
    if agg.records or agg.lost:
        status.append(f"records {_n(agg.records)}   ")
        status.append(f"lost {_n(agg.lost)}", style="red" if agg.lost else "")
    status.append("\n")
    status.append_text(verdict(agg))
    parts = [status]
    if note:
        parts.append(Text(note, style="yellow"))
    parts.append(ops_table(agg, prev, elapsed, width, full))
    missing = not_probed_line(agg)
    if missing is not None:
        parts.append(missing)
    procs = sorted(agg.processes.values(), key=lambda p: p.pid)
    seen = {}
    for proc in procs:
        if not is_idle(proc):
            parts.append(process_panel(proc, width, full, seen))
    idle = [p for p in procs if is_idle(p)]
    if idle:
        parts.append(idle_line(idle))
    if agg.log2 and full:
        parts.append(log2_table(agg))
    if traced_anything(agg):
        # the summary explains its words in full; a live frame keeps its rows
        # for the figures (FIT_ROWS), with one line saying where
        parts.append(Text(LEGEND + "\n" + EXACT_MEANS if prev is None else SHORT_LEGEND,
                          style="dim"))
    return Group(*parts)
