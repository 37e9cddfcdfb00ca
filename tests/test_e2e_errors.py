"""User mistakes and hostile environments: one line, a documented exit code,
no traceback (docs/exit-codes.md)."""

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import (KVSIM, KVSIM_LIB, NO_READ_OVERRIDE, NOBODY, NOBODY_UID, ROOT,
                      assert_one_line_error, kvtrace_cmd, run_as, run_kvtrace, unused_pid)

pytestmark = pytest.mark.usefixtures("no_leftovers")

EXIT_USAGE, EXIT_ENV, EXIT_TARGET = 1, 2, 3


def test_missing_pid():
    r = run_kvtrace("attach", "-p", unused_pid())
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
    r = run_as(NOBODY, "attach", "-p", os.getpid())
    assert_one_line_error(r, EXIT_ENV, "needs root")


@pytest.mark.parametrize("args", [
    ("attach",),
    ("attach", "-p", "1", "--", "true"),
    ("attach", "-p", "abc"),
    ("attach", "-p", "1", "--interval", "0"),
    ("attach", "-p", "1", "--duration", "-3"),
    ("attach", "-p", "1", "--perf-pages", "3"),
    ("attach", "-p", "1", "--json", "/nonexistent-dir/x.json"),
    ("attach", "-p", "1", "--max-layers", "100000"),
    ("attach", "-p", "1", "--max-procs", "0"),
    ("attach", "-p", "1", "--transport", "pigeon"),
    ("doctor", "-p", "x"),
    ("nosuchcommand",),
])
def test_usage_errors(args):
    r = run_kvtrace(*args)
    assert r.returncode == EXIT_USAGE, (args, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


# -- the offline commands' inputs, and the flags of report, export, record ---------

EXIT_DATA = 4


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """A real recording of kvsim (0600, root's, as record makes it)."""
    path = tmp_path_factory.mktemp("rec") / "default.kvt"
    r = run_kvtrace("record", "-o", path, "--", KVSIM, "--workload", "default", "--quiet")
    assert r.returncode == 0, r.stderr
    assert oct(path.stat().st_mode & 0o777) == "0o600" and path.stat().st_uid == 0
    return path


OFFLINE = [("report",), ("export", "--folded")]


@pytest.mark.parametrize("cmd", OFFLINE)
def test_offline_commands_on_what_is_not_a_trace(tmp_path, cmd):
    empty = tmp_path / "empty.kvt"
    empty.write_bytes(b"")
    noise = tmp_path / "noise.kvt"
    noise.write_bytes(random.Random(7).randbytes(5000))
    for path, words in ((tmp_path / "missing.kvt", ("cannot read", "No such file")),
                        (tmp_path, ("cannot read", "Is a directory")),
                        (empty, ("empty file",)),
                        (noise, ("not a kvtrace-bpf trace file",)),
                        (Path("/dev/zero"), ("a device",))):  # never ends: not read
        r = run_kvtrace(*cmd, path)
        assert_one_line_error(r, EXIT_DATA, str(path), *words)
        assert r.stdout == ""


def _someone_elses(path):
    """path made another user's private file: root without its read
    overrides (NO_READ_OVERRIDE) may not read it, as any user may not."""
    os.chown(path, NOBODY_UID, NOBODY_UID)
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("cmd", OFFLINE)
def test_offline_commands_on_a_trace_they_may_not_read(recording, tmp_path, cmd):
    trace = _someone_elses(shutil.copy(recording, tmp_path / "private.kvt"))
    r = run_as(NO_READ_OVERRIDE, *cmd, trace)
    assert_one_line_error(r, EXIT_DATA, "cannot read", str(trace), "Permission denied")
    # and root reads it (the same file, so the refusal was the permission)
    assert run_kvtrace(*cmd, trace).returncode == 0


def test_probes_on_a_directory_and_an_unreadable_file(tmp_path):
    assert_one_line_error(run_kvtrace("probes", tmp_path), EXIT_TARGET, "directory")
    lib = _someone_elses(shutil.copy(KVSIM_LIB, tmp_path / "libkvsim_ops.so"))
    r = run_as(NO_READ_OVERRIDE, "probes", lib)
    assert_one_line_error(r, EXIT_TARGET, str(lib), "ermission denied")
    assert run_kvtrace("probes", lib).returncode == 0  # root: the same file has probes


@pytest.mark.parametrize("where", ["no-such-dir/run.kvt", "."])
def test_record_output_that_cannot_be_written_fails_before_starting(tmp_path, where):
    """A usage error before anything is attached or started: the command
    (which would leave a file behind) never runs."""
    marker = tmp_path / "ran"
    out = tmp_path / where
    r = run_kvtrace("record", "-o", out, "--", "touch", marker)
    assert_one_line_error(r, EXIT_USAGE, "cannot write", str(out))
    assert not marker.exists()
    r = run_kvtrace("record", "-o", out, "-p", os.getpid())
    assert_one_line_error(r, EXIT_USAGE, "cannot write")


@pytest.fixture(scope="module")
def synthetic_trace(tmp_path_factory):
    from test_unit_tracefile import synthetic_ops, write_trace
    return write_trace(tmp_path_factory.mktemp("syn") / "t.kvt",
                       [synthetic_ops(10, 100, 64, seq0=10 * i) for i in range(2)], blocks=64)


@pytest.mark.parametrize("args", [
    ("--resol", "0", "5"), ("--resol", "-1", "5"), ("--resol", "a", "b"), ("--resol", "5"),
    ("--resol", "100000", "5"), ("--resol", "5", "1000000"),
    ("--time-range", "5", "2"), ("--time-range", "2", "2"), ("--time-range", "nan", "1"),
    ("--time-range", "0", "inf"), ("--time-range", "-1", "2"), ("--time-range", "x", "2"),
    ("--time-range", "0", "1e300"),
    ("--block-range", "5", "2"), ("--block-range", "-1", "3"), ("--block-range", "0", "1.5"),
    ("--block-range", "0", str(2**70)),
    ("--format", "xml"), ("--table", "nope"), ("--table", "heatmap"), ("--pid", "abc"),
    ("--pid", "-5"), ("--layer", "x"), ("--nosuchflag",),
])
def test_report_bad_flags(synthetic_trace, args):
    r = run_kvtrace("report", synthetic_trace, *args)
    assert_one_line_error(r, EXIT_USAGE)
    assert r.stdout == ""


@pytest.mark.parametrize("args", [
    ("--group", "0"), ("--group", "-3"), ("--group", "x"), ("--by", "nope"),
    ("--weight", "nope"), ("--pid", "x"), ("-o", "/nonexistent-dir/x.folded"), ("-o", "."),
])
def test_export_bad_flags(synthetic_trace, args):
    r = run_kvtrace("export", "--folded", synthetic_trace, *args)
    assert_one_line_error(r, EXIT_USAGE)
    assert r.stdout == ""
    r = run_kvtrace("export", synthetic_trace)  # --folded is required
    assert_one_line_error(r, EXIT_USAGE, "--folded")


@pytest.mark.parametrize("args", [
    ("-d", "0"), ("-d", "-1"), ("-d", "abc"), ("-d", "nan"), ("--perf-pages", "3"),
    ("--perf-pages", "0"), ("--max-blocks", "0"), ("--max-blocks", "x"),
    ("--max-layers", "0"), ("--max-layers", "100000"), ("-p", "0"), ("-p", "-1"),
])
def test_record_bad_flags(tmp_path, args):
    marker = tmp_path / "ran"
    r = run_kvtrace("record", "-o", tmp_path / "r.kvt", *args, "--", "touch", marker)
    assert_one_line_error(r, EXIT_USAGE)
    assert not marker.exists() and not (tmp_path / "r.kvt").exists()
    assert_one_line_error(run_kvtrace("record", "--", "true"), EXIT_USAGE, "-o")


@pytest.mark.parametrize("args", [("-p", "-5"), ("-p", "0"), ("-p", "abc"), (),
                                  ("/bin/true", "-p", "1")])
def test_probes_bad_flags(args):
    assert_one_line_error(run_kvtrace("probes", *args), EXIT_USAGE)


# -- a command that cannot be executed ----------------------------------------

@pytest.mark.parametrize("content,mode,words", [
    # found and executable, but the kernel refuses the exec: only the exec's
    # own errno can tell (the tracer has compiled and forked by then)
    ("#!/nonexistent/interpreter\necho hi\n", 0o755, ("No such file or directory",)),
    ("\x7fELF not really\n", 0o755, ("Exec format error",)),
    # refused before anything starts
    ("#!/bin/sh\necho hi\n", 0o644, ("Permission denied",)),
])
def test_command_that_cannot_be_executed(tmp_path, content, mode, words):
    cmd = tmp_path / "cmd"
    cmd.write_text(content)
    cmd.chmod(mode)
    r = run_kvtrace("attach", "-q", "--", cmd)
    assert_one_line_error(r, EXIT_TARGET, f"cannot execute {cmd}", *words)
    r = run_kvtrace("record", "-o", tmp_path / "r.kvt", "--", cmd)
    assert_one_line_error(r, EXIT_TARGET, f"cannot execute {cmd}", *words)


def test_missing_command_path(tmp_path):
    r = run_kvtrace("attach", "-q", "--", tmp_path / "missing")
    assert_one_line_error(r, EXIT_TARGET, "command not found", str(tmp_path / "missing"),
                          "No such file or directory")


# -- inputs that are not regular files -------------------------------------------

@pytest.mark.parametrize("cmd,code,words", [
    (("report",), EXIT_DATA, ("cannot read", "a named pipe, not a trace file")),
    (("export", "--folded"), EXIT_DATA, ("cannot read", "a named pipe, not a trace file")),
    (("probes",), EXIT_TARGET, ("a named pipe, not an ELF file",)),
])
def test_offline_commands_refuse_a_named_pipe_without_waiting(tmp_path, cmd, code, words):
    """A FIFO nobody writes to: opening it to read would block forever.  The
    timeout is the test: the refusal comes at once."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_kvtrace(*cmd, fifo, timeout=30)
    assert_one_line_error(r, code, str(fifo), *words)


# -- commands agree on usage errors ----------------------------------------------

@pytest.mark.parametrize("args", [("doctor", "-p", "0"), ("doctor", "-p", "-1"),
                                  ("attach", "-p", "0"), ("probes", "-p", "0")])
def test_non_positive_pid_is_a_usage_error_everywhere(args):
    assert_one_line_error(run_kvtrace(*args), EXIT_USAGE, "must be > 0")


@pytest.mark.parametrize("cmd", OFFLINE)
def test_offline_pid_with_no_ops_is_a_usage_error(recording, cmd):
    pid = unused_pid()
    assert_one_line_error(run_kvtrace(*cmd, recording, "--pid", pid), EXIT_USAGE,
                          f"no ops of pid {pid}")
