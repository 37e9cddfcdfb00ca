"""User mistakes and hostile environments: one line, a documented exit code,
no traceback (docs/exit-codes.md)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, kvtrace_cmd, run_kvtrace

pytestmark = pytest.mark.usefixtures("no_leftovers")

EXIT_USAGE, EXIT_ENV, EXIT_TARGET = 1, 2, 3


def assert_one_line_error(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("kvtrace-bpf")
    for w in words:
        assert w in lines[0], lines[0]


def _unused_pid():
    pid = 4_000_000  # above the default pid_max of 4194304's busy range
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_missing_pid():
    r = run_kvtrace("attach", "-p", _unused_pid())
    assert_one_line_error(r, EXIT_TARGET, "no process")


def test_pid_that_is_not_vllm():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = run_kvtrace("attach", "-p", sleeper.pid)
        assert_one_line_error(r, EXIT_TARGET, str(sleeper.pid), "sleep", "is not vLLM")
        assert sleeper.poll() is None  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_binary_with_no_probes():
    assert_one_line_error(run_kvtrace("probes", "/bin/true"), EXIT_TARGET, "no vllm:* probes")
    assert_one_line_error(run_kvtrace("probes", "/nonexistent/lib.so"), EXIT_TARGET, "no such file")


def test_command_not_found():
    r = run_kvtrace("attach", "--", "/nonexistent/kvsim")
    assert_one_line_error(r, EXIT_TARGET, "command not found")


def test_without_privileges_root_without_capabilities():
    # uid 0 but no capabilities: the kernel would refuse BPF, so do we, first
    r = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--",
                        *kvtrace_cmd("attach", "-p", os.getpid())],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert_one_line_error(r, EXIT_ENV, "needs root")


def test_without_privileges_as_nobody():
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-c", "import tracer.cli"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this checkout is not readable by uid 65534: {probe.stderr.strip()[-120:]}")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        *kvtrace_cmd("attach", "-p", os.getpid())],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert_one_line_error(r, EXIT_ENV, "needs root")


@pytest.mark.parametrize("args", [
    ("attach",),
    ("attach", "-p", "1", "--", "true"),
    ("attach", "-p", "abc"),
    ("attach", "-p", "1", "--interval", "0"),
    ("attach", "-p", "1", "--duration", "-3"),
    ("attach", "-p", "1", "--perf-pages", "3"),
    ("attach", "-p", "1", "--json", "/nonexistent-dir/x.json"),
    ("nosuchcommand",),
])
def test_usage_errors(args):
    r = run_kvtrace(*args)
    assert r.returncode == EXIT_USAGE, (args, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
