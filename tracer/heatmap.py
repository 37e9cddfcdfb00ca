"""A DAMON-style heatmap of slot writes: time (rows) x block range (columns).

As damo's `report heatmap`: each cell is one character, a digit 0-9 for its
write intensity (0 none, 1-9 scaled to the busiest cell), coloured, and a
footer says how much time and how many blocks one character stands for.
compute() is numpy over the raw arrays; render() is a pure rich Text.
"""

from dataclasses import dataclass

import numpy as np
from rich.text import Text

# cold to hot, one style per digit
COLOURS = ("grey35", "blue", "dodger_blue2", "cyan", "green", "chartreuse3", "yellow",
           "orange1", "dark_orange", "red")
LABEL_WIDTH = 9  # "  12.345 " before each row


@dataclass
class Heatmap:
    cells: np.ndarray  # rows x cols: slot writes in each cell
    t0_ns: int  # time range [t0, t1), relative to the trace's start
    t1_ns: int
    b0: int  # block range [b0, b1)
    b1: int
    blocks_per_col: int

    @property
    def rows(self) -> int:
        return self.cells.shape[0]

    @property
    def cols(self) -> int:
        return self.cells.shape[1]

    @property
    def ns_per_row(self) -> float:
        return (self.t1_ns - self.t0_ns) / max(1, self.rows)

    def digits(self) -> np.ndarray:
        top = self.cells.max() if self.cells.size else 0
        if top == 0:
            return np.zeros(self.cells.shape, np.int64)
        return np.ceil(self.cells * 9 / top).astype(np.int64)

    def to_json(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "t0_ns": self.t0_ns, "t1_ns": self.t1_ns,
                "ns_per_row": self.ns_per_row, "block_lo": self.b0, "block_hi": self.b1 - 1,
                "blocks_per_col": self.blocks_per_col, "writes": self.cells.tolist()}


def compute(t_ns: np.ndarray, blocks: np.ndarray, rows: int, cols: int,
            time_range: tuple, block_range: tuple) -> Heatmap:
    """Slot writes at times t_ns (relative to the trace start) into blocks.

    time_range: (t0, t1) ns, t1 exclusive; block_range: (lo, hi) inclusive.
    A column spans a whole number of blocks, so there may be fewer columns
    than asked for; rows split the time range evenly."""
    t0, t1 = int(time_range[0]), max(int(time_range[1]), int(time_range[0]) + 1)
    b0, b1 = int(block_range[0]), int(block_range[1]) + 1
    per = max(1, -(-(b1 - b0) // max(1, cols)))
    ncols = -(-(b1 - b0) // per)
    keep = (t_ns >= t0) & (t_ns < t1) & (blocks >= b0) & (blocks < b1)
    r = ((t_ns[keep] - t0) * rows // (t1 - t0)).astype(np.int64)
    c = ((blocks[keep] - b0) // per).astype(np.int64)
    cells = np.bincount(r * ncols + c, minlength=rows * ncols).reshape(rows, ncols)
    return Heatmap(cells, t0, t1, b0, b1, per)


def _span(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.0f} ns"


def render(h: Heatmap) -> Text:
    """Rows of coloured digits with a time label, then damo's footer.  Every
    line is at most LABEL_WIDTH + cols characters (and the footer at most
    60), so it fits a console that wide without wrapping."""
    text = Text(no_wrap=True, overflow="crop")
    digits = h.digits()
    for i in range(h.rows):
        text.append(f"{(h.t0_ns + i * h.ns_per_row) / 1e9:>8.3f} ", style="dim")
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
    text.append(f"# blocks {h.b0}-{h.b1 - 1}, {h.blocks_per_col} per column\n", style="dim")
    text.append(f"# 0 no writes, 1-9 up to {top:,} slot writes per cell", style="dim")
    return text
