"""The plugin tier's lifecycle probes (block_alloc, block_hit, block_cache,
block_free, block_evict, request, req_preempt, req_finish) against kvsim's own
books: real BPF, real processes.

kvsim fires them from its scheduler and allocator (tests/target/kvsim.c:
life_add(), request_start(), preempt_last(), finish_seq()) and counts what
it fired in its --truth "lifecycle" (write_lifecycle() describes each
field); every expected value here comes from that truth or from kvsim's
--ops-log, never from the tracer's code.  The first tests check the truth
against itself, without a tracer, so that it is worth comparing with."""

import json
import subprocess

import numpy as np
import pytest

from conftest import KVSIM, Kvsim, Tracer, dense, kvsim_ops_log, run_kvtrace
from test_e2e_record import report_json
from tracer import abi
from tracer.trace import tracefile

KINDS = ("alloc", "hit", "cache", "free", "evict")
BLOCK_OPS = tuple(f"block_{k}" for k in KINDS)
REQUEST_OPS = ("request", "req_preempt", "req_finish")
LIFE_OPS = BLOCK_OPS + REQUEST_OPS + ("step_reqs",)
REQ_FIELDS = ("req", "prompt_tokens", "output_tokens", "preemptions", "recomputed", "blocks")
# the workloads whose scheduler does something different each: a plain pool,
# forks (samples share their prompt), swap preemption, the prefix cache, the
# sliding window
WORKLOADS = ("default", "beam", "swap", "prefix", "window")


def fnv1a64(s: str) -> int:
    h = 0xcbf29ce484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001b3) & (2 ** 64 - 1)
    return h


def untraced_truth(tmp_path, workload, *extra):
    path = tmp_path / f"truth-{workload}.json"
    r = subprocess.run([KVSIM, "--workload", workload, "--truth", path, "--quiet",
                        *map(str, extra)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(path.read_text())


def dense_blocks(pairs, n):
    """conftest's dense() as an array, for lifecycle blocks: never the null block."""
    assert all(b > 0 for b, _ in pairs), pairs
    return np.array(dense(pairs, n), np.int64)


# -- kvsim's lifecycle truth against itself (no tracer) ----------------------

# windows over samples (a shared prompt block is released by its last
# sample) and over swaps
MIXED = [("beam", ("--sliding-window", 17)), ("swap", ("--sliding-window", 40))]


@pytest.mark.parametrize("workload,extra", [(w, ()) for w in WORKLOADS + ("stress", "mla")] +
                         MIXED + [("prefix", ("--block-size", 48)),
                                  ("prefix", ("--block-size", 64))])
def test_lifecycle_truth_agrees_with_itself(tmp_path, workload, extra):
    t = untraced_truth(tmp_path, workload, *extra)
    life = t["lifecycle"]
    n = t["num_blocks"]
    assert (life["group_id"], life["num_blocks"]) == (0, n)
    per = {k: dense_blocks(life["blocks"][k], n) for k in KINDS}
    assert {k: int(v.sum()) for k, v in per.items()} == life["totals"]
    # every run ends with every request finished: each block a request took
    # (from the pool or the cache) it released, once
    assert np.array_equal(per["alloc"] + per["hit"], per["free"])
    assert life["totals"]["alloc"] > 0
    # kvsim pins its cached prefix blocks: it never evicts one
    assert life["totals"]["evict"] == 0 and life["calls"]["block_evict"] == 0
    # the prefix cache's own counters
    assert life["totals"]["hit"] == t["prefix_hits"]
    prefix_blocks = 136 // t["block_size"] if workload == "prefix" else 0
    assert life["blocks"]["cache"] == [[b, 1] for b, _ in life["blocks"]["cache"]]
    assert life["totals"]["cache"] == prefix_blocks

    reqs = life["requests"]
    assert [r["id"] for r in reqs] == [f"kvsim-req-{i}" for i in range(len(reqs))]
    assert len(reqs) == t["requests"] == life["calls"]["request"] == life["calls"]["req_finish"]
    for r in reqs:
        assert r["req"] == f"{fnv1a64(r['id']):016x}", r
        assert r["blocks"]["alloc"] + r["blocks"]["hit"] == r["blocks"]["free"] > 0, r
        assert r["prompt_tokens"] > 0 and r["output_tokens"] > 0, r
        assert (r["recomputed"] > 0) == (r["preemptions"] > 0), r
    for k in KINDS:
        assert sum(r["blocks"][k] for r in reqs) == life["totals"][k], k
    assert sum(r["preemptions"] for r in reqs) == t["preemptions"] == \
        life["calls"]["req_preempt"]
    # the block table's rows, split by request (step_reqs), add up to what
    # the write op wrote (a layer's slots) and what attention read
    assert sum(r["tokens_written"] for r in reqs) == t["slots_written"] // t["num_layers"] > 0
    assert sum(r["block_reads"] for r in reqs) == t["reads"]["reads"] > 0
    assert sum(r["step_rows"] for r in reqs) == t["reads"]["requests"]
    assert life["calls"]["step_reqs"] == t["reads"]["steps"]  # one a step, before its table
    if workload == "default":  # no sharing, no recomputation: the identity
        for r in reqs:
            assert r["tokens_written"] == r["prompt_tokens"] + r["output_tokens"] - 1, r
    # calls: at most one per request and kind and scheduler action, each
    # with at least one block
    for k in KINDS:
        assert life["calls"][f"block_{k}"] <= life["totals"][k], k


def test_lifecycle_truth_repeat_names_new_requests(tmp_path):
    """--repeat runs the same requests again under new ids: the per-block
    counts double, the per-request entries repeat under the next ids."""
    one = untraced_truth(tmp_path, "swap")["lifecycle"]
    two = untraced_truth(tmp_path, "swap", "--repeat", 2)["lifecycle"]
    n = len(one["requests"])
    assert [r["id"] for r in two["requests"]] == [f"kvsim-req-{i}" for i in range(2 * n)]
    for a, b in zip(one["requests"] * 2, two["requests"]):
        assert {k: a[k] for k in REQ_FIELDS if k != "req"} == \
            {k: b[k] for k in REQ_FIELDS if k != "req"}
    for k in KINDS:
        assert two["blocks"][k] == [[b, 2 * c] for b, c in one["blocks"][k]], k
    assert two["calls"] == {op: 2 * c for op, c in one["calls"].items()}


# -- the tracer against it ---------------------------------------------------

def assert_lifecycle_matches_truth(doc, truth):
    """The tracer's --json lifecycle, exactly kvsim's books."""
    assert doc["exact"] is True, doc["inexact_reasons"]
    (proc,) = doc["processes"]
    assert proc["pid"] == truth["pid"]
    want, got = truth["lifecycle"], proc["lifecycle"]
    assert got is not None, "no lifecycle in the tracer's JSON"
    for k in KINDS:
        assert got["blocks"][k] == want["blocks"][k], k
    assert got["totals"] == want["totals"]
    # per request, by id; in the order kvsim created them (first_ns order)
    assert [r["id"] for r in got["requests"]] == [r["id"] for r in want["requests"]]
    for g, w in zip(got["requests"], want["requests"]):
        assert {k: g[k] for k in REQ_FIELDS} == {k: w[k] for k in REQ_FIELDS}, w["id"]
        # every request finished; req_finish is its last event
        assert 0 < g["first_ns"] <= g["last_ns"] == g["finish_ns"], g
    # the op totals: one call per probe call kvsim made, the ids it passed
    zero = {"calls": 0, "items": 0, "slots": 0, "padding": 0}
    for op in LIFE_OPS:
        st = doc["ops"].get(op, zero)
        assert st["calls"] == want["calls"][op], op
        assert st.get("read_errors", 0) == st.get("truncated", 0) == 0, op
    for k, op in zip(KINDS, BLOCK_OPS):
        st = doc["ops"].get(op, zero)
        assert (st["items"], st["slots"], st["padding"]) == (want["totals"][k],) * 2 + (0,), op
    for op, field in zip(REQUEST_OPS, ("prompt_tokens", "recomputed", "output_tokens")):
        assert doc["ops"].get(op, zero)["items"] == sum(r[field] for r in want["requests"]), op


def assert_workload_has_events(truth, workload):
    """What each workload must do (so that equality is not 0 == 0)."""
    life = truth["lifecycle"]
    tot = life["totals"]
    assert tot["alloc"] > 0 and tot["free"] > 0 and len(life["requests"]) == truth["requests"] > 0
    if workload == "prefix":
        # kvsim's shared prefix is 136 tokens: its full blocks, at the run's size
        assert tot["hit"] == truth["prefix_hits"] > 0 and \
            tot["cache"] == 136 // truth["block_size"]
    if workload == "swap":
        assert truth["preemptions"] > 0 and life["calls"]["req_preempt"] == truth["preemptions"]
        assert sum(r["recomputed"] for r in life["requests"]) > 0
    if workload == "beam":  # samples: more tokens out than sequences
        assert any(r["output_tokens"] > 64 for r in life["requests"])


def assert_stream_is_the_ops_log(trace, log, truth):
    """Every lifecycle op the tracer recorded is the one kvsim fired (its
    --ops-log, written just before each probe), in firing order, with the
    same request and block ids; nothing missing, nothing more."""
    t = tracefile.read(str(trace))
    assert t.complete and t.ops.ops["complete"].all()
    o = t.ops.ops
    life_ids = [abi.OPS[op] for op in LIFE_OPS]
    idx = [i for i in np.argsort(o["seq"], kind="stable") if int(o["op"][i]) in life_ids]
    got = [(abi.OP_NAMES[int(o["op"][i])], int(o["cache_id"][i]),
            tuple(t.ops.values_of(i).tolist())) for i in idx]
    fired = [(name, cache_id, tuple(v.tolist())) for name, cache_id, v, _ in kvsim_ops_log(log)
             if name in LIFE_OPS]
    assert got == fired
    # block events carry the group (0): the op record's cache_index
    assert {int(o["cache_index"][i]) for i in idx
            if abi.OP_NAMES[int(o["op"][i])] in BLOCK_OPS} == {0}
    # and the log is kvsim's truth: per block and kind, per request
    n = truth["num_blocks"]
    for k, op in zip(KINDS, BLOCK_OPS):
        ids = [b for name, _, v in fired if name == op for b in v]
        assert np.bincount(np.array(ids, np.int64), minlength=n).tolist() == \
            dense_blocks(truth["lifecycle"]["blocks"][k], n).tolist(), op
    reqs = {int(r["req"], 16): r for r in truth["lifecycle"]["requests"]}
    assert [c for name, c, _ in fired if name == "request"] == list(reqs)
    for c, r in reqs.items():
        mine = [name for name, cc, _ in fired if cc == c]
        assert mine[0] == "request" and mine[-1] == "req_finish", r["id"]
        assert mine.count("req_preempt") == r["preemptions"], r["id"]


@pytest.mark.usefixtures("no_leftovers")
# vLLM 0.34's default block size, 64, beside kvsim's 16
@pytest.mark.parametrize("workload,extra", [(w, ()) for w in WORKLOADS] + MIXED[:1] +
                         [("prefix", ("--block-size", 64))])
def test_attach_lifecycle_matches_truth(tmp_path, workload, extra):
    out, truth_path = tmp_path / "agg.json", tmp_path / "truth.json"
    trace, log = tmp_path / "run.kvt", tmp_path / "ops.log"
    r = run_kvtrace("attach", "-q", "--json", out, "-o", trace, "--", KVSIM, "--workload",
                    workload, *extra, "--truth", truth_path, "--ops-log", log, "--quiet")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "target exited" and doc["target_exit_status"] == 0
    truth = json.loads(truth_path.read_text())
    assert_workload_has_events(truth, workload)
    assert_lifecycle_matches_truth(doc, truth)
    assert_stream_is_the_ops_log(trace, log, truth)
    assert_request_access_matches_truth(trace, truth)


def assert_request_access_matches_truth(trace, truth):
    """report's per-request writes and reads (step_reqs naming the block
    table's rows) are kvsim's, counted where it builds each row."""
    lc = report_json(trace)["lifecycle"]
    assert lc["summary"]["access_steps"] == {"steps": truth["reads"]["steps"], "unmatched": 0}
    want = {w["id"]: w for w in truth["lifecycle"]["requests"]}
    assert sorted(t["id"] for t in lc["requests"]) == sorted(want)
    for t in lc["requests"]:
        a, w = t["access"], want[t["id"]]
        assert (a["steps"], a["tokens_written"], a["block_reads"]) == \
            (w["step_rows"], w["tokens_written"], w["block_reads"]), t["id"]
        assert sum(a["blocks"]["tokens_written"]) == a["tokens_written"], t["id"]


@pytest.mark.usefixtures("no_leftovers")
def test_attach_pid_lifecycle_over_repeats(tmp_path):
    """attach -p to a paused kvsim (attached before it runs), two runs of the
    swap workload: every request of both runs, under its own id."""
    sim = Kvsim(tmp_path, "swap", "--repeat", 2)
    try:
        tracer = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "agg.json")
        tracer.wait_attached()
        sim.go()
        assert sim.wait() == 0
        rc, out, err = tracer.finish()
        assert rc == 0, err
        truth = sim.truth()
    finally:
        sim.kill()
    doc = json.loads((tmp_path / "agg.json").read_text())
    assert len(truth["lifecycle"]["requests"]) == 2 * 24
    assert_workload_has_events(truth, "swap")
    assert_lifecycle_matches_truth(doc, truth)
