"""Where attach's output goes: messages on stderr, views on stdout, each
once; and on a terminal, the live view leaves nothing behind when the
summary replaces it (the header line used to show twice after Ctrl-C on a
screen shorter than the view).  Real BPF, real kvsim; the terminal is a
real one too (tmux, which `make setup` installs)."""

import shlex
import subprocess
import time

import pytest

from conftest import KVSIM, ROOT, kvtrace_cmd

pytestmark = pytest.mark.usefixtures("no_leftovers")

KVSIM_ARGS = [KVSIM, "--workload", "default", "--quiet"]


def test_messages_on_stderr_views_on_stdout_each_once():
    r = subprocess.run(kvtrace_cmd("attach", "--", *KVSIM_ARGS), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # stdout: the summary view, once, and no message line
    assert r.stdout.count("kvtrace-bpf summary (target exited)") == 1, r.stdout
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
