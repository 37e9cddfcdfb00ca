"""The terminal views (rich): the live screen of `attach` and its summary.

render() is a pure function of Aggregates, so it is unit-tested with a
fixed-width Console; attach only decides when to call it.
"""

import numpy as np
from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .aggregate import Aggregate, bucket, log2_range, rates

_BARS = " ▁▂▃▄▅▆▇█"
HIST_ROWS = 6


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


def ops_table(agg: Aggregate, prev: Aggregate = None, elapsed: float = 0.0,
              width: int = 100) -> Table:
    """Ops with their rates: since the previous refresh, or (for a summary,
    with no previous) averaged over the whole run.  Counts are printed whole,
    never rounded; a narrow terminal drops the padding column instead."""
    if prev is not None:
        r = rates(agg, prev)
    else:
        r = {op: {"calls": st["calls"] / elapsed}
             for op, st in agg.op_totals().items()} if elapsed > 0 else {}
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    t.add_column("op", no_wrap=True, min_width=len("cpu_attn_reshape_and_cache"))
    cols = ("calls", "calls/s", "slots", "padding", "bytes")
    if width < 100:
        cols = tuple(c for c in cols if c != "padding")
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    for op, st in agg.op_totals().items():
        rr = r.get(op, {})
        cells = {"calls": _n(st["calls"]), "calls/s": _rate(rr.get("calls", 0)),
                 "slots": _n(st["slots"]), "padding": _n(st["padding"]),
                 "bytes": _bytes(st["bytes"]) if st["bytes"] else "-"}
        t.add_row(op, *(cells[c] for c in cols))
    if not t.row_count:
        t.add_row("(no ops yet)", *("" for _ in cols))
    return t


def histogram(counts: np.ndarray, width: int, rows: int = HIST_ROWS) -> Text:
    """A vertical bar chart of counts bucketed to `width` columns."""
    sums, per = bucket(counts, width)
    text = Text()
    top = int(sums.max()) if len(sums) else 0
    if top == 0:
        return Text("(nothing written yet)", style="dim")
    # eighths of a row per column
    heights = np.ceil(sums.astype(float) / top * rows * 8).astype(int)
    for r in range(rows - 1, -1, -1):
        line = "".join(_BARS[min(8, max(0, h - r * 8))] for h in heights)
        label = _rate(top) if r == rows - 1 else ""
        text.append(f"{label:>6} ", style="dim")
        text.append(line + "\n", style="green")
    n = len(counts)
    axis = f"0{'':{max(1, len(sums) - len(str(n - 1)) - 1)}}{n - 1}"
    text.append(f"{'':>6} {axis}\n", style="dim")
    text.append(f"{'':>6} {per} block{'s' if per > 1 else ''} per column, "
                f"max column {_n(top)}", style="dim")
    return text


def hottest(proc, top: int = 8) -> Table:
    tokens = proc.tokens
    all_layers = proc.all_layer_writes
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("block", "tokens", "all layers", "copy src/dst", "swap out/in"):
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
        t.add_row(str(b), _n(tokens[b]), _n(all_layers[b]),
                  f"{mv('copy_src', b)}/{mv('copy_dst', b)}",
                  f"{mv('swap_out', b)}/{mv('swap_in', b)}")
    return t


def moves_table(proc) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("move", "total", "blocks", "max on one block"):
        t.add_column(col, justify="left" if col == "move" else "right")
    for kind, arr in proc.moves.items():
        t.add_row(kind, _n(arr.sum()), _n(np.count_nonzero(arr)),
                  _n(arr.max()) if len(arr) else "0")
    return t


def log2_table(agg: Aggregate) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="items per op (log2)",
              title_justify="left", title_style="bold")
    for col in ("op", "range", "ops", ""):
        t.add_column(col, justify="right" if col in ("ops",) else "left")
    for op, hist in sorted(agg.log2.items()):
        peak = max(hist.values()) if hist else 1
        for s in sorted(hist):
            lo, hi = log2_range(s)
            t.add_row(op, f"{lo} -> {hi}", _n(hist[s]), "*" * max(1, round(24 * hist[s] / peak)))
            op = ""
    return t


def render(agg: Aggregate, prev: Aggregate = None, *, title: str, elapsed: float,
           width: int = 100, note: str = "") -> Group:
    reasons = agg.inexact_reasons()
    status = Text()
    status.append(title, style="bold")
    status.append(f"   {elapsed:.1f}s   records {_n(agg.records)}   ")
    status.append(f"lost {_n(agg.lost)}", style="red" if agg.lost else "")
    status.append("\ncounts: ")
    status.append("exact" if not reasons else "NOT exact: " + "; ".join(reasons),
                  style="green" if not reasons else "bold red")
    parts = [status]
    if note:
        parts.append(Text(note, style="yellow"))
    parts.append(ops_table(agg, prev, elapsed, width))
    hist_width = max(10, width - 12)
    for proc in sorted(agg.processes.values(), key=lambda p: p.pid):
        nl = len(proc.layers)
        head = (f"pid {proc.pid} ({proc.comm}): {nl} layer{'s' if nl != 1 else ''}, "
                f"{proc.num_blocks} blocks")
        hot = Group(Text("hottest blocks", style="bold"), hottest(proc))
        moved = Group(Text("copies and swaps", style="bold"), moves_table(proc))
        body = [Text("tokens written per block (max over layers)", style="bold"),
                histogram(proc.tokens, hist_width), Text("")]
        if width >= 110:  # side by side only where both fit
            grid = Table.grid(padding=(0, 4))
            grid.add_row(hot, moved)
            body.append(grid)
        else:
            body += [hot, moved]
        parts.append(Panel(Group(*body), title=head, title_align="left", width=width))
    if agg.log2:
        parts.append(log2_table(agg))
    return Group(*parts)
