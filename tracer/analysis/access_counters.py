"""Access patterns from the exact counters (BPF maps, aggregate.ReadGroup):
reads per block, the step of each block's last read, and per-group sums;
what `attach` shows (docs/access.md).  Pure logic (numpy), no bcc.

access_stream.py has the same figures over time, from a trace file's
block_table ops; access_requests.py, per request.  DAMON's names where
they fit: a block's access frequency is its `nr_accesses` (here exact,
not sampled), its age is the time since its last read, and the working
set is the set of distinct blocks read.
"""

import numpy as np

PERCENTILES = (0, 25, 50, 75, 90, 99, 100)


def frequency_histogram(reads_per_block: np.ndarray) -> list:
    """[(lo, hi, blocks)]: blocks by how many reads they had, in log2
    buckets (0 reads: blocks never read, up to the highest block read)."""
    nz = np.flatnonzero(reads_per_block)
    if not len(nz):
        return []
    counts = reads_per_block[:nz[-1] + 1].astype(np.uint64)
    out = [(0, 0, int((counts == 0).sum()))]
    read = counts[counts > 0]
    slot = np.floor(np.log2(read.astype(np.float64))).astype(np.int64)
    for s, n in zip(*np.unique(slot, return_counts=True)):
        out.append((1 << int(s), (1 << (int(s) + 1)) - 1, int(n)))
    return out


def most_read_blocks(reads_per_block: np.ndarray, n: int = 5) -> list:
    """[(block, reads)] of the n most read blocks, most first."""
    nz = np.flatnonzero(reads_per_block)
    order = nz[np.argsort(-reads_per_block[nz].astype(np.int64), kind="stable")][:n]
    return [(int(b), int(reads_per_block[b])) for b in order]


def least_read_blocks(reads_per_block: np.ndarray, n: int = 5) -> list:
    """[(block, reads)] of the n least read blocks among those read at all,
    but the n most read (most_read_blocks): with fewer than 2n blocks read,
    a block listed as both hottest and coldest reads as a contradiction, so
    the coldest are then fewer."""
    nz = np.flatnonzero(reads_per_block)
    hot = {b for b, _ in most_read_blocks(reads_per_block, n)}
    order = nz[np.argsort(reads_per_block[nz].astype(np.int64), kind="stable")]
    return [(int(b), int(reads_per_block[b])) for b in order if int(b) not in hot][:n]


def age_steps(last_read_step: np.ndarray, steps: int) -> np.ndarray:
    """Per block read at least once: steps since its last read (0: read at
    the latest step), -1 for blocks never read."""
    last = last_read_step.astype(np.int64)
    return np.where(last > 0, steps - last, -1)


def group_summary(g) -> dict:
    """The figures of one aggregate.ReadGroup, for views and JSON."""
    steps = g.steps
    return {
        "steps": steps,
        "layers": g.layers,
        "reads_per_step": g.reads / steps if steps else 0.0,
        "distinct_per_step": g.distinct / steps if steps else 0.0,
        "blocks_ever_read": int(np.count_nonzero(g.reads_per_block)),
        # mean requests reading a live block at a step: 1 without sharing
        "sharing": g.reads / g.distinct if g.distinct else 0.0,
        # tokens held in the live set over its capacity, over all steps
        "utilization": g.held_tokens / (g.distinct * g.block_size)
        if g.distinct and g.block_size else None,
    }
