"""Where attach's output goes: messages on stderr, views on stdout, each
once; and on a terminal, the live view leaves nothing behind when the
summary replaces it (the header line used to show twice after Ctrl-C on a
screen shorter than the view).  Real BPF, real kvsim; the terminal is a
real one too (tmux, which `make setup` installs)."""

import os
import re
import shlex
import signal
import subprocess
import time

import pytest
from rich.cells import cell_len

from conftest import KVSIM, ROOT, kvtrace_cmd

pytestmark = pytest.mark.usefixtures("no_leftovers")

KVSIM_ARGS = [KVSIM, "--workload", "default", "--quiet"]


def test_messages_on_stderr_views_on_stdout_each_once():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    r = subprocess.run(kvtrace_cmd("attach", "--", *KVSIM_ARGS), cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    # stdout: the summary view, once, and no message line
    assert r.stdout.count("kvtrace-bpf summary (target exited)") == 1, r.stdout
    # a pipe is no terminal: the summary is drawn 120 columns wide (views.panels.
    # PIPE_WIDTH), not at rich's 80
    panels = [l for l in r.stdout.splitlines() if l.startswith("╭─ pid")]
    assert panels and all(cell_len(l) == 120 for l in panels), panels
    assert "kvtrace-bpf:" not in r.stdout and "tracing pid" not in r.stdout, r.stdout
    # stderr: every message once, no view
    assert r.stderr.count("tracing pid") == 1, r.stderr
    assert r.stderr.count("ready after") == 1, r.stderr
    assert all(line.startswith("kvtrace-bpf: ") for line in r.stderr.splitlines()), r.stderr
    assert "summary" not in r.stderr


class Tmux:
    """One command in a detached tmux session of a given size."""

    def __init__(self, name, command, width, height):
        self.name = name
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", str(width),
                        "-y", str(height), command], check=True)

    def screen(self, history=False):
        args = ["tmux", "capture-pane", "-p", "-t", self.name] + (["-S", "-"] if history else [])
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout

    def wait_for(self, needle, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen(history=True)
            if needle in text:
                return text
            time.sleep(0.2)
        raise AssertionError(f"{needle!r} never showed:\n{self.screen(history=True)}")

    def keys(self, *keys):
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def kill(self):
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.mark.parametrize("height", [30, 60])  # shorter and taller than the view
def test_ctrl_c_on_a_terminal_leaves_one_header(height):
    """The live view on a 100-column terminal, refreshed a few times, then
    Ctrl-C: what stays on the screen is the messages once and the summary
    once, no frame of the live view (its header line starts with
    'kvtrace-bpf  pid')."""
    # a long run (--repeat) that the tracer ends; the marker says it exited
    command = " ".join(shlex.quote(str(a)) for a in kvtrace_cmd(
        "attach", "-i", "0.2", "--", *KVSIM_ARGS, "--repeat", 100000, "--step-delay-us", 2000))
    term = Tmux(f"kvtrace-test-{height}", f"cd {shlex.quote(str(ROOT))} && {command}; "
                "echo KVTRACE-EXITED $?; sleep 600", 100, height)
    try:
        term.wait_for("kvtrace-bpf  pid")  # the live view is up...
        time.sleep(1)  # ...and refreshed several times (-i 0.2): any count will do
        term.keys("C-c")
        text = term.wait_for("KVTRACE-EXITED")
    finally:
        term.kill()
    assert "KVTRACE-EXITED 0" in text, text
    assert text.count("kvtrace-bpf summary (SIGINT)") == 1, text
    assert text.count("kvtrace-bpf  pid") == 0, text  # no live frame left behind
    assert text.count("tracing pid") == 1 and text.count("ready after") == 1, text
    assert "Traceback" not in text


def _attach_in_tmux(name, *args):
    command = " ".join(shlex.quote(str(a)) for a in kvtrace_cmd("attach", "-i", "0.3", *args))
    return Tmux(name, f"cd {shlex.quote(str(ROOT))} && {command}; "
                "echo KVTRACE-EXITED $?; sleep 600", 110, 50)


def test_live_view_says_what_a_command_does_before_its_first_op(tmp_path):
    """-- CMD: before the first op the live view says what the target is
    doing, not only "(no ops yet)": starting (a shell that spins until
    told, as vLLM imports for a minute before it maps its library), then
    idle with its probes placed (kvsim --pause), with the last line of its
    output file; the first op ends it, and the summary has none of it."""
    go = tmp_path / "go"
    script = (f"while [ ! -e {shlex.quote(str(go))} ]; do :; done; "
              f"exec {shlex.quote(str(KVSIM))} --workload default --pause")
    term = _attach_in_tmux("kvtrace-test-doing-cmd", "--", "sh", "-c", script)
    try:
        term.wait_for("target starting: no probe site mapped yet in its 1 process; ")
        go.touch()
        term.wait_for("target idle, probes placed: waiting for its first step; ")
        said = re.search(r"its log's last line: kvsim: pid (\d+) paused, send SIGUSR1 to start",
                         term.wait_for("its log's last line: kvsim: pid"))
        assert said, term.screen()
        os.kill(int(said.group(1)), signal.SIGUSR1)
        text = term.wait_for("KVTRACE-EXITED")
    finally:
        term.kill()
    assert "KVTRACE-EXITED 0" in text, text
    summary = text[text.index("kvtrace-bpf summary (target exited)"):]
    assert "target idle" not in summary and "its log's last line" not in summary, summary


def test_live_view_says_what_a_pid_does_before_its_first_op(tmp_path):
    """-p: the same for a running process whose output goes to a file (as
    the README's -p recipe starts vLLM): idle, probes placed, and the last
    line of that file."""
    log = tmp_path / "kvsim.log"
    with open(log, "w") as out:
        sim = subprocess.Popen([str(KVSIM), "--workload", "default", "--pause"],
                               stdout=out, stderr=out)
    term = None
    try:
        deadline = time.monotonic() + 30
        while "paused" not in log.read_text():
            assert time.monotonic() < deadline and sim.poll() is None, log.read_text()
            time.sleep(0.1)
        term = _attach_in_tmux("kvtrace-test-doing-pid", "-p", sim.pid)
        term.wait_for("target idle, probes placed: waiting for its first step; ")
        term.wait_for(f"its log's last line: kvsim: pid {sim.pid} paused, send SIGUSR1 "
                      "to start")
        sim.send_signal(signal.SIGUSR1)
        assert sim.wait(60) == 0
        text = term.wait_for("KVTRACE-EXITED")
    finally:
        if term is not None:
            term.kill()
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    assert "KVTRACE-EXITED 0" in text, text
