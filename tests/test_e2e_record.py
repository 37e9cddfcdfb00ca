"""record -> report / export against kvsim's own ground truth: real BPF, real
processes.  Occupancy figures are recomputed here from kvsim's generations
(its block manager's books), never from the tracer's code."""

import copy
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tracer import abi, cli
from tracer.analysis import access_counters, invariants
from tracer.trace import tracefile
from conftest import (KVSIM, KVSIM_LIB, Kvsim, WRITE_OPS, assert_matches_truth, kvsim_truth,
                      kvtrace_cmd, read_line, run_kvtrace, ROOT)

pytestmark = pytest.mark.usefixtures("no_leftovers")


def record(tmp_path, workload, *extra, tracer_args=()):
    """extra: kvsim's arguments; tracer_args: record's."""
    trace = tmp_path / f"{workload}.kvt"
    truth = tmp_path / f"{workload}.truth.json"
    r = run_kvtrace("record", "-o", trace, *tracer_args, "--", KVSIM, "--workload", workload,
                    *extra, "--truth", truth, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "recorded" in r.stderr and "lost" not in r.stderr
    return trace, json.loads(truth.read_text())


def report_json(trace, *args):
    r = run_kvtrace("report", trace, "--format", "json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def value_counts(a):
    v, n = np.unique(np.asarray(a, dtype=np.int64), return_counts=True)
    return [[int(x), int(y)] for x, y in zip(v, n)]


def expected_occupancy(truth):
    """The report's occupancy figures, from kvsim's generations alone."""
    g = truth["generations"]
    bs = truth["block_size"]
    block, start, last = (np.array(g[k], dtype=np.int64) for k in ("block", "start_step",
                                                                    "last_step"))
    fill = np.array(g["fill"], dtype=np.int64)
    # reuse distance: per block, the next generation's start - this one's last
    reuse = []
    for b in np.unique(block):
        mine = np.flatnonzero(block == b)  # kvsim lists them in the order they started
        reuse += (start[mine[1:]] - last[mine[:-1]]).tolist()
    active_b = np.array(truth["active_blocks"], dtype=np.int64)
    active_t = np.array(truth["active_tokens"], dtype=np.int64)
    frag = 1 - active_t[active_b > 0] / (active_b[active_b > 0] * bs)
    return {
        "generations": len(block),
        "started_by": {"write": g["kind"].count("write"), "copy": g["kind"].count("copy"),
                       "swap_in": g["kind"].count("swap_in"), "before": 0},
        "fill_hist": np.bincount(fill, minlength=bs + 1).tolist(),
        "max_writes": max(g["writes"]),
        "lifetime_steps": value_counts(last - start + 1),
        "reuse_steps": value_counts(reuse),
        "steps": truth["steps"],
        "active_blocks": truth["active_blocks"],
        "active_tokens": truth["active_tokens"],
        "unwritten_share_mean": float(frag.mean()),
        "incomplete_ops": 0,
    }


def assert_occupancy_matches(doc, truth):
    want = expected_occupancy(truth)
    layers = [o for o in doc["occupancy"] if o["pid"] == truth["pid"]]
    assert sorted(o["layer"] for o in layers) == list(range(truth["num_layers"]))
    for occ in layers:
        assert occ["block_size"] == truth["block_size"]
        for key, value in want.items():
            if key == "unwritten_share_mean":
                assert occ[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert occ[key] == value, (occ["layer"], key)


@pytest.mark.parametrize("workload,extra", [
    ("default", ()), ("beam", ()), ("swap", ()), ("mla", ()),
    ("swap", ("--block-size", 24))])
def test_round_trip_matches_truth(tmp_path, workload, extra):
    trace, truth = record(tmp_path, workload, *extra)
    assert oct(trace.stat().st_mode & 0o777) == "0o600"
    doc = report_json(trace)
    # per-block numbers from the stream: exactly kvsim's
    assert doc["trace"]["complete"] and doc["stream"]["incomplete_ops"] == 0
    assert_matches_truth(doc["blocks"], truth)
    assert_occupancy_matches(doc, truth)
    # what the file says about where it came from
    t = doc["trace"]
    assert t["host"] == os.uname().nodename and os.uname().release in t["kernel"]
    assert t["target"]["command"][0] == str(KVSIM)
    (proc,) = t["processes"]
    assert proc["pid"] == truth["pid"] and proc["comm"] == "kvsim"
    # as attach --json has them: the root of the tree, its USDT probes (the
    # plugin tier's among them: kvsim fires its lifecycle probes too)
    assert (proc["parent"], proc["tier"]) == (0, "plugin")
    assert set(truth["ops"]) <= set(proc["probed_ops"])
    (agg_proc,) = doc["blocks"]["processes"]
    assert (agg_proc["parent"], agg_proc["tier"]) == (0, "plugin")
    assert agg_proc["probed_ops"] == proc["probed_ops"]
    (lib,) = proc["probe_files"]
    assert lib["path"] == os.path.realpath(KVSIM_LIB)
    readelf = subprocess.run(["readelf", "-n", str(KVSIM_LIB)], capture_output=True, text=True)
    assert lib["build_id"] == re.search(r"Build ID: ([0-9a-f]+)", readelf.stdout)[1]
    layers = doc["blocks"]["processes"][0]["layers"]
    assert {l["block_size"] for l in layers} == {truth["block_size"]}
    assert len(layers) == truth["num_layers"]


def test_record_pid_with_duration_then_attach_o(tmp_path):
    """record -p, and attach -o (live and recording at once) agree with the truth."""
    sim = Kvsim(tmp_path, "beam")
    trace = tmp_path / "p.kvt"
    try:
        rec = subprocess.Popen(kvtrace_cmd("record", "-p", sim.pid, "-o", trace, "-d", 60),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        read_line(rec.stderr, "tracing pid", 60)
        sim.go()
        assert sim.wait() == 0
        out, err = rec.communicate(timeout=60)
        assert rec.returncode == 0, err
        doc = report_json(trace)
        assert doc["trace"]["target"] == {"pid": sim.pid}
        assert_matches_truth(doc["blocks"], sim.truth())
        assert_occupancy_matches(doc, sim.truth())
    finally:
        sim.kill()

    live_trace, agg, truth_path = tmp_path / "a.kvt", tmp_path / "a.json", tmp_path / "t.json"
    r = run_kvtrace("attach", "-o", live_trace, "--json", agg, "--", KVSIM, "--workload",
                    "swap", "--truth", truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "summary (target exited)" in r.stdout
    truth = json.loads(truth_path.read_text())
    assert_matches_truth(json.loads(agg.read_text()), truth)
    doc = report_json(live_trace)
    assert_matches_truth(doc["blocks"], truth)
    assert_occupancy_matches(doc, truth)


FOLDED = re.compile(r"^(.*)\s+(\d+)$")  # flamegraph.pl's own line grammar


def folded(trace, *args):
    r = run_kvtrace("export", "--folded", trace, *args)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines
    out = []
    for line in lines:
        m = FOLDED.match(line)
        assert m, line
        frames = m[1].split(";")
        assert all(f.strip() for f in frames), line
        out.append((frames, int(m[2])))
    return out


def test_stacks_the_stack_map_refuses_are_kept(tmp_path):
    """The kernel's stack map keeps one stack per hash bucket.  With one
    bucket, every stack but the first is refused (-EEXIST) and must come
    from the second map (collided_stacks): the folded stacks are those of a
    recording with the full map, frame for frame, and none is missing."""
    (tmp_path / "full").mkdir()
    (tmp_path / "one").mkdir()
    full, truth = record(tmp_path / "full", "swap")
    one, one_truth = record(tmp_path / "one", "swap", tracer_args=("--stack-storage-size", "1"))
    assert one_truth["ops"] == truth["ops"]  # kvsim is deterministic

    def stacks(trace, t):  # process frame dropped: the pids differ
        rows = folded(trace, "--by", "stack")
        assert all(f[0] == f"kvsim-{t['pid']}" for f, _ in rows)
        return sorted((tuple(f[1:]), w) for f, w in rows)

    kept = stacks(one, one_truth)
    assert kept == stacks(full, truth)
    assert not any(x.startswith("[no stack") for f, _ in kept for x in f)
    # the function that issues each op is in its stack (kvsim.c)
    issuer = {"cpu_attn_reshape_and_cache": "kv_write_slots [libkvsim_ops.so]",
              "swap_blocks": "kv_swap_blocks [libkvsim_ops.so]",
              "swap_blocks_batch": "kv_swap_blocks_batch [libkvsim_ops.so]"}
    assert {f[-2] for f, _ in kept} == set(issuer)
    assert all(f[-3] == issuer[f[-2]] for f, _ in kept)
    # both maps held stacks: the first in the stack map, the rest beside it
    ids = [int(k.split(":")[1]) for k in tracefile.read(str(one)).end["stacks"]]
    assert min(ids) < abi.STACK_COLLIDED <= max(ids)


def test_folded_both_ways_sum_to_the_totals(tmp_path):
    trace, truth = record(tmp_path, "beam")  # writes and copies
    swap_trace, swap_truth = record(tmp_path, "swap")  # writes, swaps, batches

    def by_op(rows, index):
        sums = {}
        for frames, w in rows:
            sums[frames[index]] = sums.get(frames[index], 0) + w
        return sums

    for tr, t in ((trace, truth), (swap_trace, swap_truth)):
        ops = {op: v for op, v in t["ops"].items() if v["calls"]}
        # by stack: comm-PID;frames...;op;layer_NN
        rows = folded(tr, "--by", "stack")
        assert all(f[0] == f"kvsim-{t['pid']}" and re.fullmatch(r"layer_\d\d|all_layers", f[-1])
                   for f, _ in rows)
        assert any("kv_write_slots [libkvsim_ops.so]" in f for fr, _ in rows for f in fr)
        want = {op: v["slots"] if op in WRITE_OPS else v["pairs"] for op, v in ops.items()}
        assert by_op(rows, -2) == want
        # by block: comm-PID;op;layer_NN;blocks_LO-HI;block_N, zero-padded
        rows = folded(tr, "--by", "block")
        for f, _ in rows:
            assert len(f) == 5 and f[0] == f"kvsim-{t['pid']}", f
            assert re.fullmatch(r"layer_\d\d", f[2]), f
            lo, hi = map(int, re.fullmatch(r"blocks_(\d+)-(\d+)", f[3]).groups())
            assert lo <= int(re.fullmatch(r"block_(\d+)", f[4])[1]) <= hi
        assert len({len(f[4]) for f, _ in rows}) == 1  # one width: string order is block order
        want.pop("swap_blocks_batch", None)  # no block numbers in its probe
        assert by_op(rows, 1) == want
        # bytes: copies and swaps only
        want_bytes = {op: v["bytes"] for op, v in ops.items() if op not in WRITE_OPS}
        assert by_op(folded(tr, "--by", "stack", "--weight", "bytes"), -2) == want_bytes
        want_bytes.pop("swap_blocks_batch", None)
        assert by_op(folded(tr, "--by", "block", "--weight", "bytes"), 1) == want_bytes


def test_killed_recorder_leaves_a_readable_prefix(tmp_path):
    trace = tmp_path / "k.kvt"
    rec = subprocess.Popen(kvtrace_cmd("record", "-o", trace, "--", KVSIM, "--workload",
                                       "default", "--repeat", 1000, "--step-delay-us", 1000,
                                       "--quiet"),
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = read_line(rec.stderr, "tracing pid", 60)
    target = int(re.search(r"tracing pid (\d+)", seen[-1])[1])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and trace.stat().st_size < 200_000:
            time.sleep(0.2)  # some batches are in
        rec.send_signal(signal.SIGKILL)
        rec.wait()
    finally:
        os.kill(target, signal.SIGKILL)  # the command we had it start
    r = run_kvtrace("report", trace, "--format", "json")
    assert r.returncode == 4 and "no end record" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    r = run_kvtrace("report", trace, "--format", "json", "--partial")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert not doc["trace"]["complete"] and doc["blocks"]["exact"] is False
    assert doc["stream"]["ops"] > 0 and doc["stream"]["incomplete_ops"] == 0
    # what made it is consistent: the layers are at most the step in flight apart
    calls = [l["calls"] for l in doc["blocks"]["processes"][0]["layers"]]
    assert len(calls) == kvsim_truth(tmp_path, "default")["num_layers"]
    assert max(calls) - min(calls) <= 1


def test_a_launched_command_is_named_by_what_it_runs(tmp_path):
    """`record -- CMD` tracks the command from fork, before its exec: it was
    named by the tracer's own command (kvtrace-bpf, or python3.11 under
    `python -m`) in one run and by its own in another.  A shell that stays
    the parent of kvsim (the `; true`) is never attached to, as vLLM's API
    server is not."""
    trace = tmp_path / "sh.kvt"
    r = run_kvtrace("record", "-o", trace, "--", "bash", "-c",
                    f"{KVSIM} --workload default --quiet; true")
    # (kvsim may end before a scan finds it: only the root is asserted)
    assert r.returncode == 0, r.stderr
    doc = report_json(trace)
    root = doc["trace"]["target"]["pid"]
    names = {p["pid"]: p["comm"] for p in doc["trace"]["processes"]}
    assert names[root] == "bash", names


def _broken(doc, name):
    """doc with one figure made to contradict its neighbours: what the
    invariant `name` must catch (and no other)."""
    d = copy.deepcopy(doc)
    proc = d["blocks"]["processes"][0]
    life, acc = d["lifecycle"], d["access"][0]
    if name == "panel_headers_agree":  # reads "of" the highest block read + 1
        proc["groups"][0]["num_blocks"] = max(b for b, _ in proc["groups"][0]["reads_per_block"]) + 1
    elif name == "hottest_coldest_disjoint":
        acc["coldest"][0] = acc["hottest"][0]
    elif name == "working_set_within_cache":
        acc["wss_blocks"][-1][1] = acc["blocks_read"] + 1
    elif name == "shares_within_0_1":
        d["occupancy"][0]["unwritten_share_mean"] = 1.2
    elif name == "layers_whole":
        acc["layers"] = 1.99953
    elif name == "process_names":
        proc["comm"] = invariants.TRACER_COMM
    elif name == "lifecycle_per_process":
        proc["lifecycle"] = None
    elif name == "request_sums":
        life["requests"][0]["events"] = [e for e in life["requests"][0]["events"]
                                         if e[1] != "alloc"]
    elif name == "residency_counts":
        life["summary"]["reallocated"] += 1
    elif name == "derived_equals_counted":  # one row derived otherwise than counted
        v = d["derived_reads"][0]["verified"]
        v["rows_differ"], v["first"] = 1, "step 3 row 0: a block off"
    return d


def test_report_check_holds_and_can_fail(tmp_path, monkeypatch, capsys):
    """report --check: every invariant holds on a real recording, one line
    each; each one fails on a document broken where it looks, and the
    command exits 4 when the analysis itself is broken."""
    trace, truth = record(tmp_path, "prefix", "--repeat", "3")
    r = run_kvtrace("report", trace, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    names = [re.match(r"ok   (\w+): ", line).group(1) for line in lines]
    # kvsim passes no content hashes here: no miss-ratio curve nor miss
    # causes to check (tests/test_e2e_misses.py checks those)
    want = [c.__name__ for c in invariants.CHECKS
            if c.__name__ not in ("miss_ratio_curve", "miss_causes")]
    assert names == want
    doc = report_json(trace)
    # the re-allocations on screen beside "evicted": kvsim's own count of
    # vLLM's idle_before_evict samples
    s = doc["lifecycle"]["summary"]
    assert s["blocks"] == truth["lifecycle"]["totals"]
    assert s["reallocated"] == len(truth["lifecycle"]["residency"]["idle_before_evict_ns"]) > 0
    # the process's own lifecycle (it was null) and its reads "of" kvsim's
    # blocks (they were "of" the highest block read + 1)
    (proc,) = doc["blocks"]["processes"]
    assert proc["lifecycle"]["totals"] == truth["lifecycle"]["totals"]
    assert proc["groups"][0]["num_blocks"] == truth["num_blocks"] == \
        proc["layers"][0]["num_blocks"]
    assert invariants.failures(doc) == []
    for name in want:
        assert [n for n, _ in invariants.failures(_broken(doc, name))] == [name], name
    # the aggregate broken as it once was: the coldest blocks taken from all
    # those read, the hottest among them
    monkeypatch.setattr(access_counters, "least_read_blocks", access_counters.most_read_blocks)
    assert cli.main(["report", str(trace), "--check"]) == 4
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if not line.startswith("ok ")] == \
        ["FAIL hottest_coldest_disjoint"]
    assert len(out) == len(want)
