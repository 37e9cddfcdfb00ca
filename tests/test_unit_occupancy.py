"""tracer/occupancy.py on small hand-made streams; expected values worked out
by hand from the definitions in docs/occupancy.md, and on random streams
against a slot-by-slot reading of the same definitions."""

from unittest import mock

import numpy as np
from hypothesis import given, settings, strategies as st

from test_unit_stream import Wire
from tracer import abi
from tracer.analysis import occupancy
from tracer.trace import stream


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


def test_by_cache_shares_only_what_is_the_same():
    """Layers with the same ops and values share one computation of their
    generations and keep their own times; a layer of the same shape with
    other values, or with an op lost, gets its own: each must equal
    generations() of that layer alone."""
    w, t = Wire(), 1000
    for step, (a, c, d) in enumerate([([0, 1, 2], [0, 1, 5], [0, 1, 2]),
                                      ([3], [2], [3]), ([16, 17], [16, 17], [16, 17])]):
        for cache, slots in ((10, a), (11, a), (12, c), (13, d)):
            t += 7 + cache
            w.op("reshape_and_cache", slots, pid=1, cache_id=cache, ts=t,
                 drop_chunks=(0,) if (cache, step) == (13, 1) else ())
    s = stream.decode(w.batch())
    out = occupancy.by_cache(s, {(1, c): 4 for c in (10, 11, 12, 13)})
    # the computations: 10 and 11 are one; 12 (other values) and 13 (an op lost) each their own
    groups = occupancy.distinct_caches(s, {(1, c): 4 for c in (10, 11, 12, 13)})
    assert [[key for key, *_ in g] for g in groups] == [[(1, 10), (1, 11)], [(1, 12)], [(1, 13)]]
    for cache in (10, 11, 12, 13):
        alone = occupancy.generations(s.select(s.ops["cache_id"] == cache), 4)
        got = out[(1, cache)]
        for f in ("block", "fill", "start_step", "last_step", "start_ns", "last_ns", "writes"):
            assert np.array_equal(getattr(got, f), getattr(alone, f)), (cache, f)
    assert out[(1, 11)].block is out[(1, 10)].block  # computed once
    assert not np.array_equal(out[(1, 11)].start_ns, out[(1, 10)].start_ns)
    assert list(out[(1, 12)].fill) != list(out[(1, 10)].fill)
    assert out[(1, 13)].incomplete_ops == 1 and out[(1, 10)].incomplete_ops == 0


def test_layers_differing_in_one_late_value_are_not_shared(monkeypatch):
    """The values of two layers of one shape are compared exactly, chunk by
    chunk: one that differs from its twin only in its last op's last value
    (past the first chunk) gets generations of its own, and a true twin
    shares them."""
    monkeypatch.setattr(occupancy, "_COMPARED_VALUES", 3)  # several chunks
    w = Wire()
    for step in range(6):
        slots = [16 * step + k for k in range(4)]
        for cache in (10, 11, 12):
            last = cache == 12 and step == 5
            w.op("reshape_and_cache", slots[:-1] + [slots[-1] + 1] if last else slots,
                 pid=1, cache_id=cache, ts=1000 + 10 * step + cache)
    s = stream.decode(w.batch())
    groups = occupancy.distinct_caches(s, {(1, c): 16 for c in (10, 11, 12)})
    assert [[key for key, *_ in g] for g in groups] == [[(1, 10), (1, 11)], [(1, 12)]]
    out = occupancy.by_cache(s, {(1, c): 16 for c in (10, 11, 12)})
    assert list(out[(1, 12)].fill) != list(out[(1, 10)].fill)


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


def reference_generations(ops, bs):
    """The definitions of docs/occupancy.md, slot write by slot write, in
    plain Python: ops is [(name, values, flags)] in order.  Independent of
    occupancy.generations (which works on runs of writes, in numpy)."""
    gens, current, host = [], {}, {}  # current: block -> its generation
    nsteps = 0

    def start(block, kind, step, key, inherited=0):
        g = {"block": block, "kind": kind, "start": step, "last": step, "key": key,
             "inherited": inherited, "writes": []}  # writes: (step, offset + 1)
        gens.append(g)
        current[block] = g
        return g

    def fill_of(g):
        return max([g["inherited"]] + [f for _, f in g["writes"]])

    for n, (name, values, flags) in enumerate(ops):
        step = nsteps
        if name in abi.WRITE_OPS:
            nsteps += 1
            for i, v in enumerate(values):
                if v < 0:
                    continue
                b, off = divmod(v, bs)
                if off == 0 or b not in current:
                    start(b, "write" if off == 0 else "before", step, (n, i))
                g = current[b]
                g["writes"].append((step, off + 1))
                g["last"] = step
            continue
        for i in range(0, len(values), 2):
            src, dst = values[i], values[i + 1]
            if name == "copy_blocks" or flags & abi.EV_SWAP_OUT:  # a device-side source
                g = current.get(src)
                fill = 0
                if g is not None:
                    fill = fill_of(g)
                    g["last"] = step
                if name == "copy_blocks":
                    start(dst, "copy", step, (n, i), fill)
                else:
                    host[dst] = fill
            elif flags & abi.EV_SWAP_IN:
                start(dst, "swap_in", step, (n, i), host.get(src, 0))
    gens.sort(key=lambda g: (g["block"], g["key"]))
    rows = []
    for j, g in enumerate(gens):
        nxt = gens[j + 1] if j + 1 < len(gens) and gens[j + 1]["block"] == g["block"] else None
        rows.append((g["block"], g["kind"], g["start"], g["last"], g["inherited"], fill_of(g),
                     len(g["writes"]), nxt["start"] - g["last"] if nxt else -1))
    active = [0] * nsteps
    tokens = [0] * nsteps
    for g in gens:
        for k in range(g["start"], min(g["last"], nsteps - 1) + 1):
            active[k] += 1
            tokens[k] += max([g["inherited"]] + [f for s, f in g["writes"] if s <= k])
    return rows, active, tokens


@settings(max_examples=300, deadline=None)
@given(bs=st.sampled_from([1, 2, 3, 4, 16]), chunk=st.sampled_from([1, 2, 5, 1 << 20]),
       data=st.data())
def test_generations_equal_a_slot_by_slot_reading(bs, chunk, data):
    """Random streams of writes (slots in any order, repeated, padded, runs
    that cross blocks), copies and swaps, against reference_generations;
    the runs found a few slots at a time (chunk) as well as at once."""
    nblocks = 6
    op = st.one_of(
        st.tuples(st.just("reshape_and_cache"),
                  st.lists(st.one_of(st.integers(-1, nblocks * bs - 1),
                                     st.integers(0, nblocks - 1).map(lambda b: b * bs)),
                           max_size=3 * bs + 2), st.just(0)),
        # ascending runs, as a prefill writes them
        st.tuples(st.just("reshape_and_cache"),
                  st.tuples(st.integers(0, nblocks * bs - 1), st.integers(1, 3 * bs)).map(
                      lambda a: list(range(a[0], min(a[0] + a[1], nblocks * bs)))), st.just(0)),
        st.tuples(st.sampled_from(["copy_blocks", "swap_blocks"]),
                  st.lists(st.integers(0, nblocks - 1), min_size=2, max_size=6).map(
                      lambda v: v[:len(v) // 2 * 2]),
                  st.sampled_from([abi.EV_SWAP_OUT, abi.EV_SWAP_IN])))
    ops = data.draw(st.lists(op, max_size=12))
    ops = [(name, values, flags if name == "swap_blocks" else 0) for name, values, flags in ops]
    w = Wire()
    for name, values, flags in ops:
        w.op(name, values, flags=flags)
    with mock.patch.object(occupancy, "_CHUNK_SLOTS", chunk):
        g = gens_of(w, bs)
    rows, active, tokens = reference_generations(ops, bs)
    assert table(g) == rows
    assert list(g.active_blocks) == active
    assert list(g.active_tokens) == tokens
