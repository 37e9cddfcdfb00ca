"""Every example of every --help epilog and of the README's command blocks
works as written (issue: a help example that fails is a user's first error).

Each example runs in a shell, as a user would paste it, with `kvtrace-bpf`
on PATH and `sudo` dropped (the suite runs as root); PID and 1234 stand for
a running kvsim, CMD [ARG...] for a kvsim command, [-d 60] for `-d 60`.
Examples that run until Ctrl-C (attach or record -p) get SIGINT once they
are ready.  A pipe into flamegraph.pl (not installed here) is cut off and
what would go into it is checked to be folded stacks.  Examples that need a
running vLLM (`$(pgrep ...)`, `$!`, a fork's library path) are parsed by
the real argument parser here, and their pgrep expression is run against a
real vLLM server in test_e2e_vllm.py."""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Kvsim, read_line

pytestmark = pytest.mark.usefixtures("no_leftovers")

SUBCOMMANDS = ("", "attach", "record", "report", "export", "probes", "doctor")
FOLDED = re.compile(r"^\S.*;?\S* \d+$")
VLLM_ONLY = re.compile(r"\$\(|\$!|\.\.\./")


def _help_examples(sub):
    """The examples block of `kvtrace-bpf [sub] --help`, formatted in-process
    (the same argparse text, without a process per help at collection)."""
    from tracer.cli import build_parser

    parser = build_parser()
    if sub:
        parser = next(a for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)).choices[sub]
    block = parser.format_help().split("examples:\n", 1)[1].split("\n\n", 1)[0]
    return block.replace("\\\n", " ").splitlines()


def _readme_examples():
    """Command lines of the README's indented blocks that run kvtrace-bpf."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    return [line for line in text.splitlines()
            if re.match(r"^    (sudo )?(\.venv/bin/)?kvtrace-bpf ", line)]


def _normalize(line):
    """As a user would type it here: no comment, no sudo, placeholders filled."""
    line = re.split(r"\s#\s", line.strip(), maxsplit=1)[0].strip()
    line = re.sub(r"^sudo ", "", line)
    line = re.sub(r"^\.venv/bin/kvtrace-bpf", "kvtrace-bpf", line)
    line = line.replace("CMD [ARG...]", "tests/target/kvsim --workload swap")
    line = re.sub(r"\[(-\w [^\]]+)\]", r"\1", line)  # [-d 60] -> -d 60
    line = re.sub(r"\bPID\b|\b1234\b", "{pid}", line)
    return " ".join(line.split())  # a continuation line's indent is not the command's


def _examples():
    seen = {}
    for sub in SUBCOMMANDS:
        for line in _help_examples(sub):
            seen.setdefault(_normalize(line), f"kvtrace-bpf {sub} --help".replace("  ", " "))
    for line in _readme_examples():
        seen.setdefault(_normalize(line), "README.md")
    return [(where, line) for line, where in seen.items() if "kvtrace-bpf" in line]


EXAMPLES = _examples()


def vllm_pid_expressions():
    """The `$(...)` that examples use to find a vLLM server's pid."""
    return sorted({m for _, line in EXAMPLES for m in re.findall(r"\$\([^)]*\)", line)})


def test_the_examples_were_found():
    # the ones the docs rely on are among them (a change in the help format
    # would otherwise leave this file testing nothing)
    lines = [line for _, line in EXAMPLES]
    assert len(lines) >= 20, lines
    for needle in ("attach -p {pid}", "record -o run.kvt --", "report run.kvt",
                   "export --folded run.kvt", "probes tests/target/libkvsim_ops.so",
                   "doctor", "$(pgrep"):
        assert any(needle in line for line in lines), needle


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory laid out as the checkout is for the examples' relative
    paths (tests/target/...), with kvtrace-bpf on PATH and a recording
    (run.kvt) made as the help's own record example makes it."""
    d = tmp_path_factory.mktemp("examples")
    (d / "tests").symlink_to(ROOT / "tests")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "kvtrace-bpf"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tracer.cli \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    r = subprocess.run(["bash", "-c", "kvtrace-bpf record -o run.kvt -- tests/target/kvsim "
                        "--workload swap"], cwd=d, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    os.rename(d / "run.kvt", d / "pristine.kvt")
    return d, env


@pytest.fixture(scope="module")
def running_kvsim(tmp_path_factory):
    """A kvsim firing its ops until told to stop: the PID of the examples."""
    sim = Kvsim(tmp_path_factory.mktemp("sim"), "default", "--repeat", 1000000,
                "--step-delay-us", 1000)
    sim.go()
    yield sim
    assert sim.stop() == 0
    sim.kill()


def _runs_until_ctrl_c(line):
    return re.search(r"kvtrace-bpf (attach|record) .*-p \{pid\}", line) is not None


@pytest.mark.parametrize("where,line", EXAMPLES, ids=[l for _, l in EXAMPLES])
def test_example_works_as_written(where, line, workdir, running_kvsim, tmp_path):
    d, env = workdir
    # each example finds the recording the record example makes (the swap
    # workload: writes, copies and swaps), whatever an earlier one wrote
    shutil.copy(d / "pristine.kvt", d / "run.kvt")
    if VLLM_ONLY.search(line):
        # needs a vLLM: the real parser takes it, with a pid where the
        # shell would put one
        from tracer.cli import build_parser
        argv = shlex.split(re.sub(r"\$\([^)]*\)|\$!", "4242", line))[1:]
        cut = [i for i, a in enumerate(argv) if a in ("|", ">")]
        argv = argv[:cut[0]] if cut else argv
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: `{line}` is refused by the parser (exit {e.code})")
        assert getattr(args, "run", None), line
        return
    cmd = line.format(pid=running_kvsim.pid)
    piped = " | " in cmd and "flamegraph.pl" in cmd
    if piped:
        cmd = cmd.split(" | ", 1)[0]  # flamegraph.pl is not installed: check its input
    if _runs_until_ctrl_c(line):
        p = subprocess.Popen(["bash", "-c", cmd], cwd=d, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            read_line(p.stderr, "ready after", 120)
            os.killpg(p.pid, signal.SIGINT)  # the Ctrl-C the help speaks of
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        rc = p.returncode
    else:
        r = subprocess.run(["bash", "-c", cmd], cwd=d, env=env, capture_output=True,
                           text=True, timeout=300)
        rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc == 0, f"{where}: `{line}` -> exit {rc}\n{err[-2000:]}"
    assert "Traceback" not in err, err
    if piped:
        assert out and all(FOLDED.match(l) for l in out.splitlines()), out[:500]
    for path in re.findall(r"(?:-o|--json|--folded|>) (\S+\.(?:kvt|json|folded|csv))", cmd):
        assert (d / path).stat().st_size > 0, f"{line}: {path} is empty"


def test_pid_expressions_parse_as_one_pid():
    """Each `$(pgrep ...)` of the examples is one pgrep that names one
    process (-o), so that `-p $(...)` is never `-p 12 34`."""
    exprs = vllm_pid_expressions()
    assert exprs
    for e in exprs:
        assert re.fullmatch(r"\$\(pgrep -of '[^']+'\)", e), e


def run_pid_expression(expr, cwd=ROOT):
    """What the shell puts in place of expr (for the vLLM test)."""
    return subprocess.run(["bash", "-c", f"echo {expr}"], cwd=cwd, capture_output=True,
                          text=True, timeout=30).stdout.strip()


assert Path(__file__).parent == ROOT / "tests"
