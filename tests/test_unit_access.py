"""tracer/access.py's pure functions, on hand-made reads (no tracer)."""

import numpy as np

from tracer import access


def test_idle_before_reuse_measures_from_the_last_read_strictly_before():
    # reads (step -> time): block 5 at 10 and 20, block 7 at 30, block 5 at 40
    step_of = np.array([0, 1, 2, 3])
    block = np.array([5, 5, 7, 5])
    ts_ns = np.array([10, 20, 30, 40])
    gen_block = np.array([5, 7, 5, 9, 7, 5])
    gen_start = np.array([25, 30, 5, 50, 31, 40])
    # (5, 25): read at 20; (7, 30): a read at the very start is not before
    # it; (5, 5): none yet; (9, 50): never read; (7, 31): 30; (5, 40): 20
    got = access.idle_before_reuse(step_of, block, ts_ns, gen_block, gen_start)
    assert got.tolist() == [5, 1, 20]


def test_idle_before_reuse_without_reads_or_generations():
    empty = np.zeros(0, np.int64)
    assert access.idle_before_reuse(empty, empty, empty, np.array([1]),
                                    np.array([3])).tolist() == []
    assert access.idle_before_reuse(np.array([0]), np.array([1]), np.array([3]),
                                    empty, empty).tolist() == []
