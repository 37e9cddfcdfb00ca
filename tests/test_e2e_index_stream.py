"""The index stream end to end: real BPF, real kvsim, the Tracer API.

The raw slot numbers and block pairs that reach user space must reproduce
kvsim's ground truth exactly when nothing is lost: per-layer block writes,
copies, swaps, and the generations (true fill) kvsim keeps in its own books.
"""

import numpy as np
import pytest

from conftest import (WRITE_OPS, assert_log_covers, assert_matches_truth, kvsim_ops_log,
                      trace_stream, truth_records)
from tracer import abi
from tracer.analysis import occupancy
from tracer.kernel import session
from tracer.analysis.aggregate import Aggregate

pytestmark = [pytest.mark.usefixtures("no_leftovers"),
              # bcc 0.26 warns about str map names when used in-process
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

KINDS = {"write": 0, "copy": 1, "swap_in": 2}


def truth_generations(truth):
    """kvsim's generations, in the tracer's order: by block, then start."""
    g = truth["generations"]
    order = np.lexsort((np.array(g["start_step"]), np.array(g["block"])))
    out = {k: np.array(v)[order] for k, v in g.items() if k != "kind"}
    out["kind"] = np.array([KINDS[k] for k in g["kind"]])[order]
    return out


# every workload goes through record -> report too (test_e2e_record.py)
@pytest.mark.parametrize("workload,extra", [
    ("beam", ()),  # copies
    ("swap", ("--block-size", 24)),  # swaps, batches, the dividing slot stage
    ("mla", ("--block-size", 48, "--write-op", "cpu_attn_reshape_and_cache"))])
def test_stream_reproduces_truth(tmp_path, workload, extra):
    s, raw, truth = trace_stream(tmp_path, workload, *extra)
    n, bs = truth["num_blocks"], truth["block_size"]

    # nothing lost, every op whole, every chunk claimed
    assert raw["globals"]["records_lost"] == 0 and raw["globals"]["chunks_lost"] == 0
    assert s.complete and s.orphan_chunks == 0
    ops = s.ops
    assert len(ops) == truth_records(truth)
    # the exact counters in maps are as before
    assert_matches_truth(Aggregate.from_maps(raw).to_json(), truth)

    names = np.array([abi.OP_NAMES[o] for o in ops["op"]])
    for op, want in truth["ops"].items():
        mine = ops[names == op]
        assert len(mine) == want["calls"], op
        if op in WRITE_OPS:
            vals = np.concatenate([s.values_of(i) for i in np.flatnonzero(names == op)] or [[]])
            assert np.count_nonzero(vals >= 0) == want["slots"], op
            assert np.count_nonzero(vals == -1) == want["padding"], op  # padding as sent

    tokens = np.zeros(n, np.int64)
    for layer in truth["layers"]:
        mask = (ops["cache_id"] == layer["cache_id"]) & np.isin(names, WRITE_OPS)
        slots = np.concatenate([s.values_of(i) for i in np.flatnonzero(mask)])
        writes = np.bincount(slots[slots >= 0] // bs, minlength=n)
        assert writes.tolist() == layer["writes"], f"layer {layer['layer']}"
        np.maximum(tokens, writes, out=tokens)
    assert tokens.tolist() == truth["token_writes"]

    def pairs(op, flag=0):
        idx = np.flatnonzero((names == op) & ((ops["flags"] & flag) == flag))
        v = np.concatenate([s.values_of(i) for i in idx] or [np.zeros(0, np.int64)])
        return v[0::2], v[1::2]

    src, dst = pairs("copy_blocks")
    assert np.bincount(src, minlength=n).tolist() == truth["copy_src"]
    assert np.bincount(dst, minlength=n).tolist() == truth["copy_dst"]
    out_src, _ = pairs("swap_blocks", abi.EV_SWAP_OUT)
    _, in_dst = pairs("swap_blocks", abi.EV_SWAP_IN)
    assert np.bincount(out_src, minlength=n).tolist() == truth["swap_out"]
    assert np.bincount(in_dst, minlength=n).tolist() == truth["swap_in"]

    # true fill per generation, for every layer, against kvsim's books
    want = truth_generations(truth)
    sizes = {(c["pid"], c["cache_id"]): c["block_size"] for c in raw["caches"]}
    gens = occupancy.by_cache(s, sizes)
    assert len(gens) == truth["num_layers"]
    for key, g in gens.items():
        for field in ("block", "kind", "start_step", "last_step", "inherited", "fill",
                      "writes"):
            assert np.array_equal(getattr(g, field), want[field]), (key, field)
        assert g.active_blocks.tolist() == truth["active_blocks"]
        assert g.active_tokens.tolist() == truth["active_tokens"]
        assert g.steps == truth["steps"] and g.max_writes <= bs


@pytest.mark.parametrize("where", ["kernel", "reader"])
def test_losses_are_counted_and_marked_never_half_used(tmp_path, where, monkeypatch):
    """Under the stress workload, ops lose chunks or their records: in the
    kernel, to a one-page perf buffer; or in the reader, which sheds what a
    poll reads once more than MAX_PENDING_BYTES wait for the consumer
    (none here: every poll past its first records).  Every loss is counted, every op that lost values is
    incomplete, and every op the stream calls complete carries exactly the
    values kvsim handed its probe (kvsim's own per-op log, matched by the
    op's sequence number: kvsim is paused until the tracer attached, so op
    seq k is the k-th op it fired)."""
    log = tmp_path / "ops.log"
    if where == "reader":
        monkeypatch.setattr(session, "MAX_PENDING_BYTES", 0)
    s, raw, truth = trace_stream(tmp_path, "stress", "--ops-log", log,
                                 perf_pages=1 if where == "kernel" else 256)
    g = raw["globals"]
    calls = truth_records(truth)  # op records: every op, the block table once a step
    assert len(s.ops) + g["records_lost"] == calls
    assert g["chunks_lost"] > 0  # the point of the test: there were losses
    if where == "kernel":
        lossy = (s.ops["flags"] & abi.EV_CHUNKS_LOST) != 0
        assert lossy.any() and not s.ops["complete"][lossy].any()
    else:  # a poll sheds what it reads to its end: op records with their chunks
        assert g["records_lost"] > 0
    fired = kvsim_ops_log(log)
    assert_log_covers(s.ops["op"], fired)
    assert len(fired) == calls
    whole = np.flatnonzero(s.ops["complete"])
    assert len(whole) > 0
    for i in whole:
        op = s.ops[i]
        name, cache_id, values, flags = fired[int(op["seq"])]
        assert abi.OP_NAMES[int(op["op"])] == name, (i, int(op["seq"]))
        assert np.array_equal(s.values_of(i), values), (i, name)
        if name != "swap_blocks_batch":  # no cache: a batch of raw copies
            assert int(op["cache_id"]) == cache_id, (i, name)
        if name == "swap_blocks":
            assert op["flags"] & (abi.EV_SWAP_OUT | abi.EV_SWAP_IN) == flags
    assert not s.complete
    # the exact counters do not care
    assert_matches_truth(Aggregate.from_maps(raw).to_json(), truth)


def test_block_table_records_are_the_steps_live_sets(tmp_path):
    """One block_table record per step (the table is read once for all
    layers), in step order, each carrying that step's rows, reads, distinct
    blocks (the live set), null entries, tokens and tokens held in the live
    set as kvsim counted them when it built the table (--truth-steps)."""
    # a window too: null entries at some steps
    s, raw, truth = trace_stream(tmp_path, "prefix", "--truth-steps", "--sliding-window", 40)
    assert raw["globals"]["records_lost"] == 0
    rd = truth["reads"]
    bt = s.ops[s.ops["op"] == abi.OPS["block_table"]]
    bt = bt[np.argsort(bt["seq"])]
    assert len(bt) == rd["steps"] == len(rd["live_sets"])
    assert set(bt["cache_id"].tolist()) == {rd["group_id"]}
    got = np.stack([bt["rows"], bt["items"], bt["slots"], bt["padding"], bt["bytes"],
                    bt["held_tokens"]], axis=1)
    want = np.array([[rows, reads, distinct, nulls, tokens, held]
                     for _, rows, reads, distinct, tokens, nulls, held in rd["live_sets"]])
    assert np.array_equal(got, want)
    # a prefix workload's steps share blocks: fewer distinct blocks than reads
    assert (bt["slots"] < bt["items"]).any()
    assert bt["padding"].any()
