"""Safety of the target under tracing (docs/safety.md): attach and detach
again and again, two tracers at once, a target that leaves during attach.

Every check reads the target from outside: kvsim's own ground truth and its
own check of the KV bytes it wrote, its semaphores and its code read through
/proc/PID/mem and compared with the library file on disk."""

import json
import os
import signal
import time

import numpy as np
import pytest

from conftest import (WRITE_OPS, Kvsim, Tracer, assert_matches_truth, code_differences,
                      read_line, readelf_probes, semaphore_values, uprobe_events)

pytestmark = pytest.mark.usefixtures("no_leftovers")

CYCLES = 100
FIELDS = ("calls", "slots", "padding", "bytes")


def truth_counts(truth):
    """kvsim's cumulative ground truth as flat name -> array/int."""
    if truth is None:
        return {}
    out = {f"layer {l['cache_id']}": np.array(l["writes"], np.uint64) for l in truth["layers"]}
    for kind in ("copy_src", "copy_dst", "swap_out", "swap_in"):
        out[kind] = np.array(truth[kind], np.uint64)
    for op, o in truth["ops"].items():
        for f in FIELDS:
            out[f"{op} {f}"] = o[f]
        if op not in WRITE_OPS:
            out[f"{op} items"] = o["pairs"]
    # reads: the block table is read once per step (kvtrace_probes.h), its
    # op totals are per step: live sets as slots, null entries as padding,
    # seq_lens summed as bytes, (request, block) reads as items
    rd = truth["reads"]
    out.update({"block_table calls": rd["steps"], "block_table slots": rd["distinct"],
                "block_table padding": rd["null_entries"], "block_table bytes": rd["tokens"],
                "block_table items": rd["reads"]})
    # the plugin tier's lifecycle probes (bpf/kvtrace.h, struct kvtrace_event):
    # per block and kind; a block event's items and slots are its ids (none
    # null), its bytes the pool's blocks; a request op's items its tokens
    life = truth["lifecycle"]
    n = truth["num_blocks"]
    for kind, pairs in life["blocks"].items():
        out[f"life {kind}"] = np.zeros(n, np.uint64)
        for b, c in pairs:
            out[f"life {kind}"][b] = c
        op = f"block_{kind}"
        out.update({f"{op} calls": life["calls"][op], f"{op} items": life["totals"][kind],
                    f"{op} slots": life["totals"][kind], f"{op} padding": 0,
                    f"{op} bytes": life["calls"][op] * life["num_blocks"]})
    for op, field in (("request", "prompt_tokens"), ("req_preempt", "recomputed"),
                      ("req_finish", "output_tokens")):
        out.update({f"{op} calls": life["calls"][op], f"{op} slots": 0, f"{op} padding": 0,
                    f"{op} bytes": 0,
                    f"{op} items": sum(r[field] for r in life["requests"])})
    # step_reqs: one call a step, its items the step's rows
    out.update({"step_reqs calls": life["calls"]["step_reqs"], "step_reqs slots": 0,
                "step_reqs padding": 0, "step_reqs bytes": 0,
                "step_reqs items": rd["requests"]})
    # step_rows: one call a step (one-sample workloads), its items the
    # step's rows, its slots the tail entries it sent
    out.update({"step_rows calls": life["calls"]["step_rows"], "step_rows padding": 0,
                "step_rows slots": life["step_rows_tail"], "step_rows bytes": 0,
                "step_rows items": life["step_rows_rows"]})
    return out


def traced_counts(bpf, pid, n):
    """What the tracer's maps hold for pid so far, by the truth's names."""
    from tracer import abi

    raw = bpf.read_maps()
    out = {}
    for c in raw["caches"]:
        if c["pid"] == pid:
            assert not c["writes"][n:].any(), "writes beyond the pool"
            out[f"layer {c['cache_id']}"] = c["writes"][:n].astype(np.uint64)
    if pid in raw["moves"]:
        for kind, row in abi.MOVES.items():
            out[kind] = raw["moves"][pid][row][:n].astype(np.uint64)
    if pid in raw["life"]:
        for i, kind in enumerate(abi.LIFE):
            out[f"life {kind}"] = raw["life"][pid][i][:n].astype(np.uint64)
    for (p, op), st in raw["op_stats"].items():
        if p == pid:
            for f in FIELDS + (() if op in WRITE_OPS else ("items",)):
                out[f"{op} {f}"] = st[f]
    return out


def delta(after, before):
    return {k: after[k] - before.get(k, 0 * after[k]) for k in after}


def assert_same(got, want, what):
    keys = set(got) | set(want)
    for k in sorted(keys):
        g, w = got.get(k, 0), want.get(k, 0)
        assert np.array_equal(np.asarray(g), np.asarray(w)) or (
            not np.any(g) and not np.any(w)), f"{what}: {k}"


def run_round(sim, last):
    """One kvsim round (SIGUSR1); its truth file is rewritten before the
    next pause is announced."""
    sim.go()
    if last:
        assert sim.wait() == 0, "kvsim found its KV bytes changed"
    else:
        read_line(sim.proc.stderr, "paused", 60)
    return sim.truth()


def test_100_attach_detach_cycles_leave_kvsim_intact(tmp_path):
    """Attach, run a round, detach, run a round untraced; 100 times.  Each
    traced window counts exactly what kvsim did in it, each untraced one
    nothing; the kernel leaves no semaphore on and no int3 behind; kvsim's
    KV bytes (checked by kvsim as every sequence finishes) stay intact."""
    from tracer.probes import discover
    from tracer.kernel.session import Tracer as BpfTracer

    # swap: writes, swap-out, swap-in and the offload batch in every round
    sim = Kvsim(tmp_path, "swap", "--rounds", 2 * CYCLES)
    bpf = None
    try:
        bpf = BpfTracer()
        files = discover.process_probe_files(sim.pid)
        nprobes = sum(len(p) for p in files.values())
        assert nprobes == len(readelf_probes())
        pristine_semaphores = semaphore_values(sim.pid)
        assert set(pristine_semaphores.values()) == {0}
        truth = None
        n = 1 << 20
        for cycle in range(CYCLES):
            assert bpf.attach(sim.pid, files) == nprobes, f"cycle {cycle}"
            assert set(semaphore_values(sim.pid).values()) == {1}, f"cycle {cycle}"
            assert code_differences(sim.pid), "attached, yet no uprobe in the code"
            # through the perf_event uprobe PMU: nothing registered in tracefs
            assert "kvsim" not in uprobe_events()
            before = traced_counts(bpf, sim.pid, n)
            new_truth = run_round(sim, last=False)
            n = new_truth["num_blocks"]
            before = {k: v[:n] if isinstance(v, np.ndarray) else v for k, v in before.items()}
            got = delta(traced_counts(bpf, sim.pid, n), before)
            want = delta(truth_counts(new_truth), truth_counts(truth))
            assert want["swap_blocks calls"] > 0 and want["swap_blocks_batch calls"] > 0
            assert_same(got, want, f"traced window {cycle}")
            bpf.detach()
            assert semaphore_values(sim.pid) == pristine_semaphores, f"cycle {cycle}"
            assert code_differences(sim.pid) == [], f"cycle {cycle}: code not restored"
            truth = new_truth

            # detached: kvsim works, the tracer counts nothing
            before = traced_counts(bpf, sim.pid, n)
            new_truth = run_round(sim, last=cycle == CYCLES - 1)
            assert_same(traced_counts(bpf, sim.pid, n), before, f"untraced window {cycle}")
            assert new_truth["ops"]["cpu_attn_reshape_and_cache"]["calls"] > \
                truth["ops"]["cpu_attn_reshape_and_cache"]["calls"]
            truth = new_truth
        assert truth["rounds_done"] == 2 * CYCLES
        assert truth["kv_checksum_ok"] is True
        assert bpf.read_globals()["foreign"] == 0
    finally:
        if bpf is not None:
            bpf.close()
        sim.kill()


def test_two_tracers_at_once_both_exact(tmp_path):
    """Both count exactly; the semaphores and the int3s stay while either is
    attached and go when the second leaves."""
    sim = Kvsim(tmp_path, "beam", "--rounds", 3)
    a = b = None
    try:
        a = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "a.json")
        b = Tracer("-q", "-p", sim.pid, "--json", tmp_path / "b.json")
        a.wait_attached()
        b.wait_attached()
        assert set(semaphore_values(sim.pid).values()) == {1}  # one count, two consumers
        truth_a = run_round(sim, last=False)  # both attached

        a.proc.send_signal(signal.SIGINT)
        rc, _, err = a.finish()
        assert rc == 0, err
        # b is still attached: the kernel keeps its uprobes and semaphores
        assert set(semaphore_values(sim.pid).values()) == {1}
        assert code_differences(sim.pid)
        truth_b = run_round(sim, last=False)  # b alone

        b.proc.send_signal(signal.SIGTERM)
        rc, _, err = b.finish()
        assert rc == 0, err
        assert set(semaphore_values(sim.pid).values()) == {0}
        assert code_differences(sim.pid) == []
        run_round(sim, last=True)  # untraced; kvsim checks its KV bytes

        assert_matches_truth(json.loads((tmp_path / "a.json").read_text()), truth_a)
        assert_matches_truth(json.loads((tmp_path / "b.json").read_text()), truth_b)
        assert truth_a["ops"]["copy_blocks"]["calls"] > 0
        assert truth_b["ops"]["copy_blocks"]["calls"] > truth_a["ops"]["copy_blocks"]["calls"]
    finally:
        for t in (a, b):
            if t is not None:
                t.kill()
        sim.kill()


def _maps_file(pid, name):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


def test_process_that_exits_during_attach(tmp_path):
    """The target passes the checks, then exits while the BPF program
    compiles: one line, exit 3, nothing left."""
    sim = Kvsim(tmp_path, "default")
    tracer = Tracer("-q", "-p", sim.pid)
    try:
        # bcc's library is loaded only to compile, after the target checks
        deadline = time.monotonic() + 60
        while not _maps_file(tracer.proc.pid, "libbcc"):
            assert tracer.proc.poll() is None, tracer.proc.communicate()
            assert time.monotonic() < deadline, "the tracer never started compiling"
            time.sleep(0.02)
        sim.kill()  # and reaped: the pid is gone
        rc, out, err = tracer.finish()
        assert rc == 3, (rc, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"process {sim.pid} exited during attach" in lines[0]
        assert not os.path.exists(f"/proc/{sim.pid}")
    finally:
        tracer.kill()
        sim.kill()
