"""The live view as a terminal shows it (real BPF, kvsim): where `attach --
CMD` sends the command's own output, so that it does not tear the screen."""

import glob
import os
import re
import select
import subprocess
import tempfile
import time

import pytest

from conftest import KVSIM, ROOT, kvtrace_cmd, run_kvtrace

pytestmark = pytest.mark.usefixtures("no_leftovers")

KVSIM_LINE = "kvsim: workload=default"  # kvsim's summary line, on its stderr


def test_cmd_output_to_a_file(tmp_path):
    out = tmp_path / "cmd.log"
    r = run_kvtrace("attach", "-q", "--cmd-output", out, "--", KVSIM, "--workload", "default")
    assert r.returncode == 0, r.stderr
    assert KVSIM_LINE in out.read_text()
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    # not on the tracer's streams, and the tracer says where it went
    assert KVSIM_LINE not in r.stdout + r.stderr
    assert f"kvsim's output is in {out}" in r.stderr


def test_cmd_output_dash_and_no_live_view_keep_the_terminal():
    # -q draws no live view: the command's output stays where it was
    r = run_kvtrace("attach", "-q", "--", KVSIM, "--workload", "default")
    assert r.returncode == 0 and KVSIM_LINE in r.stderr, r.stderr
    assert "output is in" not in r.stderr
    r = run_kvtrace("attach", "-q", "--cmd-output", "-", "--", KVSIM, "--workload", "default")
    assert r.returncode == 0 and KVSIM_LINE in r.stderr, r.stderr


def test_an_empty_cmd_output_file_is_not_left_behind():
    """With the live view, -- CMD's output goes to a new file; a command
    that wrote nothing (kvsim --quiet) leaves no empty file in $TMPDIR,
    and the tracer says so instead of naming it."""
    logs = os.path.join(tempfile.gettempdir(), "kvtrace-cmd-*.log")
    before = set(glob.glob(logs))
    rc, screen = run_in_a_terminal(kvtrace_cmd(
        "attach", "-i", "0.2", "--", KVSIM, "--workload", "default", "--quiet"))
    assert rc == 0, screen[-2000:]
    m = re.search(r"kvsim's output goes to (\S+/kvtrace-cmd-\S+\.log)", screen)
    assert m, screen[-2000:]
    assert not os.path.exists(m.group(1))
    assert "kvsim wrote no output" in screen and "output is in" not in screen
    assert set(glob.glob(logs)) <= before


def test_cmd_output_needs_a_command():
    r = run_kvtrace("attach", "-p", os.getpid(), "--cmd-output", "x.log")
    assert r.returncode == 1 and "--cmd-output goes with -- CMD" in r.stderr


def run_in_a_terminal(argv, timeout=120, columns=100, lines=60):
    """Run argv with a pseudo-terminal as stdout and stderr (so the live
    view is drawn); all it wrote there."""
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env={**os.environ, "COLUMNS": str(columns),
                                               "LINES": str(lines)})
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_live_view_sends_cmd_output_to_a_named_private_file():
    # kvsim runs long enough for a few refreshes of the live view
    rc, screen = run_in_a_terminal(kvtrace_cmd(
        "attach", "-i", "0.2", "--", KVSIM, "--workload", "default", "--repeat", 400,
        "--step-delay-us", 20))
    assert rc == 0, screen
    m = re.search(r"kvsim's output goes to (\S+/kvtrace-cmd-\S+\.log)", screen)
    assert m, screen[-2000:]
    path = m.group(1)
    try:
        assert KVSIM_LINE in open(path).read()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        # kvsim's line is not on the screen; the view and the end say where it is
        assert KVSIM_LINE not in screen
        assert f"kvsim's output: {path}" in screen  # the live view's note
        assert f"kvsim's output is in {path}" in screen
        assert "summary (target exited)" in screen
    finally:
        os.unlink(path)


def test_live_view_fits_a_50_row_terminal():
    """kvsim's writes, reads and scheduler events in a 50-row terminal: the
    live view fits, where the tables only the summary needs (the hottest
    blocks', items per op) made it cut its last 40 lines."""
    rc, screen = run_in_a_terminal(kvtrace_cmd(
        "attach", "-i", "0.2", "--", KVSIM, "--workload", "default", "--repeat", 400,
        "--step-delay-us", 20), columns=200, lines=50)
    assert rc == 0, screen[-3000:]
    summary = screen.index("summary (target exited)")
    live_frames = screen[:summary]
    # frames were drawn, with every part of the process's panel ...
    for part in ("tokens written per block", "reads per block, group 0",
                 "lifecycle (scheduler)"):
        assert part in live_frames, part
    # ... and none was cut to the terminal's height
    assert "more lines" not in live_frames
    # the summary at the end has all
    assert "items per op (log2)" in screen[summary:]
    assert "items per op (log2)" not in live_frames
