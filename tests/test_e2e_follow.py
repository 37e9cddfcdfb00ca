"""Following process trees with kvsim: the probes live in a descendant of
the process the tracer is given, as vLLM's live in its workers."""

import json
import os
import re
import signal
import subprocess

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
