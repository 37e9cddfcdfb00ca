"""Every example of every --help epilog and of the README's command blocks
works as written (issue: a help example that fails is a user's first error).

Each example runs in a shell, as a user would paste it, with `kvtrace-bpf`
on PATH and `sudo` dropped (the suite runs as root); PID and 1234 stand for
a running kvsim, CMD [ARG...] for a kvsim command, [-d 60] for `-d 60`.
Examples that run until Ctrl-C (attach or record -p) get SIGINT once they
are ready; the agent's, which runs until SIGTERM, gets SIGTERM.  A pipe
into flamegraph.pl (not installed here) is cut off and what would go into
it is checked to be folded stacks.  Examples that need a
running vLLM (`$(pgrep ...)`, `$!`, a fork's library path) are parsed by
the real argument parser here, and their pgrep expression is run against a
real vLLM server in test_e2e_vllm.py.

The README's other commands (make demo, make demo-vllm, the `attach -p`
recipe on real vLLM, flamegraph.pl's input, the plugin's pip line, kvsim's
synopsis) each have a test below; test_every_readme_command_is_run checks
that no command of the README is left without one."""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, Kvsim, read_line

pytestmark = pytest.mark.usefixtures("no_leftovers")

SUBCOMMANDS = ("", "attach", "record", "report", "export", "probes", "doctor",
               "audit-kv-events")
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
    # the README's second recording, which its comparison reads
    r = subprocess.run(["bash", "-c", "kvtrace-bpf record -o prefix.kvt -- tests/target/kvsim "
                        "--workload prefix"], cwd=d, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
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


def _runs_until_sigterm(line):
    """The agent runs until SIGTERM (a service's stop): the examples get one
    once it says it is ready, and must end with 0."""
    return re.match(r"kvtrace-bpf agent\b", line) is not None


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
    if _runs_until_ctrl_c(line) or _runs_until_sigterm(line):
        p = subprocess.Popen(["bash", "-c", cmd], cwd=d, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            read_line(p.stderr, "ready after", 300)
            # the Ctrl-C the help speaks of; the agent's service stop
            os.killpg(p.pid, signal.SIGTERM if _runs_until_sigterm(line) else signal.SIGINT)
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
    for path in re.findall(r"(?:-o|--json|--folded|--html|>) (\S+\.(?:kvt|json|folded|csv|html))",
                           cmd):
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


# -- every command of the README, not only kvtrace-bpf's ------------------------
#
# Each command line of the README's indented blocks is run by one test below
# (or, for `make test`, is the suite itself), named here by a pattern.  A
# line that none matches, or a pattern that matches no line, fails
# test_every_readme_command_is_run: a new recipe comes with its test.

README_COMMAND = re.compile(r"^    (?:sudo )?(?:make |kvtrace-bpf |\.venv|scripts/\S|"
                            r"flamegraph\.pl |kill |/path/|tests/target/kvsim |curl |npm |"
                            r"speedscope |git |pip )")
README_RUN_BY = [
    (r"(sudo )?(\.venv/bin/)?kvtrace-bpf (?!attach -p \$!$).*", "test_example_works_as_written"),
    (r"make demo", "test_make_demo"),
    (r"make test", "the suite itself: .ci/run runs make test"),
    (r"make demo-vllm", "test_make_demo_vllm"),
    (r"make findings", "test_make_findings (tests/test_e2e_pictures.py)"),
    (r"scripts/make-tiny-model\.py .*|\.venv-vllm/bin/python scripts/vllm-workload\.py .*|"
     r"sudo \.venv/bin/kvtrace-bpf attach -p \$!|kill -USR1 PID",
     "test_readme_attach_pid_recipe"),
    (r"(.* \| )?flamegraph\.pl .*", "test_flamegraph_input_and_where_it_comes_from"),
    (r"/path/to/venv/bin/pip install --no-build-isolation \./plugin",
     "test_plugin_install_line_is_what_setup_runs"),
    (r"tests/target/kvsim --workload .*", "test_kvsim_synopsis_matches_its_help"),
]


def readme_commands():
    """The README's command lines, comments and continuations folded in."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    return [" ".join(re.split(r"\s#\s", line.strip(), maxsplit=1)[0].split())
            for line in text.splitlines() if README_COMMAND.match(line)]


def readme_block(first):
    """The README's block of command lines that starts with `first`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == first)
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(" ".join(re.split(r"\s#\s", line.strip(), maxsplit=1)[0].split()))
    return block


def test_every_readme_command_is_run():
    commands = readme_commands()
    assert len(commands) >= 20, commands
    unmatched = [c for c in commands
                 if not any(re.fullmatch(p, c) for p, _ in README_RUN_BY)]
    assert not unmatched, f"README commands that no test runs: {unmatched}"
    unused = [by for p, by in README_RUN_BY if not any(re.fullmatch(p, c) for c in commands)]
    assert not unused, f"tests of README commands that are gone: {unused}"


def test_make_demo():
    """`make demo` as the README says: kvsim traced; without a terminal the
    summary alone (the live view needs one), with counts in it."""
    r = subprocess.run(["make", "-s", "demo"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "kvtrace-bpf summary (target exited)" in r.stdout, r.stdout[-3000:]
    assert "counts: exact" in r.stdout and "reshape_and_cache" in r.stdout, r.stdout[-3000:]
    assert "Traceback" not in r.stderr


# flamegraph.pl's own reading of a line (its `my ($stack, $samples) = ...`):
# a line it does not match, it drops with a warning
FLAMEGRAPH_LINE = re.compile(r"^(.*)\s+?(\d+(?:\.\d*)?)$")


def test_flamegraph_input_and_where_it_comes_from(workdir):
    """flamegraph.pl comes with neither Debian 12 nor make setup, so its
    lines cannot run here as written.  What can fail is checked: the file
    each one reads (kv.folded, as the attach help's example makes it) is
    folded stacks every line of which flamegraph.pl reads (the piped ones:
    test_example_works_as_written), and the README says where
    flamegraph.pl comes from, and the way without it: speedscope."""
    d, env = workdir
    lines = [_normalize(l) for sub in SUBCOMMANDS for l in _help_examples(sub)]
    lines += readme_commands()
    files = {m for l in lines if l.startswith("flamegraph.pl ")
             for m in re.findall(r" (\S+\.folded)\b", l)}
    assert files == {"kv.folded"}, files
    (maker,) = {l for l in lines if re.match(r"kvtrace-bpf attach .*--folded kv\.folded "
                                             r"-- tests/target/kvsim", l)}
    r = subprocess.run(["bash", "-c", maker], cwd=d, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    folded = (d / "kv.folded").read_text().splitlines()
    assert folded and all(FLAMEGRAPH_LINE.match(l) and ";" in l for l in folded), folded[:5]
    readme = (ROOT / "README.md").read_text()
    before = readme[:readme.index("    flamegraph.pl --countname=slots kv.folded")]
    said = " ".join(before[before.rindex("`--folded FILE`"):].split())
    for words in ("https://github.com/brendangregg/FlameGraph", "not packaged by Debian",
                  "speedscope", "https://www.speedscope.app"):
        assert words in said, (words, said)


def test_plugin_install_line_is_what_setup_runs():
    """The README's pip line for another vLLM environment is the one make
    setup runs into .venv-vllm (which CI runs), less setup's own flags."""
    (line,) = [c for c in readme_commands() if "pip install" in c]
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = " ".join(re.search(r"\$\(VLLM_VENV\)/bin/pip install [^\n]*", makefile)[0].split())
    for arg in line.split()[1:]:
        assert arg in recipe.split(), (arg, recipe)


def test_kvsim_synopsis_matches_its_help():
    """The README's kvsim synopsis names only workloads and flags that
    kvsim's --help has."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("    tests/target/kvsim "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("     "))
    line = " ".join(lines[start:end])  # the synopsis's continuation lines too
    r = subprocess.run([ROOT / "tests" / "target" / "kvsim", "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    usage = r.stdout + r.stderr
    flags = re.findall(r"--[a-z][-a-z]*", line)
    assert len(flags) >= 10, flags
    for flag in flags:
        assert re.search(rf"^\s+{flag}\b", usage, re.M), flag
    workloads = re.search(r"--workload (\S+)", line)[1].split("|")
    listed = re.search(r"--workload NAME\s+(.*?)\n\s+--seed", usage, re.S)[1]
    assert sorted(workloads) == sorted(w.strip() for w in listed.split("|")), listed


# vLLM's log lines start with the process's name or the level: none may land
# in the live view (the tracer's own "its log's last line: ..." quotes one)
VLLM_LOG_LINE = re.compile(r"^\s*(\((EngineCore|Worker|MainProcess|APIServer)\b|"
                           r"(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d )", re.M)
DOING = re.compile(r"^target (starting|busy|idle)\b", re.M)


def _wait_screen(term, pattern, timeout=600, proc_log=None):
    """The screen's text (history too) once pattern matches it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = term.screen(history=True)
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.5)
    tail = proc_log.read_text()[-3000:] if proc_log is not None and proc_log.exists() else ""
    raise AssertionError(f"{pattern!r} never showed:\n{term.screen(history=True)}\n{tail}")


@pytest.mark.vllm
def test_make_demo_vllm(no_leftovers):
    """`make demo-vllm` on a terminal: while vLLM starts, the live view
    says what it is doing; then vLLM's ops are counted, and its log lines
    stay out of the view; Ctrl-C gives the summary."""
    from test_e2e_stdout_stderr import Tmux

    command = (f"export PYTHONPATH={shlex.quote(str(ROOT))}; cd {shlex.quote(str(ROOT))} && "
               "make -s demo-vllm; echo KVTRACE-EXITED; sleep 600")
    term = Tmux("kvtrace-test-demo-vllm", command, 120, 50)
    # make dies of the Ctrl-C once the tracer has ended (as make does), and
    # the shell with it: the pane stays, with what the tracer printed
    subprocess.run(["tmux", "set-option", "-t", term.name, "remain-on-exit", "on"], check=True)
    try:
        _wait_screen(term, DOING.pattern)
        _wait_screen(term, r"^ ?cpu_attn_reshape_and_cache +[1-9]")
        seen = term.screen(history=True)
        term.keys("C-c")
        # the tracer's last line: the command's output file, named
        text = _wait_screen(term, r"^kvtrace-bpf: python's output is in ", timeout=300)
    finally:
        term.kill()
    assert not VLLM_LOG_LINE.search(seen), seen
    assert "kvtrace-bpf summary (SIGINT)" in text and "Traceback" not in text, text


@pytest.mark.vllm
def test_readme_attach_pid_recipe(tmp_path, no_leftovers):
    """The README's `attach -p` recipe, its lines run as written (sudo
    dropped: the suite runs as root) from a directory laid out as the
    checkout: vLLM's output goes to vllm.log, never into the live view,
    which meanwhile says what vLLM is doing and, at the end, the log's
    READY line the README tells the user to wait for; the README's kill
    line with that line's pid (from a second shell) starts the workload,
    which generates and exits, and the tracer ends with it."""
    from test_e2e_stdout_stderr import Tmux

    recipe = readme_block("scripts/make-tiny-model.py build/tiny-llama")
    assert len(recipe) == 3 and recipe[-1] == "sudo .venv/bin/kvtrace-bpf attach -p $!", recipe
    (kill_line,) = [c for c in readme_commands() if c.startswith("kill -USR1 ")]
    assert kill_line == "kill -USR1 PID", kill_line
    for name in ("scripts", ".venv", ".venv-vllm"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "build").mkdir()
    script = tmp_path / "recipe.sh"  # run by its path: no shell's command line names vLLM
    script.write_text(f"export PYTHONPATH={shlex.quote(str(ROOT))}\n"
                      + "\n".join(re.sub(r"^sudo ", "", l) for l in recipe)
                      + "\necho KVTRACE-EXITED $?\nsleep 600\n")
    log = tmp_path / "vllm.log"
    term = Tmux("kvtrace-test-readme-p", f"cd {shlex.quote(str(tmp_path))} && bash recipe.sh",
                120, 50)
    try:
        _wait_screen(term, DOING.pattern, proc_log=log)
        ready = _wait_screen(term, r"^its log's last line: READY (\d+)$", proc_log=log)
        pid = int(re.findall(r"^its log's last line: READY (\d+)$", ready, re.M)[-1])
        assert f"READY {pid}" in log.read_text()
        # the workload, started by the README's line: the shell's $!
        assert open(f"/proc/{pid}/cmdline").read().split("\0")[1] == \
            "scripts/vllm-workload.py"
        seen = term.screen(history=True)
        subprocess.run(["bash", "-c", kill_line.replace("PID", str(pid))], cwd=tmp_path,
                       check=True, timeout=30)
        text = _wait_screen(term, "KVTRACE-EXITED", proc_log=log)
    finally:
        term.kill()
    assert not VLLM_LOG_LINE.search(seen + text), seen + text
    assert "KVTRACE-EXITED 0" in text, text
    summary = text[text.index("kvtrace-bpf summary (target exited)"):]
    assert re.search(r"^ cpu_attn_reshape_and_cache +[1-9]", summary, re.M), summary
    assert "Traceback" not in text


assert Path(__file__).parent == ROOT / "tests"
