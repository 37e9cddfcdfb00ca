"""Miss causes, removal reasons, regret and the optimal hit rate
(tracer/analysis/misses.py) on hand-worked event streams; Belady's hit
count against a brute force over every eviction choice."""

import itertools
import random

import numpy as np
import pytest

from tracer import abi
from tracer.analysis import lifecycle, misses

A, B, C, D = 0xA, 0xB, 0xC, 0xD


def events(rows):
    """Events from (ts, kind, req, group, block, hash) rows, one op each."""
    ts, kind, req, group, block, h = zip(*rows)
    n = len(rows)
    return lifecycle.Events(
        ts_ns=np.array(ts, np.int64), kind=np.array([abi.LIFE.index(k) for k in kind]),
        req=np.array(req, np.uint64), group=np.array(group, np.int64),
        block=np.array(block, np.int64), event=np.arange(n, dtype=np.int64),
        hash=np.array(h, np.uint64), pid=np.zeros(n, np.int64))


def by_req(out):
    return {int(r["req"], 16): r for r in out["requests"]}


# A computes h1 h2; C's allocation evicts h1; B wants A's prompt again:
# block 0 was evicted (capacity), block 1 is still cached but a prefix match
# stops at block 0's miss (resident)
STREAM = [
    (10, "alloc", A, 0, 1, 0), (10, "alloc", A, 0, 2, 0),
    (11, "cache", A, 0, 1, 0x11), (11, "cache", A, 0, 2, 0x12),
    (20, "free", A, 0, 1, 0), (20, "free", A, 0, 2, 0),
    (30, "evict", C, 0, 1, 0x11), (30, "alloc", C, 0, 1, 0), (31, "cache", C, 0, 1, 0x13),
    (40, "alloc", B, 0, 3, 0), (40, "alloc", B, 0, 4, 0),
    (41, "cache", B, 0, 3, 0x11), (41, "cache", B, 0, 4, 0x12),
]
REQS = [(1, A, "arrive", 40), (19, A, "finish", 1), (29, C, "arrive", 16),
        (39, B, "arrive", 40), (50, B, "finish", 1)]


def test_compulsory_capacity_resident():
    out = misses.classify(events(STREAM), REQS, block_size=16, names={C: "req-c"})
    r = by_req(out)
    assert [m["cause"] for m in r[A]["misses"]] == ["compulsory", "compulsory"]
    assert [m["cause"] for m in r[C]["misses"]] == ["compulsory"]
    cap, res = r[B]["misses"]
    assert (cap["cause"], cap["block"], cap["evicted_s"], cap["evicted_for"],
            cap["evicted_for_id"]) == ("capacity", 0, 30, f"{C:016x}", "req-c")
    # since A cached 0x11: 0x12 and 0x13 were referenced
    assert cap["reuse_distance"] == 2
    assert (res["cause"], res["block"]) == ("resident", 1)
    t = out["totals"]
    assert {c: t[c]["blocks"] for c in misses.CAUSES} == {
        "compulsory": 3, "capacity": 1, "below_block": 0, "hash_domain": 0, "resident": 1}
    assert t["capacity"]["tokens"] == 16 and t["compulsory"]["requests"] == 2


def test_only_prompt_blocks_before_preemption():
    # a prompt of 20 tokens has one full block; the second cached block
    # holds generated tokens, not a miss; after a preemption nothing counts
    rows = [(1, "alloc", A, 0, 1, 0), (2, "cache", A, 0, 1, 0x21),
            (3, "alloc", A, 0, 2, 0), (4, "cache", A, 0, 2, 0x22),
            (6, "free", A, 0, 1, 0), (6, "free", A, 0, 2, 0),
            (7, "alloc", A, 0, 3, 0), (8, "cache", A, 0, 3, 0x23)]
    reqs = [(0, A, "arrive", 20), (5, A, "preempt", 33)]
    out = misses.classify(events(rows), reqs, block_size=16)
    assert [m["block"] for m in by_req(out)[A]["misses"]] == [0]
    rem = misses.removals(events(rows), reqs)
    assert rem["reasons"]["preempted"] == 2


def test_hit_counts_and_resident_after_rehit():
    # B hits A's first block, computes the second: the second is new
    rows = [(1, "alloc", A, 0, 1, 0), (1, "alloc", A, 0, 2, 0),
            (2, "cache", A, 0, 1, 0x31), (2, "cache", A, 0, 2, 0x32),
            (5, "hit", B, 0, 1, 0x31), (5, "alloc", B, 0, 3, 0), (6, "cache", B, 0, 3, 0x33)]
    reqs = [(0, A, "arrive", 32), (4, B, "arrive", 40)]
    out = misses.classify(events(rows), reqs, block_size=16)
    b = by_req(out)[B]
    assert b["hit_blocks"] == 1 and [(m["block"], m["cause"]) for m in b["misses"]] == \
        [(1, "compulsory")]


def prefix(ts, req, domain, hashes, g=4, bs=16):
    return misses.Prefix(ts, 0, req, g, bs, domain, list(hashes))


def test_below_block_and_hash_domain():
    # bs 16, a hash every 4 tokens.  A: tokens t0..t39 (domain 0).  B shares
    # A's first 8 tokens then differs: its block 0 had 8 shareable tokens
    # (below the block).  D has A's very tokens under another salt: blocks
    # 0 and 1 are a hash domain miss
    rows = [(1, "alloc", A, 0, 1, 0), (1, "alloc", A, 0, 2, 0),
            (2, "cache", A, 0, 1, 0x41), (2, "cache", A, 0, 2, 0x42),
            (5, "alloc", B, 0, 3, 0), (6, "cache", B, 0, 3, 0x51),
            (8, "alloc", D, 0, 4, 0), (8, "alloc", D, 0, 5, 0),
            (9, "cache", D, 0, 4, 0x61), (9, "cache", D, 0, 5, 0x62)]
    reqs = [(0, A, "arrive", 40), (4, B, "arrive", 20), (7, D, "arrive", 40)]
    pa = [100 + k for k in range(10)]
    pb = pa[:2] + [200 + k for k in range(3)]
    pre = [prefix(0, A, 0, pa), prefix(4, B, 0, pb), prefix(7, D, 99, pa)]
    out = misses.classify(events(rows), reqs, pre, block_size=16)
    r = by_req(out)
    assert [m["cause"] for m in r[A]["misses"]] == ["compulsory"] * 2
    (m,) = r[B]["misses"]
    assert (m["cause"], m["shareable_tokens"], m["tokens"]) == ("below_block", 8, 8)
    assert [m["cause"] for m in r[D]["misses"]] == ["hash_domain"] * 2
    assert out["totals"]["below_block"] == {"blocks": 1, "tokens": 8, "requests": 1}
    # without the prefix hashes the same misses are compulsory
    out = misses.classify(events(rows), reqs, block_size=16)
    assert out["totals"]["compulsory"]["blocks"] == 5


def test_removal_reasons():
    rows = [(10, "free", A, 0, 1, 0), (10, "free", A, 0, 2, 0),   # A finished
            (12, "free", B, 0, 3, 0),                             # B's window
            (14, "free", B, 0, 4, 0),                             # B preempted
            (15, "evict", C, 0, 1, 0x1), (15, "evict", C, 0, 2, 0x2),
            (16, "evict", 0, 0, 4, 0x4)]
    reqs = [(9, A, "finish", 3), (13, B, "preempt", 40)]
    rem = misses.removals(events(rows), reqs, {C: "c"})
    assert rem["reasons"] == {"finished": 2, "preempted": 1, "window": 1, "evicted": 2,
                              "reset": 1}
    assert rem["evicted_for"] == [{"req": f"{C:016x}", "id": "c", "blocks": 2}]


def test_regret():
    out = misses.classify(events(STREAM), REQS, block_size=16)
    reg = misses.regret(out)
    (e,) = reg["entries"]
    assert reg == {"blocks": 1, "tokens": 16, "entries": reg["entries"]}
    assert (e["evicted_for"], e["needed_by"], e["needed_s"], e["evicted_s"]) == \
        (f"{C:016x}", f"{B:016x}", 40, 30)


def brute_force_hits(keys, capacity):
    """The most hits any eviction choice gives (demand caching: each
    referenced content is cached after its reference)."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(keys):
            best = max(best, hits)
            return
        k = keys[i]
        if k in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < capacity:
            go(i + 1, cache | {k}, hits)
        else:
            for v in cache:
                go(i + 1, (cache - {v}) | {k}, hits)
    go(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_brute_force(seed):
    rnd = random.Random(seed)
    keys = [rnd.randrange(rnd.randint(2, 6)) for _ in range(rnd.randint(1, 11))]
    for cap in range(1, 5):
        assert misses.optimal_hits(keys, cap) == brute_force_hits(keys, cap), (keys, cap)


def test_belady_never_below_lru():
    rnd = random.Random(7)
    keys = np.array([rnd.randrange(30) for _ in range(2000)])
    d = lifecycle.stack_distances(keys)
    for cap in (1, 4, 10, 29, 30):
        lru = int(np.count_nonzero((d >= 0) & (d < cap)))
        assert misses.optimal_hits(keys.tolist(), cap) >= lru
    # a cache as large as the contents hits every re-reference, as LRU does
    assert misses.optimal_hits(keys.tolist(), 30) == int(np.count_nonzero(d >= 0))
    # LRU's worst case, a loop over one content more than it holds, hits
    # nothing; MIN keeps all but one of them
    loop = list(itertools.islice(itertools.cycle(range(4)), 12))
    d = lifecycle.stack_distances(np.array(loop))
    assert int(np.count_nonzero((d >= 0) & (d < 3))) == 0
    assert misses.optimal_hits(loop, 3) == brute_force_hits(loop, 3) > 0
