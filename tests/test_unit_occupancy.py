"""tracer/occupancy.py on small hand-made streams; expected values worked out
by hand from the definitions in docs/occupancy.md."""

import numpy as np

from test_unit_stream import Wire
from tracer import abi, occupancy, stream


def gens_of(w, block_size):
    return occupancy.generations(stream.decode(w.batch()), block_size)


def table(g):
    return [(int(b), occupancy.KINDS[k], int(s), int(l), int(i), int(f), int(n), int(r))
            for b, k, s, l, i, f, n, r in zip(g.block, g.kind, g.start_step, g.last_step,
                                               g.inherited, g.fill, g.writes, g.reuse_steps)]


def test_writes_only():
    w = Wire()
    w.op("reshape_and_cache", [0, 1, 2, -1])  # step 0: block 0 offsets 0-2, padding
    w.op("reshape_and_cache", [3, 4])  # step 1: block 0 full, block 1 starts
    w.op("reshape_and_cache", [5, 8])  # step 2: block 1 offset 1, block 2 starts
    w.op("reshape_and_cache", [0])  # step 3: block 0 reused
    g = gens_of(w, 4)
    # block, kind, start, last, inherited, fill, writes, reuse distance
    assert table(g) == [(0, "write", 0, 1, 0, 4, 4, 2),
                        (0, "write", 3, 3, 0, 1, 1, -1),
                        (1, "write", 1, 2, 0, 2, 2, -1),
                        (2, "write", 2, 2, 0, 1, 1, -1)]
    assert list(g.lifetime_steps) == [2, 1, 2, 1]
    assert g.steps == 4
    assert list(g.active_blocks) == [1, 2, 2, 1]
    assert list(g.active_tokens) == [3, 5, 3, 1]
    assert np.allclose(g.fragmentation, [1 / 4, 3 / 8, 5 / 8, 3 / 4])
    assert list(g.fill_hist) == [0, 2, 1, 0, 1]
    assert g.max_writes == 4 and g.incomplete_ops == 0


def test_copies_and_swaps_start_generations_with_inherited_tokens():
    w = Wire()
    w.op("reshape_and_cache", [0, 1, 2, 3, 4, 5])  # step 0: block 0 full, block 1 holds 2
    w.op("copy_blocks", [1, 2])  # after step 0: block 2 gets block 1's 2 tokens
    w.op("reshape_and_cache", [6, 10])  # step 1: both hold 3
    w.op("swap_blocks", [2, 7], flags=abi.EV_SWAP_OUT)  # step 2: block 2 -> host 7
    w.op("swap_blocks", [7, 0], flags=abi.EV_SWAP_IN)  # host 7 -> block 0
    w.op("reshape_and_cache", [3])  # block 0 offset 3
    g = gens_of(w, 4)
    assert table(g) == [(0, "write", 0, 0, 0, 4, 4, 2),
                        (0, "swap_in", 2, 2, 3, 4, 1, -1),
                        (1, "write", 0, 1, 0, 3, 3, -1),
                        (2, "copy", 1, 2, 2, 3, 1, -1)]
    assert list(g.active_blocks) == [2, 2, 2]
    assert list(g.active_tokens) == [6, 6, 7]


def test_host_to_device_swap_of_an_unknown_host_block_inherits_nothing():
    w = Wire()
    w.op("swap_blocks", [9, 1], flags=abi.EV_SWAP_IN)
    w.op("reshape_and_cache", [6])  # block 1 offset 2 (block size 4)
    g = gens_of(w, 4)
    assert table(g) == [(1, "swap_in", 0, 0, 0, 3, 1, -1)]


def test_writes_before_any_start_form_a_generation_of_their_own():
    w = Wire()
    w.op("reshape_and_cache", [5, 6])  # block 1 offsets 1, 2: tracing began mid-way
    w.op("reshape_and_cache", [7, 4])  # offset 3, then block 1 offset 0: a new one
    g = gens_of(w, 4)
    assert table(g) == [(1, "before", 0, 1, 0, 4, 3, 0),
                        (1, "write", 1, 1, 0, 1, 1, -1)]


def test_a_slot_written_twice_shows_in_max_writes():
    w = Wire()
    for slots in ([0], [1], [1]):
        w.op("reshape_and_cache", slots)
    g = gens_of(w, 2)
    assert table(g) == [(0, "write", 0, 2, 0, 2, 3, -1)]
    assert g.max_writes == 3 > g.block_size


def test_incomplete_ops_are_left_out_and_counted():
    w = Wire()
    w.op("reshape_and_cache", [0, 1])
    w.op("reshape_and_cache", np.arange(2, 80), drop_chunks=(1,))
    g = gens_of(w, 4)
    assert g.incomplete_ops == 1
    assert table(g) == [(0, "write", 0, 0, 0, 2, 2, -1)]
    assert g.steps == 2  # the lost op still counts as a step


def test_by_cache_splits_processes_and_layers():
    w = Wire()
    w.op("reshape_and_cache", [0, 1], pid=1, cache_id=10)
    w.op("reshape_and_cache", [0], pid=1, cache_id=11)
    w.op("reshape_and_cache", [16], pid=2, cache_id=10)
    w.op("reshape_and_cache", [0], pid=3, cache_id=10)  # no block size known
    out = occupancy.by_cache(stream.decode(w.batch()), {(1, 10): 16, (1, 11): 16, (2, 10): 8})
    assert sorted(out) == [(1, 10), (1, 11), (2, 10)]
    assert list(out[(1, 10)].fill) == [2]
    assert list(out[(2, 10)].block) == [2]


def test_ten_million_slot_writes_stay_in_numpy():
    """A stress shape: 10M slots in 1221 ops of 8192, one cache; the whole
    pipeline (decode + generations) must not loop per slot."""
    bs, per_op, nops = 16, 8192, 1221
    slots = np.arange(per_op * nops, dtype=np.int64) % (bs * 65536)
    w = Wire()
    for i in range(nops):
        w.op("reshape_and_cache", slots[i * per_op:(i + 1) * per_op])
    s = stream.decode(w.batch())
    assert len(s.values) == per_op * nops
    g = occupancy.generations(s, bs)
    assert len(g) == len(slots) // bs
    assert g.max_writes == bs and set(g.fill.tolist()) == {bs}


def test_block_numbers_of_any_size_give_the_same_generations():
    """The sorts and searches take a faster path for blocks under 2**16 and
    for (block, op) pairs that pack into 63 bits; renumbering the blocks in
    order (past 2**16, then past what packs) must change nothing but the
    block numbers."""
    rng = np.random.default_rng(3)
    bs = 4
    script = []
    for _ in range(300):
        r = rng.random()
        if r < 0.8:
            script.append(("reshape_and_cache", [int(b) * bs + int(o) for b, o in zip(
                rng.integers(0, 40, 6), rng.integers(0, bs, 6))], 0))
        elif r < 0.9:
            script.append(("copy_blocks", rng.integers(0, 40, 4).tolist(), 0))
        else:
            out = rng.random() < 0.5
            script.append(("swap_blocks", rng.integers(0, 40, 2).tolist(),
                           abi.EV_SWAP_OUT if out else abi.EV_SWAP_IN))

    def gens(renumber):
        w = Wire()
        for name, vals, flags in script:
            if name == "reshape_and_cache":
                vals = [renumber(v // bs) * bs + v % bs for v in vals]
            else:
                vals = [renumber(v) for v in vals]
            w.op(name, vals, flags=flags)
        return gens_of(w, bs)

    small = gens(lambda b: b)
    assert len(small) > 40 and "copy" in {occupancy.KINDS[k] for k in small.kind}
    for renumber in (lambda b: b + 70_000, lambda b: b * 2**48 + 5):
        big = gens(renumber)
        assert big.block.tolist() == [renumber(b) for b in small.block.tolist()]
        for name in ("kind", "start_step", "last_step", "inherited", "fill", "writes",
                     "reuse_steps", "active_blocks", "active_tokens"):
            assert np.array_equal(getattr(big, name), getattr(small, name)), name
