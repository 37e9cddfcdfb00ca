"""The tracer against kvsim's own ground truth: real BPF, real processes."""

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from conftest import (KVSIM, Kvsim, Tracer, WRITE_OPS, assert_log_covers, assert_matches_truth,
                      assert_reads_match_truth, code_differences, dense, kvsim_ops_log,
                      kvsim_truth, read_line, run_kvtrace, semaphore_values, truth_records)
from tracer import abi
from tracer.trace import tracefile

WORKLOADS = ("default", "beam", "swap", "stress", "mla", "prefix", "window")
pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.mark.parametrize("workload,extra,perf_uprobes", [(w, (), "0") for w in WORKLOADS] + [
    # a block size that is not a power of two takes the dividing stage
    ("beam", ("--block-size", 48), "0"), ("swap", ("--block-size", 24), "0"),
    # perf events, the stop at the entry point included: the programs are
    # loaded for them (a link's program is refused on a perf event here)
    ("default", (), "1")])
def test_attach_command_matches_truth(tmp_path, workload, extra, perf_uprobes):
    out = tmp_path / "agg.json"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", workload,
                    *extra, "--truth", truth_path, "--quiet",
                    env=dict(os.environ, KVTRACE_PERF_UPROBES=perf_uprobes))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "target exited"
    assert doc["target_exit_status"] == 0  # kvsim verified its KV bytes too
    truth = json.loads(truth_path.read_text())
    assert_matches_truth(doc, truth)
    assert_reads_match_truth(doc, truth)
    assert "summary (target exited)" in r.stdout


def _run_to_end_matches_truth(tmp_path, sim, tracer) -> dict:
    """Start the paused kvsim under an attached tracer writing
    tmp_path/agg.json, let both end, and check the counts against kvsim's
    own: the aggregate."""
    sim.go()
    assert sim.wait() == 0
    rc, _, err = tracer.finish()
    assert rc == 0, err
    doc = json.loads((tmp_path / "agg.json").read_text())
    assert_matches_truth(doc, sim.truth())
    assert_reads_match_truth(doc, sim.truth())
    return doc


@pytest.mark.parametrize("workload", WORKLOADS)
def test_attach_pid_matches_truth(tmp_path, workload):
    sim = Kvsim(tmp_path, workload)
    try:
        tracer = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "agg.json")
        tracer.wait_attached()
        doc = _run_to_end_matches_truth(tmp_path, sim, tracer)
        # every count above came from the maps: the only per-op records are
        # the plugin tier's events' (the derived reads' stream), one each,
        # and none of the writes', moves' or tables'
        life = sim.truth()["lifecycle"]["calls"]
        assert doc["records"] + doc["lost_records"] == sum(life.values()) > 0
    finally:
        sim.kill()


def _fds(pid):
    """(target, fdinfo fields) of each file a process holds open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue  # closed meanwhile
        yield target, dict(line.split(":\t", 1) for line in info.splitlines() if ":\t" in line)


def _attachments(pid):
    """The uprobe_multi links (fdinfo fields) and the perf events a process holds."""
    links, perf_events = [], 0
    for target, info in _fds(pid):
        if target == "anon_inode:[perf_event]":
            perf_events += 1
        elif info.get("link_type", "").strip() == "uprobe_multi":
            links.append(info)
    return links, perf_events


@pytest.mark.parametrize("perf_uprobes", (False, True), ids=("links", "perf-events"))
def test_attach_by_links_or_perf_events_exact(tmp_path, perf_uprobes):
    """Where the kernel has uprobe_multi links (6.6+, as here), one link per
    traced file and process carries all its probes, and no perf event is
    open; KVTRACE_PERF_UPROBES=1 attaches as on older kernels, one perf event
    per probe.  Both count exactly, and turn the semaphores on and off."""
    sim = Kvsim(tmp_path, "prefix")
    env = dict(os.environ, KVTRACE_PERF_UPROBES="1" if perf_uprobes else "0")
    try:
        tracer = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "agg.json", env=env)
        tracer.wait_attached()
        probes = int(re.search(r"(\d+) probes in 1 processes", tracer.early_err).group(1))
        assert probes == len(semaphore_values(sim.pid)) > 10
        assert set(semaphore_values(sim.pid).values()) == {1}
        links, perf_events = _attachments(tracer.proc.pid)
        # and the perf buffer of the plugin tier's events: one output event
        # per online CPU (tracer/kernel/program.py)
        from tracer.kernel.program import _online_cpus
        perf_events -= len(_online_cpus())
        if perf_uprobes:
            assert (len(links), perf_events) == (0, probes)
        else:
            assert (len(links), perf_events) == (1, 0)
            assert links[0]["pid"].strip() == str(sim.pid)
            assert int(links[0]["uprobe_cnt"]) == probes
        _run_to_end_matches_truth(tmp_path, sim, tracer)
    finally:
        sim.kill()


def _programs(pid):
    """{prog_id: fdinfo fields} of the BPF programs a process holds."""
    return {info["prog_id"].strip(): info for target, info in _fds(pid)
            if target == "anon_inode:bpf-prog"}


def test_empty_program_probes_the_same_sites_and_counts_nothing(tmp_path):
    """KVTRACE_EMPTY_PROGRAM=1, bench row 3's floor: the same probes in the
    same link with every semaphore on, the link running a 2-instruction
    program in place of kvtrace's, so kvsim fires its ops (its own
    --ops-log logs only ops whose probe was on) and nothing is counted."""
    log = tmp_path / "ops.log"
    sim = Kvsim(tmp_path, "default", "--ops-log", log)
    env = dict(os.environ, KVTRACE_EMPTY_PROGRAM="1")
    try:
        tracer = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "agg.json", env=env)
        tracer.wait_attached()
        assert "KVTRACE_EMPTY_PROGRAM is set" in tracer.early_err, tracer.early_err
        probes = int(re.search(r"(\d+) probes in 1 processes", tracer.early_err).group(1))
        assert probes == len(semaphore_values(sim.pid)) > 10
        assert set(semaphore_values(sim.pid).values()) == {1}
        [link], _ = _attachments(tracer.proc.pid)
        assert int(link["uprobe_cnt"]) == probes
        prog = _programs(tracer.proc.pid)[link["prog_id"].strip()]
        assert int(prog["verified_insns"]) == 2, prog  # r0 = 0; exit
        sim.go()
        assert sim.wait() == 0
        rc, _, err = tracer.finish()
        assert rc == 0, err
    finally:
        sim.kill()
    fired = kvsim_ops_log(log)
    assert len(fired) > 100 and {"reshape_and_cache", "block_table"} <= {f[0] for f in fired}
    doc = json.loads((tmp_path / "agg.json").read_text())
    assert doc["ops"] == {} and all(p["ops"] == {} for p in doc["processes"]), doc["ops"]
    assert doc["exact"] is False and "KVTRACE_EMPTY_PROGRAM" in doc["inexact_reasons"][0]


def test_stress_exact_even_with_a_tiny_perf_buffer(tmp_path):
    """Exact counters never depend on the perf buffer; what it drops is counted.
    The per-op records go with a stream (-o), which floods a one-page buffer."""
    out = tmp_path / "agg.json"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--perf-pages", 1, "--json", out,
                    "-o", tmp_path / "stress.kvt", "--", KVSIM,
                    "--workload", "stress", "--repeat", 3, "--truth", truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    truth = json.loads(truth_path.read_text())
    assert_matches_truth(doc, truth)
    # 8192-token prefill ops are read whole (several tail-called segments)
    assert doc["ops"]["reshape_and_cache_flash"]["truncated"] == 0
    assert any(lo <= 8192 <= hi for lo, hi, _ in doc["items_log2"]["reshape_and_cache_flash"])
    # every op produced exactly one record, delivered or counted as lost
    calls = truth_records(truth)
    assert doc["records"] + doc["lost_records"] == calls
    print(f"stress x3: {calls} ops, {doc['records']} records, {doc['lost_records']} lost")


# One slot-writing op reads at most 33 tail-called runs of 2048 slots
# (docs/design.md, "Reading 8192+ slots per op"): the documented limit
SLOT_OP_LIMIT = 33 * 2048


def test_ops_longer_than_the_read_limit_are_truncated_exactly(tmp_path):
    """kvsim's `long` workload writes steps of ~125k slots in one op.  What
    the tracer reads of each op (its first 67584 entries) is counted exactly,
    the rest is `truncated`, and the run says it is NOT exact.  The expected
    counts come from kvsim's own log of each op's values."""
    out, log = tmp_path / "agg.json", tmp_path / "ops.log"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", "long",
                    "--truth", truth_path, "--ops-log", log, "--quiet")
    assert r.returncode == 0, r.stderr
    doc, truth = json.loads(out.read_text()), json.loads(truth_path.read_text())
    writes = [(cache_id, values) for name, cache_id, values, _ in kvsim_ops_log(log)
              if name == "reshape_and_cache_flash"]
    assert writes and max(len(v) for _, v in writes) > SLOT_OP_LIMIT  # the test's premise
    want_truncated = sum(max(0, len(v) - SLOT_OP_LIMIT) for _, v in writes)
    op = doc["ops"]["reshape_and_cache_flash"]
    assert op["truncated"] == want_truncated
    assert op["calls"] == len(writes)
    assert doc["exact"] is False
    assert any("per-op read limit" in why for why in doc["inexact_reasons"])
    # every slot the tracer read is counted, in its block
    want = {}
    for cache_id, values in writes:
        read = values[:SLOT_OP_LIMIT]
        blocks, counts = np.unique(read[read >= 0] // truth["block_size"], return_counts=True)
        per_block = want.setdefault(cache_id, {})
        for b, c in zip(blocks.tolist(), counts.tolist()):
            per_block[b] = per_block.get(b, 0) + c
    got = {layer["cache_id"]: dict(map(tuple, layer["writes"]))
           for layer in doc["processes"][0]["layers"]}
    assert got == want
    assert op["slots"] == sum(sum(v.values()) for v in want.values())
    # the log holds every slot kvsim wrote (its truth's total)
    assert sum(int((v >= 0).sum()) for _, v in writes) == truth["slots_written"]


@pytest.mark.parametrize("perf_uprobes", ["0", "1"])
def test_many_layers_through_one_site_are_each_exact(tmp_path, perf_uprobes):
    """One write site serves every layer, and the program keeps each site's
    caches in a memo of 64 slots (bpf/kvtrace.h): with kvsim's most layers,
    64, some share a slot and push each other out (that none does has odds
    of 64!/64^64, about 1e-26).  Every layer's row is still kvsim's own, by
    links (the site found by its cookie) and by perf events (by its
    address)."""
    layers = 64
    shape = kvsim_truth(tmp_path, "default", "--layers", layers)
    assert shape["num_layers"] == layers
    max_blocks = 1 << (shape["num_blocks"] - 1).bit_length()
    out, truth_path = tmp_path / "agg.json", tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--max-layers", layers,
                    "--max-blocks", max_blocks, "--", KVSIM, "--workload", "default",
                    "--layers", layers, "--truth", truth_path, "--quiet",
                    env=dict(os.environ, KVTRACE_PERF_UPROBES=perf_uprobes))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert len(doc["processes"][0]["layers"]) == layers
    assert_matches_truth(doc, json.loads(truth_path.read_text()))


def test_limits_are_reported_not_hidden(tmp_path):
    """Blocks and layers beyond --max-blocks / --max-layers: what is kept is
    exact, the rest is counted as out of range and the run says NOT exact.
    The limits are half the workload's blocks and one layer fewer than it
    has, both read from kvsim's truth of an untraced run."""
    shape = kvsim_truth(tmp_path, "default")
    max_blocks, max_layers = shape["num_blocks"] // 2, shape["num_layers"] - 1
    assert max_blocks & (max_blocks - 1) == 0 and max_layers >= 1  # as attach needs
    out = tmp_path / "agg.json"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "--max-blocks", max_blocks, "--max-layers", max_layers,
                    "--json", out, "--", KVSIM, "--workload", "default", "--truth",
                    truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    truth = json.loads(truth_path.read_text())
    assert (truth["num_blocks"], truth["num_layers"]) == (shape["num_blocks"],
                                                          shape["num_layers"])
    assert doc["exact"] is False
    assert any("--max-blocks" in why for why in doc["inexact_reasons"])
    assert any("--max-layers" in why for why in doc["inexact_reasons"])
    assert "NOT exact" in r.stdout
    layers = {l["cache_id"]: l for l in doc["processes"][0]["layers"]}
    beyond = 0
    for want in truth["layers"]:
        got = layers[want["cache_id"]]
        if want["layer"] < max_layers:  # kept: exact below the block limit
            assert [c for b, c in got["writes"]] == [c for c in want["writes"][:max_blocks] if c]
            assert got["out_of_range"] == sum(want["writes"][max_blocks:])
        else:  # no row left for the last layer: all of it out of range
            assert got["writes"] == [] and got["out_of_range"] == sum(want["writes"])
        beyond += got["out_of_range"]
    assert doc["ops"]["reshape_and_cache"]["out_of_range"] == beyond
    assert doc["ops"]["reshape_and_cache"]["slots"] == truth["slots_written"]
    # reads likewise: the group's row holds the blocks below the limit,
    # exact, and the table entries beyond are counted out of range
    (group,) = doc["processes"][0]["groups"]
    want = dense(truth["reads"]["per_block"], truth["num_blocks"])
    assert sum(want[max_blocks:]) > 0  # the limit cuts into what kvsim read
    assert dense(group["reads_per_block"], max_blocks) == want[:max_blocks]
    assert group["reads"] == sum(want[:max_blocks])
    assert group["out_of_range"] == sum(want[max_blocks:])
    assert group["null_entries"] == truth["reads"]["null_entries"]


def test_folded_stacks_parse_and_sum_to_totals(tmp_path):
    folded = tmp_path / "kv.folded"
    truth_path = tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--folded", folded, "--", KVSIM, "--workload", "swap",
                    "--truth", truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    truth = json.loads(truth_path.read_text())
    assert oct(folded.stat().st_mode & 0o777) == "0o600"
    weights = {}
    lines = folded.read_text().splitlines()
    assert lines
    for line in lines:
        m = re.match(r"^(.*)\s+(\d+)$", line)  # flamegraph.pl's own line grammar
        assert m, line
        frames = m.group(1).split(";")
        assert all(f.strip() for f in frames), line
        assert frames[0] == f"kvsim-{truth['pid']}"  # the process frame: comm-PID
        op, layer = frames[-2], frames[-1]
        assert re.fullmatch(r"layer_\d\d|all_layers", layer), line
        weights[op] = weights.get(op, 0) + int(m.group(2))
    for op, want in truth["ops"].items():
        expected = want["slots"] if op in WRITE_OPS else want["pairs"]
        assert weights.get(op, 0) == expected, op
    # stacks are symbolized while the target lives: the ops library's functions
    text = folded.read_text()
    assert "kv_write_slots [libkvsim_ops.so]" in text
    assert "kv_swap_blocks [libkvsim_ops.so]" in text


def _attached_running_kvsim(tmp_path, *tracer_args):
    """A kvsim that runs until it is told to stop (a --repeat it would take
    hours to reach, then SIGUSR2), with a tracer attached to it and one
    whole repetition of the workload done under it: events, not a guess at
    how fast this machine runs it."""
    sim = Kvsim(tmp_path, "default", "--repeat", 1000000, "--step-delay-us", 300, "--progress")
    tracer = Tracer("-q", "-p", sim.pid, *tracer_args)
    tracer.wait_attached()
    assert semaphore_values(sim.pid)["reshape_and_cache"] == 1  # the kernel turned it on
    sim.go()
    read_line(sim.proc.stderr, "repetition 1 done", 60)
    return sim, tracer


def test_sigkill_of_the_tracer_leaves_no_semaphore_on(tmp_path):
    sim, tracer = _attached_running_kvsim(tmp_path)
    try:
        tracer.proc.kill()
        tracer.proc.wait()
        deadline = time.monotonic() + 10  # the fds close as the process is torn down
        while any(semaphore_values(sim.pid).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert semaphore_values(sim.pid) == dict.fromkeys(semaphore_values(sim.pid), 0)
        assert code_differences(sim.pid) == []  # every int3 taken out again
        assert sim.proc.poll() is None  # the target runs on (until told to stop)...
        assert sim.stop() == 0  # ...and finishes with its KV bytes intact
    finally:
        tracer.kill()
        sim.kill()


@pytest.mark.parametrize("sig", (signal.SIGINT, signal.SIGTERM))
def test_signal_detaches_and_prints_summary(tmp_path, sig):
    out = tmp_path / "agg.json"
    sim, tracer = _attached_running_kvsim(tmp_path, "--json", out)
    try:
        tracer.proc.send_signal(sig)
        rc, stdout, err = tracer.finish()
        assert rc == 0, err
        assert f"summary ({sig.name})" in stdout
        assert "Traceback" not in err
        assert not any(semaphore_values(sim.pid).values())
        assert code_differences(sim.pid) == []
        doc = json.loads(out.read_text())
        assert doc["stop_reason"] == sig.name
        # at least the repetition it saw whole: kvsim's truth counts it
        one = kvsim_truth(tmp_path, "default")["ops"]["reshape_and_cache"]["calls"]
        assert doc["ops"]["reshape_and_cache"]["calls"] >= one
        assert sim.proc.poll() is None
        assert sim.stop() == 0
    finally:
        tracer.kill()
        sim.kill()


def test_target_killed_mid_trace(tmp_path):
    out, trace = tmp_path / "agg.json", tmp_path / "run.kvt"
    sim, tracer = _attached_running_kvsim(tmp_path, "--json", out, "-o", trace)
    sim.kill()
    rc, stdout, err = tracer.finish()
    assert rc == 0, err
    assert "summary (target exited)" in stdout
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "target exited"
    assert doc["exact"] is True
    assert doc["ops"]["reshape_and_cache"]["calls"] > 0
    # the recording is complete and readable, and agrees with the live counts
    r = run_kvtrace("report", trace, "--format", "json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["trace"]["complete"] is True
    assert report["stream"]["incomplete_ops"] == 0
    assert report["blocks"]["ops"]["reshape_and_cache"]["calls"] == \
        doc["ops"]["reshape_and_cache"]["calls"]
    # layers fire in order within a step, so a kill mid-step leaves the
    # first layers one call ahead, never more
    calls = [l["calls"] for l in doc["processes"][0]["layers"]]
    assert len(calls) == kvsim_truth(tmp_path, "default")["num_layers"]
    assert max(calls) - min(calls) <= 1 and calls == sorted(calls, reverse=True)


def test_only_the_traced_process_counts(tmp_path):
    """Two kvsims from one binary; the untraced one contributes nothing."""
    traced = Kvsim(tmp_path, "default")
    other = Kvsim(tmp_path, "beam")
    try:
        tracer = Tracer("-q", "-p", traced.pid, "--json", tmp_path / "agg.json")
        tracer.wait_attached()
        # the kernel turned on the traced process's semaphores only
        assert set(semaphore_values(traced.pid).values()) == {1}
        assert set(semaphore_values(other.pid).values()) == {0}
        other.go()
        traced.go()
        assert other.wait() == 0 and traced.wait() == 0
        rc, _, err = tracer.finish()
        assert rc == 0, err
        doc = json.loads((tmp_path / "agg.json").read_text())
        assert_matches_truth(doc, traced.truth())
        assert doc["dropped"]["foreign_process_hits"] == 0
    finally:
        traced.kill()
        other.kill()


def assert_recorded_what_was_fired(doc, trace, log):
    """Every op the tracer recorded is one kvsim fired while its probe was
    enabled (its own --ops-log), in firing order per op, with the same values, and
    the counters agree with the recording: whatever this machine's speed, and
    whenever --duration fell (no "it must have seen some calls by now").
    The log may hold more at either end: ops fired while a probe's semaphore
    was already (or still) on but its program was not yet (or no longer)
    attached, since each uprobe's open and close take time."""
    t = tracefile.read(str(trace))
    assert t.complete and t.ops.ops["complete"].all()
    o = t.ops.ops
    order = np.argsort(o["seq"], kind="stable")
    got = [(abi.OP_NAMES[int(o["op"][i])], tuple(t.ops.values_of(i).tolist())) for i in order]
    (group,) = t.groups  # the layer whose calls the tracer read
    logged = kvsim_ops_log(log, leader=group["leader"])
    assert_log_covers(o["op"], logged)
    fired = [(name, tuple(v.tolist())) for name, _, v, _ in logged]
    assert len(got) <= len(fired)
    # per probe: its probes attach and detach one after the other, so at
    # either end one op's calls may be seen while another's are not yet (or
    # no longer); each op's own calls are one unbroken run of what kvsim fired
    for op in {name for name, _ in got}:
        mine = [v for name, v in got if name == op]
        theirs = [v for name, v in fired if name == op]
        # a --repeat replays the same ops: any place where all of them fit
        starts = [k for k in range(len(theirs) - len(mine) + 1) if theirs[k] == mine[0]]
        assert any(theirs[k:k + len(mine)] == mine for k in starts), \
            f"{op}: not what kvsim fired"
    for op, st in doc["ops"].items():
        assert st["calls"] == sum(1 for name, _ in got if name == op), op


def test_duration_ends_a_command_we_started(tmp_path):
    """`-- CMD` outliving --duration is stopped and reaped, not left behind."""
    out, log, trace = tmp_path / "agg.json", tmp_path / "ops.log", tmp_path / "run.kvt"
    r = run_kvtrace("attach", "-q", "-d", 1, "--json", out, "-o", trace, "--", KVSIM, "--workload",
                    "default", "--repeat", 1000000, "--step-delay-us", 1000, "--quiet",
                    "--ops-log", log)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "duration"
    assert doc["target_exit_status"] == -signal.SIGTERM
    assert_recorded_what_was_fired(doc, trace, log)
    pid = doc["processes"][0]["pid"]
    assert not os.path.exists(f"/proc/{pid}")  # reaped: not even a zombie


def test_ending_a_command_ends_its_whole_process_group(tmp_path):
    """A command's own children (vLLM's engine and workers) go with it, even
    one that ignores SIGTERM: the tracer ends the group, SIGKILL last.  The
    child's pid comes from the command itself, not from the tracer."""
    out, log, pidfile = tmp_path / "agg.json", tmp_path / "ops.log", tmp_path / "child.pid"
    trace = tmp_path / "run.kvt"
    script = (f"trap '' TERM; {KVSIM} --workload default --repeat 1000000 "
              f"--step-delay-us 1000 --quiet --ops-log {log} & echo $! > {pidfile}; wait")
    r = run_kvtrace("attach", "-q", "-d", 2, "--json", out, "-o", trace, "--", "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["stop_reason"] == "duration"
    assert doc["target_exit_status"] == -signal.SIGKILL  # TERM was ignored
    assert_recorded_what_was_fired(doc, trace, log)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5  # the orphan's exit is reaped by init
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the command's child outlived it"


def _allowed_cpus(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f
                    if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cpu_pins_the_tracer_and_not_the_command(tmp_path):
    """--cpu: the tracer runs on the CPUs asked for, and a command it starts
    keeps every CPU."""
    every = _allowed_cpus(os.getpid())
    first = min(os.sched_getaffinity(0))
    seen = tmp_path / "cpus"
    script = f"grep Cpus_allowed_list /proc/self/status > {seen}; sleep 2"
    tracer = Tracer("-q", "--cpu", first, "--", "sh", "-c", script)
    tracer.wait_attached()
    assert _allowed_cpus(tracer.proc.pid) == str(first)
    rc, _, err = tracer.finish()
    assert rc == 0, err
    assert seen.read_text().split(":")[1].strip() == every != str(first)


@pytest.mark.parametrize("value", ["x", "3-1", "-1", "4096"])
def test_cpu_refuses_what_is_not_a_usable_cpu_list(value):
    r = run_kvtrace("attach", "--cpu", value, "-p", "1")
    assert r.returncode == 1 and "--cpu" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
