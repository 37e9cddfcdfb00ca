"""tracer/lifecycle.py on hand-made streams: the residency figures as vLLM's
KVCacheMetricsCollector defines them, worked out here by hand."""

import numpy as np
import pytest

from tracer import abi
from tracer.analysis import lifecycle
from tracer.trace import stream


def make_stream(events):
    """events: (ts_ns, op name, req, group, [block ids]) in firing order."""
    ops = np.zeros(len(events), dtype=stream.OP_TABLE)
    values, at = [], 0
    for i, (ts, op, req, group, ids) in enumerate(events):
        ops[i]["seq"], ops[i]["ts_ns"], ops[i]["op"] = i, ts, abi.OPS[op]
        ops[i]["cache_id"], ops[i]["cache_index"] = req, group
        ops[i]["items"] = len(ids)
        ops[i]["start"], ops[i]["stop"], ops[i]["complete"] = at, at + len(ids), True
        values += ids
        at += len(ids)
    return stream.OpStream(ops, np.array(values, dtype=np.int64))


S = 1_000_000_000


def test_residency_as_vllm_defines_it():
    ev = lifecycle.events(make_stream([
        (0 * S, "block_alloc", 1, 0, [5, 6]),     # 5 and 6 born at 0
        (1 * S, "block_hit", 2, 0, [5]),          # 5 touched at 1
        (3 * S, "block_hit", 3, 0, [5]),          # and at 3: reuse gap 2
        (4 * S, "block_free", 1, 0, [5, 6]),      # a free is no access
        (10 * S, "block_alloc", 4, 0, [5, 0]),    # 5 reused: life 10, idle 7; 0 is padding
        (12 * S, "block_hit", 5, 0, [7]),         # 7: first seen by a hit (born before)
        (15 * S, "block_alloc", 6, 0, [7, 6]),    # 7: idle 3, no lifetime; 6: life 15, idle 15
    ]))
    assert len(ev) == 10  # the null id is not a block
    r = lifecycle.residency(ev)
    assert sorted(r["lifetime"].tolist()) == [10.0, 15.0]
    assert sorted(r["idle_before_evict"].tolist()) == [3.0, 7.0, 15.0]
    assert r["reuse_gap"].tolist() == [2.0]
    # 5 at 10, 7 and 6 at 15: three re-allocations, none an eviction of a
    # cached block, where the screen had said "0 evicted" above them
    assert lifecycle.summary(ev)["reallocated"] == 3
    assert lifecycle.summary(ev)["blocks"]["evict"] == 0
    assert lifecycle.histogram(r["lifetime"])[-1] == ("+Inf", 2)
    assert dict(lifecycle.histogram(r["lifetime"], bounds=(10, 20))) == {10: 1, 20: 2, "+Inf": 2}


@pytest.mark.parametrize("seed", range(6))
def test_residency_equals_the_event_by_event_reading(seed):
    """residency() (one pass over sorted arrays) against Residency.add (the
    live path's reading, one event at a time): the same samples in the same
    order, so that even the histograms' float sums agree.  Random events of
    three processes and two groups over few blocks, with equal timestamps
    and lives that begin with a hit."""
    rng = np.random.default_rng(seed)
    events, pids = [], []
    for i in range(400):
        op = rng.choice(["block_alloc", "block_hit", "block_free", "block_cache"])
        ts = int(rng.integers(0, 60)) * S // 7  # many ties: firing order decides
        events.append((ts, str(op), int(rng.integers(1, 9)), int(rng.integers(0, 2)),
                       rng.integers(0, 7, int(rng.integers(1, 4))).tolist()))
        pids.append(int(rng.choice([101, 202, 303])))
    s = make_stream(events)
    s.ops["pid"] = pids
    ev = lifecycle.events(s)
    r = lifecycle.Residency()
    r.add(ev)
    per_pid = r.take().values()
    got = lifecycle.residency(ev)
    for name in lifecycle.RESIDENCY:
        want = np.array([v for p in per_pid for v in p[name]], dtype=np.int64) / 1e9
        assert got[name].tolist() == want.tolist(), name
    assert len(got["lifetime"]) and len(got["reuse_gap"])  # each kind was tried
    # the summary's re-allocations, counted apart: one per idle_before_evict
    assert lifecycle.reallocations(ev) == len(got["idle_before_evict"])


def test_groups_are_separate_pools():
    ev = lifecycle.events(make_stream([
        (0, "block_alloc", 1, 0, [3]), (5 * S, "block_alloc", 1, 1, [3]),
        (9 * S, "block_alloc", 2, 0, [3])]))
    r = lifecycle.residency(ev)
    assert r["lifetime"].tolist() == [9.0]  # group 1's block 3 is another block


def test_timeline_and_summary():
    ev = lifecycle.events(make_stream([
        (1 * S, "block_alloc", 0xab, 0, [1, 2]), (2 * S, "block_hit", 0xcd, 0, [1]),
        (3 * S, "block_free", 0xab, 0, [1, 2])]))
    tl = lifecycle.timelines(ev, t0_ns=S, names={0xab: "req-a"})
    assert tl == [{"req": f"{0xab:016x}", "id": "req-a",
                   "events": [[0.0, "alloc", 0, [1, 2]], [2.0, "free", 0, [1, 2]]]},
                  {"req": f"{0xcd:016x}", "id": "", "events": [[1.0, "hit", 0, [1]]]}]
    # the request ops interleave by time: arrival, preemption, finish
    tl = lifecycle.timelines(ev, t0_ns=S, requests=[(S // 2, 0xab, "arrive", 100),
                                                     (5 * S // 2, 0xab, "preempt", 64),
                                                     (4 * S, 0xab, "finish", 3)])
    assert [e[1] for e in tl[0]["events"]] == ["arrive", "alloc", "preempt", "free", "finish"]
    assert tl[0]["events"][2] == [1.5, "preempt", None, 64]
    s = lifecycle.summary(ev)
    assert s["blocks"] == {"alloc": 2, "hit": 1, "cache": 0, "free": 2, "evict": 0}
    assert abs(s["prefix_served_share"] - 1 / 3) < 1e-12 and s["requests"] == 2


@pytest.mark.parametrize("seed", range(4))
def test_a_timeline_limit_keeps_the_first_requests_seen(seed):
    """timelines(limit=n) is the whole list's first n: requests first seen
    by time, then event order, a request event before a block event at the
    same time; with many ties, request events of their own, and requests
    that have only those."""
    rng = np.random.default_rng(seed)
    events = [(int(rng.integers(0, 9)) * S, str(rng.choice(["block_alloc", "block_hit"])),
               int(rng.integers(1, 30)), 0, rng.integers(1, 9, 2).tolist()) for _ in range(200)]
    events.sort(key=lambda e: e[0])  # fired in time order, many at one time
    ev = lifecycle.events(make_stream(events))
    requests = [(int(rng.integers(0, 9)) * S, int(rng.integers(1, 40)),
                 str(rng.choice(["arrive", "finish"])), 1) for _ in range(60)]
    whole = lifecycle.timelines(ev, requests=requests)
    assert len(whole) > 12
    # a plain reading: every event with its sort key, (time, a request
    # event first, then the order fired or listed), grouped by request in
    # the order each was first seen
    keyed = [((ts, 1, i), req, [ts / 1e9, name.split("_")[1], group, blocks])
             for i, (ts, name, req, group, blocks) in enumerate(events)]
    keyed += [((ts, 0, i), req, [ts / 1e9, what, None, tokens])
              for i, (ts, req, what, tokens) in enumerate(requests)]
    want = {}
    for _, req, entry in sorted(keyed, key=lambda k: k[0]):
        want.setdefault(req, []).append(entry)
    assert [(int(t["req"], 16), t["events"]) for t in whole] == list(want.items())
    for n in (0, 1, 5, 12, len(whole) + 3):
        assert lifecycle.timelines(ev, requests=requests, limit=n) == whole[:n], n


def test_incomplete_event_left_out_and_counted():
    st = make_stream([(0, "block_alloc", 1, 0, [1, 2]), (1, "block_alloc", 2, 0, [3])])
    st.ops["complete"][1] = False
    ev = lifecycle.events(st)
    assert ev.block.tolist() == [1, 2] and ev.incomplete == 1


def test_request_events_from_the_stream():
    st = make_stream([(1, "block_alloc", 7, 0, [1])])
    ops = np.zeros(3, dtype=stream.OP_TABLE)
    for i, (ts, op, items) in enumerate([(0, "request", 90), (2, "req_preempt", 40),
                                         (3, "req_finish", 5)]):
        ops[i]["ts_ns"], ops[i]["op"], ops[i]["cache_id"], ops[i]["items"] = ts, abi.OPS[op], 7, items
    both = stream.OpStream(np.concatenate([st.ops, ops]), st.values)
    assert lifecycle.request_events(both) == [(0, 7, "arrive", 90), (2, 7, "preempt", 40),
                                              (3, 7, "finish", 5)]


def test_request_names_from_the_end_document():
    end = {"processes": [{"lifecycle": {"requests": [{"req": "00000000000000ff", "id": "x"}]}},
                         {"lifecycle": None}, {}]}
    assert lifecycle.request_names(end) == {255: "x"}


def brute_distances(hashes):
    """Stack distances the slow way: the distinct hashes between two references."""
    out = []
    for i, h in enumerate(hashes):
        prev = [j for j in range(i) if hashes[j] == h]
        out.append(len(set(hashes[prev[-1] + 1:i]) - {h}) if prev else -1)
    return out


def test_stack_distances_match_the_definition():
    rng = np.random.default_rng(7)
    for _ in range(20):
        h = rng.integers(1, 12, size=int(rng.integers(0, 60))).astype(np.uint64)
        assert lifecycle.stack_distances(h).tolist() == brute_distances(h.tolist())
    assert lifecycle.stack_distances(np.array([5, 6, 7, 5, 5], np.uint64)).tolist() == \
        [-1, -1, -1, 2, 0]


def test_miss_ratio_curve_from_hits_and_caches():
    """Contents a, b, c cached, then a hit, then c and b computed again
    (evicted meanwhile): an LRU cache of 3 blocks would have hit all three
    re-references, one of 2 blocks only c's (distance 1), one block none."""
    a, b, c = 11, 12, 13
    st = make_stream([
        (1, "block_cache", 1, 0, [1, 2, 3]), (2, "block_hit", 2, 0, [1]),
        (3, "block_cache", 3, 0, [4]), (4, "block_cache", 4, 0, [5])])
    # the hashes follow the ids in the stream: rebuild with them
    ops, vals = st.ops.copy(), []
    hashes = [[a, b, c], [a], [c], [b]]
    at = 0
    for i, hs in enumerate(hashes):
        ids = st.values[st.ops["start"][i]:st.ops["stop"][i]].tolist()
        ops[i]["flags"] |= abi.EV_HASHES
        ops[i]["start"], ops[i]["stop"] = at, at + 2 * len(ids)
        vals += ids + hs
        at += 2 * len(ids)
    ev = lifecycle.events(stream.OpStream(ops, np.array(vals, np.int64)))
    assert ev.block.tolist() == [1, 2, 3, 1, 4, 5] and ev.hash.tolist() == [a, b, c, a, c, b]
    mrc = lifecycle.miss_ratio_curve(ev, sizes=[1, 2, 3])
    # distances: a -1, b -1, c -1, a 2, c 1, b 2
    assert mrc["references"] == 6 and mrc["compulsory"] == 3 and mrc["observed_hits"] == 1
    assert mrc["refetched"] == 2
    assert mrc["curve"] == [[1, 0.0], [2, 1 / 6], [3, 3 / 6]]
    assert lifecycle.miss_ratio_curve(lifecycle.events(st)) is None  # no hashes passed
