"""Following process trees with kvsim: the probes live in a descendant of
the process the tracer is given, as vLLM's live in its workers."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import KVSIM, ROOT, Tracer, assert_matches_truth, kvtrace_cmd, read_line

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _kvsim_argv(truth, workload="beam"):
    return [str(KVSIM), "--workload", workload, "--truth", str(truth), "--quiet", "--pause"]


def _traced_pid(text):
    m = re.search(r"tracing pid (\d+) \(kvsim\)", text)
    assert m, text
    return int(m.group(1))


def test_attach_pid_follows_a_child(tmp_path):
    """-p of a shell whose child is kvsim: the child is found and traced."""
    truth = tmp_path / "truth.json"
    shell = subprocess.Popen(["sh", "-c", " ".join(_kvsim_argv(truth)) + "; exit 0"],
                             stderr=subprocess.PIPE, text=True)
    try:
        read_line(shell.stderr, "paused", 10)
        out_json = tmp_path / "kv.json"
        tracer = Tracer("-q", "-p", shell.pid, "--json", out_json)
        tracer.wait_attached()
        kvsim_pid = _traced_pid(tracer.early_err)
        assert kvsim_pid != shell.pid
        os.kill(kvsim_pid, signal.SIGUSR1)
        assert shell.wait(60) == 0
        rc, out, err = tracer.finish()
    finally:
        if shell.poll() is None:
            shell.kill()
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    assert_matches_truth(doc, json.loads(truth.read_text()))
    assert doc["processes"][0]["parent"] == shell.pid


def test_attach_command_follows_a_grandchild_started_later(tmp_path):
    """-- CMD where CMD starts kvsim only after a while, two levels down:
    found by the scan, then exact (kvsim waits for SIGUSR1 to work)."""
    truth = tmp_path / "truth.json"
    script = f"sleep 1; sh -c '{' '.join(_kvsim_argv(truth))}'"
    out_json = tmp_path / "kv.json"
    proc = subprocess.Popen(kvtrace_cmd("attach", "-q", "--json", out_json, "--",
                                        "sh", "-c", script),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = read_line(proc.stderr, "tracing pid", 60)
        os.kill(_traced_pid("".join(lines)), signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    doc = json.loads(out_json.read_text())
    traced = [p for p in doc["processes"] if p["layers"]]
    assert len(traced) == 1 and traced[0]["comm"] == "kvsim"
    assert traced[0]["parent"] not in (0, proc.pid)  # a grandchild of the tracer's child
    doc["processes"] = traced
    assert_matches_truth(doc, json.loads(truth.read_text()))


def test_a_library_mapped_later_is_found_and_an_unchanged_process_costs_no_maps(
        tmp_path, monkeypatch):
    """A process that maps a library with probe sites after the follower
    first saw it (dlopen) has it found at the next scan.  Between changes a
    scan reads no /proc/PID/maps (the kernel formats vLLM's in about 4 ms a
    process): only the executable code sizes in /proc/PID/status."""
    from tracer.probes import discover, follow

    lib = os.path.realpath(ROOT / "tests" / "target" / "libkvsim_ops.so")
    loader = ("import ctypes, sys\n"
              "print('ready', flush=True)\n"
              "sys.stdin.readline()\n"
              "ctypes.CDLL(sys.argv[1])\n"
              "print('loaded', flush=True)\n"
              "sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", loader, lib], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    reads = []
    real_read_maps = discover.read_maps
    monkeypatch.setattr(discover, "read_maps", lambda pid: reads.append(pid) or
                        real_read_maps(pid))
    try:
        # started and done importing: until then the interpreter maps its
        # own libraries, and a scan between two of them would see a change
        assert proc.stdout.readline().strip() == "ready"
        follower = follow.Follower(proc.pid)
        assert follower.scan() == {}
        assert reads == [proc.pid]  # the first sight reads the maps
        assert follower.scan() == {}
        assert reads == [proc.pid]  # nothing mapped since: no maps read
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "loaded"
        found = follower.scan()
        assert reads == [proc.pid, proc.pid]
        assert list(found) == [proc.pid] and lib in found[proc.pid]
        assert {p.provider for p in found[proc.pid][lib]} == {"vllm"}  # abi.PROVIDER, as the fork names it
        assert follower.scan() == found and len(reads) == 2
    finally:
        proc.kill()
        proc.wait()


def test_the_tree_is_listed_again_after_any_process_is_created():
    """The follower lists /proc again only when the kernel's last pid moved
    (Follower.tree): it must move with every new process, and a child
    started after a listing must be in the next one."""
    from tracer.probes import follow

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        follower = follow.Follower(os.getpid())
        before = follow.last_pid()
        assert before is not None and sleeper.pid in follower.tree()
        child = subprocess.Popen(["sleep", "30"])
        try:
            assert follow.last_pid() != before
            tree = follower.tree()
            assert tree[0] == os.getpid() and {sleeper.pid, child.pid} <= set(tree)
            assert follower.parent_of[child.pid] == os.getpid()
        finally:
            child.kill()
            child.wait()
    finally:
        sleeper.kill()
        sleeper.wait()
