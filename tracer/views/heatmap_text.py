"""The heatmap drawn as damo draws it: a digit 0-9 a cell, coloured, with
a time label before each row and a footer saying which blocks are shown and
how much time and how many blocks one character stands for.  The counts
are analysis/heatmap.py's; this module only draws them."""

import numpy as np
from rich.text import Text

from ..analysis.heatmap import Heatmap, label_width

# cold to hot, one style per digit
COLOURS = ("grey35", "blue", "dodger_blue2", "cyan", "green", "chartreuse3", "yellow",
           "orange1", "dark_orange", "red")


def _span(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.0f} ns"


def render(h: Heatmap) -> Text:
    """Rows of coloured digits with a time label, then damo's footer.  Every
    line is at most label_width() + cols characters (and the footer at most
    60 with 7-digit counts), so it fits a console that wide without wrapping."""
    text = Text(no_wrap=True, overflow="crop")
    digits = h.digits()
    lw = label_width(h.t0_ns, h.t1_ns) - 1
    for i in range(h.rows):
        text.append(f"{(h.t0_ns + i * h.ns_per_row) / 1e9:>{lw}.3f} ", style="dim")
        row = digits[i]
        # runs of one digit share a style: fewer spans than characters
        edges = np.flatnonzero(np.diff(row)) + 1
        for run in np.split(row, edges):
            if len(run):
                text.append(str(run[0]) * len(run), style=COLOURS[run[0]])
        text.append("\n")
    top = int(h.cells.max()) if h.cells.size else 0
    text.append(f"# time {h.t0_ns / 1e9:.3f}-{h.t1_ns / 1e9:.3f} s, "
                f"{_span(h.ns_per_row)} per row\n", style="dim")
    text.append(f"# {shown(h)}, {per_column(h)}\n", style="dim")
    if h.zoomed:
        used = "read" if h.key == "reads" else "written"
        text.append(f"# zoomed to the blocks {used} (--block-range to choose)\n", style="dim")
    what = h.what.split(" (")
    text.append(f"# 0 none, 1-9 up to {top:,} {what[0]} per cell"
                + (f" ({what[1]}" if len(what) > 1 else ""), style="dim")
    return text


def shown(h: Heatmap) -> str:
    """Which blocks the columns cover, and out of how many."""
    out = f"blocks {h.b0}-{h.b1 - 1}"
    if h.total_blocks:
        out += f" of {h.total_blocks}"
    return out


def per_column(h: Heatmap) -> str:
    per = h.blocks_per_col
    if per >= 1:
        return f"{per:.3g} per column" if per != int(per) else f"{int(per)} per column"
    return f"1 block per {1 / per:.3g} columns"
