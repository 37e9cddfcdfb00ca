"""Access patterns from a recording (record -> report / export) against
kvsim's own read truth: real BPF, real processes.  Every expected value comes
from kvsim's books (--truth, --truth-steps), never from the tracer's code."""

import numpy as np
import pytest

from conftest import dense
from tracer.analysis import access_requests, access_stream
from tracer.analysis.report import Report
from tracer.trace import tracefile
from test_e2e_record import folded, record, report_json

pytestmark = pytest.mark.usefixtures("no_leftovers")

LIVE_SET = ("step", "requests", "reads", "distinct", "tokens", "null_entries", "held_tokens")


# the prefix workload also at vLLM 0.34's default block size, 64: the
# utilization (tokens held / the blocks' slots) uses the target's size
@pytest.mark.parametrize("workload,extra", [(w, ()) for w in
                                            ("prefix", "default", "swap", "window", "beam")] +
                         [("prefix", ("--block-size", "64"))])
def test_report_access_matches_truth(tmp_path, workload, extra, monkeypatch):
    trace, truth = record(tmp_path, workload, "--truth-steps", *extra)
    reads = truth["reads"]
    assert reads["block_size"] == (int(extra[1]) if extra else 16)
    doc = report_json(trace, "--kind", "reads")
    (acc,) = doc["access"]
    # totals of the stream's steps, and the group's shape
    assert acc["steps"] == reads["steps"]
    assert acc["layers"] == reads["layers"] == truth["num_layers"]
    assert acc["block_size"] == reads["block_size"]
    for key in ("reads", "distinct", "tokens", "held_tokens"):
        assert acc[key] == reads[key], key
    assert acc["reads_all_layers"] == reads["reads"] * truth["num_layers"]
    # the per-step working set and utilization, as percentiles of kvsim's steps
    steps = [dict(zip(LIVE_SET, row)) for row in reads["live_sets"]]
    distinct = np.array([s["distinct"] for s in steps], np.float64)
    assert acc["wss_blocks"] == [[p, float(np.percentile(distinct, p))]
                                 for p in (0, 25, 50, 75, 90, 99, 100)]
    util = np.array([s["held_tokens"] / (s["distinct"] * reads["block_size"])
                     for s in steps if s["distinct"]])
    assert [p for p, _ in acc["utilization"]] == [0, 25, 50, 75, 90, 99, 100]
    assert [v for _, v in acc["utilization"]] == pytest.approx(
        [float(np.percentile(util, p)) for p in (0, 25, 50, 75, 90, 99, 100)])
    # per block: frequency, hottest and coldest from kvsim's per-block reads
    per_block = dense(reads["per_block"], truth["num_blocks"])
    assert acc["blocks_read"] == int(np.count_nonzero(per_block))
    top = max(reads["per_block"], key=lambda bn: (bn[1], -bn[0]))
    assert acc["hottest"][0] == top
    # sharing: the most requests on one block at one step, from the histogram
    assert max(d for d, _ in acc["sharing_max_by_block"]) == \
        max(d for d, _ in reads["sharing"])
    # prefix reuse: blocks a request found in the cache at its first step.
    # kvsim fires step_reqs, so the report knows each row's request by name;
    # the reading from the rows alone (a trace without step_reqs) must agree
    reuse = acc["prefix_reuse"]
    assert reuse["by"] == "request ids"
    assert (reuse["blocks"], reuse["requests"]) == (truth["prefix_hits"], truth["requests"])
    assert reuse["steps_without_writes"] == 0
    rows_only = prefix_reuse_from_rows(trace)
    assert rows_only["by"] == "rows" and rows_only["steps_without_writes"] == 0
    if workload != "beam":  # from the rows, a fork reads its parent's blocks as reuse
        assert rows_only["blocks"] == truth["prefix_hits"]
    if workload not in ("beam", "swap"):  # a fork, a swapped-in request look new there
        # every request followed from row to row, none lost on the way (a
        # running request's row retired too early would start a new one)
        assert rows_only["requests"] == truth["requests"]
    # the read heatmap holds every read once
    assert doc["heatmap"]["what"].startswith("block reads")
    assert sum(map(sum, doc["heatmap"]["reads"])) == reads["reads"]
    # the map's margins are kvsim's: a column sums kvsim's reads of its
    # blocks (docs/report-json.md: column c covers blocks b0 + c*n//cols ..
    # max(that, b0 + (c+1)*n//cols - 1)), a row the reads of kvsim's steps
    # whose time falls in it (row k: (t - t0) * rows // (t1 - t0) == k, t
    # the step's table probe time, kvsim's steps in order)
    rep = Report(tracefile.load(str(trace)))
    whole = rep.heatmap(9, 31, kind="reads")
    n = whole.b1 - whole.b0
    want_cols = []
    for c in range(whole.cols):
        lo = whole.b0 + c * n // whole.cols
        hi = max(lo, whole.b0 + (c + 1) * n // whole.cols - 1)
        want_cols.append(int(sum(per_block[lo:hi + 1])))
    assert whole.cells.sum(axis=0).tolist() == want_cols
    (st,) = rep.steps
    assert len(st) == len(steps)
    t = st.ts_ns.astype(np.int64) - rep.t0
    row = (t - whole.t0_ns) * whole.rows // (whole.t1_ns - whole.t0_ns)
    want_rows = np.bincount(row, [s["reads"] for s in steps], minlength=whole.rows)
    assert whole.cells.sum(axis=1).tolist() == want_rows.astype(np.int64).tolist()
    # and the same cells when the reads are counted 50 at a time
    monkeypatch.setattr(access_stream, "_CHUNK_READS", 50)
    chunked = rep.heatmap(9, 31, kind="reads")
    assert np.array_equal(whole.cells, chunked.cells) and whole.cells.sum() == reads["reads"]
    # report's per-block reads (its aggregate, from the stream) equal kvsim's
    (proc,) = [p for p in doc["blocks"]["processes"] if p["groups"]]
    (group,) = proc["groups"]
    assert group["reads_per_block"] == reads["per_block"]
    assert group["last_read_step"] == reads["last_step"]
    if workload == "prefix":
        assert truth["prefix_hits"] > 0 and acc["sharing_mean"] > 1


def prefix_reuse_from_rows(trace):
    """The report's prefix reuse of the trace's one group as a trace
    without step_reqs gets it: inferred from the rows and the writes."""
    tr = tracefile.load(str(trace))
    (group,) = tr.groups
    (steps,) = access_stream.steps_of(tr.ops, tr.groups)
    return access_requests.prefix_reuse(tr.ops, access_stream.rows_of(tr.ops, steps), group["leader"])


def test_export_weighted_by_reads_matches_truth(tmp_path):
    trace, truth = record(tmp_path, "prefix")
    per_block = {}
    for frames, weight in folded(trace, "--by", "block", "--weight", "reads", "--group", 16):
        proc, op, group, rng, block = frames
        assert op == "block_table" and group == "group_00"
        lo, hi = (int(x) for x in rng.removeprefix("blocks_").split("-"))
        b = int(block.removeprefix("block_"))
        assert lo <= b <= hi and hi - lo + 1 == 16
        per_block[b] = per_block.get(b, 0) + weight
    assert sorted(per_block.items()) == [tuple(x) for x in truth["reads"]["per_block"]]
    # by stack: every read once, under the block_table op
    stacks = folded(trace, "--by", "stack", "--weight", "reads")
    assert sum(w for _, w in stacks) == truth["reads"]["reads"]
    assert all(f[-2:] == ["block_table", "group_00"] for f, _ in stacks)
