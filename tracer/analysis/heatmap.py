"""A DAMON-style heatmap: time (rows) x block range (columns), of slot
writes by default (or any per-block event: Heatmap.what and .key).

As damo's `report heatmap`: each cell is one character, a digit 0-9 for its
intensity (0 none, 1-9 scaled to the busiest cell), coloured, and a footer
says which blocks are shown, and how much time and how many blocks one
character stands for.  compute() is numpy over the raw arrays;
views/heatmap_text.py draws it.
"""

from dataclasses import dataclass

import numpy as np

LABEL_WIDTH = 9  # "  12.345 " before each row, at least


def label_width(t0_ns: int, t1_ns: int) -> int:
    """The width of the time label before each row (and its space): wider
    than LABEL_WIDTH for a trace of 10,000 s or more, or times before the
    trace's start."""
    return max(LABEL_WIDTH, *(len(f"{t / 1e9:.3f}") + 1 for t in (t0_ns, t1_ns)))


@dataclass
class Heatmap:
    cells: np.ndarray  # rows x cols: slot writes (all layers) in each cell
    t0_ns: int  # time range [t0, t1), relative to the trace's start
    t1_ns: int
    b0: int  # block range [b0, b1)
    b1: int
    total_blocks: int = 0  # blocks the caches have (the range shown is part of them)
    zoomed: bool = False  # the range was chosen as the blocks written, not asked for
    # what a cell counts, in the footer, and its key in JSON: a read heatmap
    # is the same map with ("block reads (once per step per group)", "reads")
    what: str = "slot writes (all layers)"
    key: str = "writes"

    @property
    def rows(self) -> int:
        return self.cells.shape[0]

    @property
    def cols(self) -> int:
        return self.cells.shape[1]

    @property
    def ns_per_row(self) -> float:
        return (self.t1_ns - self.t0_ns) / max(1, self.rows)

    @property
    def blocks_per_col(self) -> float:
        return (self.b1 - self.b0) / max(1, self.cols)

    def col_blocks(self, c: int) -> tuple:
        """The blocks (lo, hi inclusive) column c sums: col_edges()."""
        lo, hi = col_edges(self.b1 - self.b0, self.cols)
        return self.b0 + int(lo[c]), self.b0 + int(hi[c])

    def digits(self) -> np.ndarray:
        top = self.cells.max() if self.cells.size else 0
        if top == 0:
            return np.zeros(self.cells.shape, np.int64)
        return np.ceil(self.cells * 9 / top).astype(np.int64)

    def to_json(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "t0_ns": self.t0_ns, "t1_ns": self.t1_ns,
                "ns_per_row": self.ns_per_row, "block_lo": self.b0, "block_hi": self.b1 - 1,
                "blocks_per_col": self.blocks_per_col, "total_blocks": self.total_blocks,
                "zoomed": self.zoomed, "what": self.what, self.key: self.cells.tolist()}


def col_edges(nblocks: int, cols: int) -> tuple:
    """Which of nblocks blocks each of cols columns covers: column c holds
    blocks c*n//cols .. max(that, (c+1)*n//cols - 1), offsets into the range.
    With at least as many blocks as columns the columns split the blocks
    (sizes differ by at most one); with fewer, a block spans several
    columns, each showing that block's count."""
    c = np.arange(cols, dtype=np.int64)
    lo = c * nblocks // cols
    hi = np.maximum(lo, (c + 1) * nblocks // cols - 1)
    return lo, hi


def compute(t_ns: np.ndarray, blocks: np.ndarray, rows: int, cols: int,
            time_range: tuple, block_range: tuple, total_blocks: int = 0,
            zoomed: bool = False, **named) -> Heatmap:
    """Events (slot writes, by default) at times t_ns (relative to the
    trace start) on blocks.  named: Heatmap's `what` and `key`.

    time_range: (t0, t1) ns, t1 exclusive; block_range: (lo, hi) inclusive.
    The map has exactly rows x cols cells: rows split the time range
    evenly, columns the block range (col_edges)."""
    return compute_chunks([(t_ns, blocks, None)], rows, cols, time_range, block_range,
                          total_blocks, zoomed, **named)


def _in_time_order(t_ns: np.ndarray) -> bool:
    """Whether a chunk's times never go back (the write and read runs'
    do not, as the ops are): its rows and range are then slices."""
    return len(t_ns) < 2 or bool(np.all(t_ns[1:] >= t_ns[:-1]))


def block_counts(chunks, time_range: tuple) -> np.ndarray:
    """Events per block (0 .. the highest block of any chunk) in time_range
    ((t0, t1) ns, t1 exclusive), over compute_chunks' (t_ns, blocks, counts)
    chunks: the blocks a heatmap zooms to (block_window).  A chunk in
    time order (as the write and read runs are) has the range as a slice,
    found by a search."""
    used = np.zeros(0, np.int64)
    for t, b, w in chunks:
        if not _in_time_order(t):
            keep = (t >= time_range[0]) & (t < time_range[1])
            tb, tw = b[keep], None if w is None else w[keep]
        else:
            lo, hi = np.searchsorted(t, time_range).tolist()
            tb, tw = b[lo:hi], None if w is None else w[lo:hi]
        c = np.bincount(tb, tw, minlength=int(b.max()) + 1 if len(b) else 0).astype(np.int64)
        if len(c) > len(used):
            used = np.concatenate([used, np.zeros(len(c) - len(used), np.int64)])
        used[:len(c)] += c
    return used


def compute_chunks(chunks, rows: int, cols: int, time_range: tuple, block_range: tuple,
                   total_blocks: int = 0, zoomed: bool = False, **named) -> Heatmap:
    """compute() over the events given a part at a time: chunks yields
    (t_ns, blocks, counts) triples, each counted and dropped before the
    next (a trace's 27M slot writes need not be held at once); counts:
    events at each (t_ns, block), or None for one each."""
    t0, t1 = int(time_range[0]), max(int(time_range[1]), int(time_range[0]) + 1)
    b0, b1 = int(block_range[0]), int(block_range[1]) + 1
    n = b1 - b0
    per_block = np.zeros(rows * n, np.int64)
    # row k holds the times t with (t - t0) * rows // (t1 - t0) == k: those
    # from t0 + ceil(k (t1 - t0) / rows) on (Python ints: no overflow)
    edges = [t0 + -(-k * (t1 - t0) // rows) for k in range(rows + 1)]
    for t_ns, blocks, counts in chunks:
        if not _in_time_order(t_ns):
            keep = (t_ns >= t0) & (t_ns < t1) & (blocks >= b0) & (blocks < b1)
            r = ((t_ns[keep] - t0) * rows // (t1 - t0)).astype(np.int64)
            b = (blocks[keep] - b0).astype(np.int64)
            # weights are float64: exact for counts below 2**53
            per_block += np.bincount(r * n + b, None if counts is None else counts[keep],
                                     minlength=rows * n).astype(np.int64)
            continue
        # in time order (the write runs, the read runs, as the ops are):
        # each row's events are a slice, found by a search of its edges, and
        # counted by one bincount each, with no row number, mask or key per
        # event
        at = np.searchsorted(t_ns, edges).tolist()
        inside = len(blocks) and int(blocks[at[0]:at[-1]].min(initial=b0)) >= b0 and \
            int(blocks[at[0]:at[-1]].max(initial=b0)) < b1
        w = None if counts is None else counts.astype(np.float64)  # once, not per row
        for k in range(rows):
            lo, hi = at[k], at[k + 1]
            if lo == hi:
                continue
            b, wk = blocks[lo:hi], None if w is None else w[lo:hi]
            if not inside:
                keep = (b >= b0) & (b < b1)
                b, wk = b[keep], None if wk is None else wk[keep]
            per_block[k * n:(k + 1) * n] += np.bincount(b - b0 if b0 else b, wk,
                                                        minlength=n).astype(np.int64)
    per_block = per_block.reshape(rows, n)
    lo, hi = col_edges(n, cols)
    # a prefix sum per row: each column is the difference at its edges
    csum = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(per_block, axis=1)], axis=1)
    cells = csum[:, hi + 1] - csum[:, lo]
    return Heatmap(cells, t0, t1, b0, b1, total_blocks, zoomed, **named)


def block_window(counts: np.ndarray, pad_frac: int = 16) -> tuple:
    """The blocks worth drawing: from the first to the last block with a
    count, padded by 1/pad_frac of that span (at least 2 blocks) on each
    side, within 0..len-1.  (0, len-1) when nothing is counted: vLLM may have
    2048 blocks and use a dozen, which at full width all land in one column."""
    n = len(counts)
    nz = np.flatnonzero(counts)
    if not len(nz):
        return 0, max(0, n - 1)
    lo, hi = int(nz[0]), int(nz[-1])
    pad = max(2, (hi - lo + 1) // pad_frac)
    return max(0, lo - pad), min(n - 1, hi + pad)
