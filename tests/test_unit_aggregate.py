"""Unit tests of tracer/aggregate.py on hand-made raw map copies (the dict
Tracer.read_maps() returns).  Every expected number is written by hand."""

import json

import numpy as np
import pytest

from tracer.analysis import aggregate
from tracer.analysis.aggregate import Aggregate, bucket, rates

MAX_BLOCKS = 16  # row length of the fake block_writes / block_moves maps
COUNTERS = ("calls", "items", "slots", "padding", "bytes", "truncated",
            "read_errors", "out_of_range")
# enum kvtrace_move in bpf/kvtrace.h: rows of block_moves for one process
COPY_SRC, COPY_DST, SWAP_OUT, SWAP_IN = range(4)


def row(values):
    """A block row of MAX_BLOCKS counters, values at its start."""
    r = np.zeros(MAX_BLOCKS, dtype=np.uint64)
    r[:len(values)] = values
    return r


def cache(pid, cache_id, index, num_blocks, writes, op="reshape_and_cache", **kw):
    c = dict(pid=pid, cache_id=cache_id, index=index, op=op, block_size=16,
             num_blocks=num_blocks, calls=kw.get("calls", 1), slots=kw.get("slots", 0),
             padding=kw.get("padding", 0), out_of_range=kw.get("out_of_range", 0))
    if writes is not None:  # absent for caches beyond --max-layers
        c["writes"] = row(writes)
    return c


def stats(**kw):
    return {k: kw.get(k, 0) for k in COUNTERS}


def raw_maps(**over):
    moves = np.zeros((4, MAX_BLOCKS), dtype=np.uint64)
    moves[COPY_SRC, 2] = 1
    moves[COPY_DST, 5] = 1
    moves[SWAP_OUT, 1] = 2
    moves[SWAP_IN, 12] = 9  # beyond num_blocks (6): must be cut
    raw = dict(
        time=10.0,
        # listed out of index order on purpose: layers follow the index
        caches=[cache(100, 0xB, 1, 6, [2, 4, 5, 0, 0, 0]),
                cache(100, 0xA, 0, 6, [3, 0, 5, 0, 0, 1], slots=9),
                cache(200, 0xC, 2, 0, [0, 1, 0, 7]),      # num_blocks unknown
                cache(200, 0xD, 99, 6, None)],           # beyond --max-layers
        op_stats={(100, "copy_blocks"): stats(calls=2, items=3, bytes=8192),
                  (100, "reshape_and_cache"): stats(calls=4, items=20, slots=19, padding=1),
                  (200, "reshape_and_cache"): stats(calls=1, items=8, slots=8)},
        log2={"reshape_and_cache": {4: 2, 1: 3}},
        moves={100: moves, 200: np.zeros((4, MAX_BLOCKS), dtype=np.uint64)},
        stacks=[],
        globals={"next_cache": 4, "foreign": 5, "no_site": 6, "cache_full": 0},
        records=7, lost=0)
    raw.update(over)
    return raw


@pytest.fixture
def agg():
    return Aggregate.from_maps(raw_maps(), comms={100: "vllm", 200: "kvsim"},
                               probe_files={100: ["/lib/x.so"]})


def test_layers_ordered_by_index(agg):
    p = agg.processes[100]
    assert [(l.layer, l.cache_id, l.index) for l in p.layers] == [(0, 0xA, 0), (1, 0xB, 1)]
    assert [(l.layer, l.cache_id) for l in agg.processes[200].layers] == [(0, 0xC), (1, 0xD)]
    assert p.comm == "vllm" and p.probe_files == ["/lib/x.so"]


def test_writes_trimmed_to_num_blocks(agg):
    p100, p200 = agg.processes[100], agg.processes[200]
    assert [l.writes.tolist() for l in p100.layers] == [[3, 0, 5, 0, 0, 1], [2, 4, 5, 0, 0, 0]]
    # num_blocks 0: cut after the last block written
    assert p200.layers[0].writes.tolist() == [0, 1, 0, 7]
    # no row in block_writes
    assert p200.layers[1].writes.tolist() == []
    # pid 200: its moves rows are cut to the largest declared num_blocks (6,
    # of the row-less layer), which is longer than any writes row (4)
    assert (p100.num_blocks, p200.num_blocks) == (6, 6)
    assert p200.moves["copy_src"].tolist() == [0] * 6


def test_tokens_and_all_layer_writes(agg):
    p = agg.processes[100]
    assert p.tokens.tolist() == [3, 4, 5, 0, 0, 1]  # per-block max over layers
    assert p.all_layer_writes.tolist() == [5, 4, 10, 0, 0, 1]  # per-block sum


def test_moves_trimmed(agg):
    m = agg.processes[100].moves
    assert {k: v.tolist() for k, v in m.items()} == {
        "copy_src": [0, 0, 1, 0, 0, 0], "copy_dst": [0, 0, 0, 0, 0, 1],
        "swap_out": [0, 2, 0, 0, 0, 0], "swap_in": [0, 0, 0, 0, 0, 0]}


def test_moves_without_layers_cut_after_last_nonzero():
    moves = np.zeros((4, MAX_BLOCKS), dtype=np.uint64)
    moves[COPY_DST, 3] = 2
    a = Aggregate.from_maps(raw_maps(caches=[], op_stats={}, moves={300: moves}))
    assert a.processes[300].moves["copy_dst"].tolist() == [0, 0, 0, 2]
    assert a.processes[300].moves["copy_src"].tolist() == []


def test_op_totals_summed_across_processes(agg):
    t = agg.op_totals()
    assert list(t) == ["reshape_and_cache", "copy_blocks"]  # op enum order
    assert t["reshape_and_cache"] == stats(calls=5, items=28, slots=27, padding=1)
    assert t["copy_blocks"] == stats(calls=2, items=3, bytes=8192)


def test_clean_is_exact_even_with_lost_records():
    # lost perf records do not touch the counters: still exact
    a = Aggregate.from_maps(raw_maps(lost=123))
    assert a.inexact_reasons() == []
    doc = a.to_json()
    assert doc["exact"] is True and doc["inexact_reasons"] == [] and doc["lost_records"] == 123


@pytest.mark.parametrize("counter,words", [
    ("truncated", "read limit"),
    ("read_errors", "could not be read"),
    ("out_of_range", "--max-blocks"),
])
def test_inexact_reasons_from_op_stats(counter, words):
    # 2 in one process + 1 in another: the reason must give the sum, 3
    op_stats = {(100, "reshape_and_cache"): stats(calls=1, **{counter: 2}),
                (200, "copy_blocks"): stats(calls=1, **{counter: 1})}
    reasons = Aggregate.from_maps(raw_maps(op_stats=op_stats)).inexact_reasons()
    assert len(reasons) == 1
    assert reasons[0].startswith("3 ") and words in reasons[0]


@pytest.mark.parametrize("name,words", [("cache_full", "--max-layers"),
                                        ("missed_hits", "skipped")])
def test_inexact_reason_from_globals(name, words):
    g = {"next_cache": 64, "foreign": 0, "no_site": 0, name: 4}
    a = Aggregate.from_maps(raw_maps(globals=g))
    reasons = a.inexact_reasons()
    assert len(reasons) == 1 and reasons[0].startswith("4 ") and words in reasons[0]
    assert a.to_json()["exact"] is False


@pytest.mark.parametrize("status,reason", [
    ("tested vLLM release 0.34.0", None),
    ("untested vLLM release 0.99.1", "pid 300: plugin tier on an untested vLLM release 0.99.1"),
    ("tested vLLM release 0.34.0; not exact here: Mamba align mode",
     "pid 300: plugin tier not exact here: Mamba align mode"),
    ("refused vLLM release 0.99.1: BlockPool.touch is missing", None),
])
def test_inexact_reason_from_the_plugins_status(status, reason):
    # the plugin's line (docs/plugin.md): an untested release, or a
    # configuration it does not trace exactly, makes the counts not exact
    moves = np.zeros((4, MAX_BLOCKS), dtype=np.uint64)
    a = Aggregate.from_maps(raw_maps(caches=[], op_stats={}, moves={300: moves}),
                            proc_info={300: {"plugin_status": status}})
    assert a.inexact_reasons() == ([reason] if reason else [])
    assert a.to_json()["processes"][0]["plugin_status"] == status


def test_all_reasons_together():
    op_stats = {(1, "swap_blocks"): stats(truncated=1, read_errors=1, out_of_range=1)}
    g = {"next_cache": 0, "foreign": 0, "no_site": 0, "cache_full": 1, "missed_hits": 1}
    assert len(Aggregate.from_maps(raw_maps(op_stats=op_stats, globals=g)).inexact_reasons()) == 5


def test_to_json(agg):
    doc = agg.to_json(duration_s=1.5, stop_reason="duration")
    json.dumps(doc)  # numpy scalars would make this raise
    assert set(doc) == {"schema", "version", "duration_s", "stop_reason", "records",
                        "lost_records", "exact", "inexact_reasons", "dropped", "ops",
                        "items_log2", "processes"}
    assert (doc["schema"], doc["version"]) == ("kvtrace-bpf/aggregate", 1)
    assert (doc["duration_s"], doc["stop_reason"], doc["records"]) == (1.5, "duration", 7)
    assert doc["dropped"] == {"foreign_process_hits": 5, "unknown_site_hits": 6}
    assert [p["pid"] for p in doc["processes"]] == [100, 200]
    p = doc["processes"][0]
    assert p["comm"] == "vllm" and p["probe_files"] == ["/lib/x.so"]
    assert p["ops"]["reshape_and_cache"]["calls"] == 4
    # sparse [[block, count]], zero blocks left out
    assert [l["writes"] for l in p["layers"]] == [[[0, 3], [2, 5], [5, 1]],
                                                  [[0, 2], [1, 4], [2, 5]]]
    assert p["layers"][0]["slots"] == 9 and p["layers"][0]["cache_id"] == 0xA
    assert p["blocks"] == {"num_blocks": 6,
                           "tokens": [[0, 3], [1, 4], [2, 5], [5, 1]],
                           "copy_src": [[2, 1]], "copy_dst": [[5, 1]],
                           "swap_out": [[1, 2]], "swap_in": []}
    assert doc["processes"][1]["layers"][1]["writes"] == []


def test_items_log2_rows_shape(agg):
    rows = agg.to_json()["items_log2"]["reshape_and_cache"]
    assert [r[2] for r in rows] == [3, 2]  # counts, by ascending slot
    assert all(lo <= hi for lo, hi, _ in rows)


def bcc_log2l(v):
    """bcc's bpf_log2l() (helpers.h), which the BPF program uses for op_log2:
    floor(log2(v)) + 1, and 1 for v == 0."""
    return max(v, 1).bit_length()


@pytest.mark.parametrize("items", [0, 1, 2, 3, 5, 8, 15, 16, 1000])
def test_items_log2_range_contains_the_items(items):
    slot = bcc_log2l(items)
    a = Aggregate.from_maps(raw_maps(log2={"copy_blocks": {slot: 1}}))
    [[lo, hi, n]] = a.to_json()["items_log2"]["copy_blocks"]
    assert n == 1 and lo <= items <= hi


def test_bcc_log2l_model():
    # the model above, checked against values worked out by hand
    assert [bcc_log2l(v) for v in (0, 1, 2, 3, 4, 7, 8, 2**32)] == [1, 1, 2, 2, 3, 3, 4, 33]


# -- bucket and rates -----------------------------------------------------------

@pytest.mark.parametrize("counts,n,sums,per", [
    (list(range(10)), 3, [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9], 4),
    (list(range(10)), 10, list(range(10)), 1),
    ([1, 2, 3], 100, [1, 2, 3], 1),
    ([1, 2, 3], 1, [6], 3),
    ([5, 5, 5, 5], 2, [10, 10], 2),
])
def test_bucket(counts, n, sums, per):
    got, got_per = bucket(np.array(counts, dtype=np.uint64), n)
    assert (got.tolist(), got_per) == (sums, per)
    assert len(got) <= n


def test_bucket_empty():
    got, per = bucket(np.zeros(0, dtype=np.uint64), 10)
    assert got.tolist() == [] and per == 1


def test_rates():
    before = Aggregate.from_maps(raw_maps(time=10.0, op_stats={
        (1, "copy_blocks"): stats(calls=10, items=100)}))
    now = Aggregate.from_maps(raw_maps(time=12.0, op_stats={
        (1, "copy_blocks"): stats(calls=14, items=160),
        (1, "swap_blocks"): stats(calls=2, items=6)}))  # new since `before`
    assert rates(now, before) == {"copy_blocks": {"calls": 2.0, "items": 30.0},
                                  "swap_blocks": {"calls": 1.0, "items": 3.0}}
    assert rates(before, now) == {}  # time went backwards: no rates
    assert rates(now, now) == {}


def test_op_counters_match_bpf_struct():
    # struct kvtrace_op_stats fields in bpf/kvtrace.h, by hand
    assert aggregate.OP_COUNTERS == COUNTERS
