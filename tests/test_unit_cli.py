"""Unit tests of the command line (tracer/cli.py, cmd_*.py) on the paths that
need no root and no BPF, run as a user would: `python -m tracer.cli`.  Also
the private output files (tracer/files.py)."""

import os
import stat
import subprocess
import sys

import pytest

from conftest import assert_one_line_error, readelf_probes
from tracer.errors import UsageError
from tracer.files import check_writable, open_private

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_DIR = os.path.join(REPO, "tests", "target")
LIB = os.path.join(TARGET_DIR, "libkvsim_ops.so")

# above the kernel's largest pid_max (2^22): should a usage check regress
# while the suite runs as root, nothing real gets traced
NO_PID = str(2**22 + 1)

ALL_PROBES = ["reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
              "cpu_attn_reshape_and_cache", "copy_blocks", "swap_blocks",
              "swap_blocks_batch", "block_table",
              # the plugin tier's, which kvsim fires from its scheduler
              "block_alloc", "block_hit", "block_cache", "block_free", "block_evict",
              "request", "req_preempt", "req_finish", "step_reqs", "step_rows",
              "prefix_hashes"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tracer.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "100"})


def test_help():
    r = cli("--help")
    assert r.returncode == 0
    assert "examples:" in r.stdout and "kvtrace-bpf probes" in r.stdout
    assert "exit codes:" in r.stdout


@pytest.mark.parametrize("sub,example", [("attach", "kvtrace-bpf attach -p 1234"),
                                         ("probes", "kvtrace-bpf probes tests/target")])
def test_subcommand_help(sub, example):
    r = cli(sub, "--help")
    assert r.returncode == 0
    assert "examples:" in r.stdout and example in r.stdout


@pytest.mark.parametrize("args", [
    ["attach"],                              # neither -p nor a command
    ["attach", "-p", NO_PID, "--", "true"],  # both
    ["attach", "-p", NO_PID, "--interval", "0"],
    ["attach", "-p", NO_PID, "--interval", "abc"],
    ["attach", "-p", NO_PID, "--duration", "-1"],
    ["attach", "-p", NO_PID, "--max-blocks", "0"],
    ["attach", "-p", NO_PID, "--max-blocks", "300000"],
    ["attach", "-p", NO_PID, "--perf-pages", "3"],
    # without --folded or -o no stack is taken
    ["attach", "-p", NO_PID, "--stack-storage-size", "8"],
    ["record", "-p", NO_PID, "-o", "x.kvt", "--stack-storage-size", str(2**18 + 1)],
    ["attach", "-p", "abc"],
    ["attach", "--no-such-flag", "-p", NO_PID],
    ["probes"],                              # neither PATH nor -p
    ["probes", "-p", NO_PID, "/bin/true"],   # both
    ["frobnicate"],
])
def test_usage_errors(args):
    assert_one_line_error(cli(*args), 1)


@pytest.mark.parametrize("argv,absent", [
    (["report", "--help"], "tracer.commands.attach"),  # report needs none of attach's modules
    (["--debug", "export", "--help"], "tracer.kernel.session"),
    (["probes", "--help"], "tracer.commands.report"),
])
def test_one_subcommand_imports_one_module(argv, absent):
    """A subcommand's run imports its own module, not every other one."""
    code = ("import sys\nfrom tracer import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules "
            "if m.startswith('tracer.commands.') or m == 'tracer.kernel.session'))")
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = eval(r.stdout.strip().splitlines()[-1])
    assert f"tracer.commands.{argv[-2]}" in loaded and absent not in loaded, loaded


@pytest.mark.parametrize("argv", [["--help"], ["-h", "report"], ["--debug", "--help", "attach"]])
def test_help_lists_every_subcommand(argv):
    from tracer import cli as cli_mod
    r = cli(*argv)
    assert r.returncode == 0
    assert all(f"    {name} " in r.stdout for name in cli_mod.COMMANDS), r.stdout


def test_no_subcommand_is_usage_error():
    r = cli()
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == ""


def test_no_subcommand_one_line():
    assert_one_line_error(cli(), 1)


def test_attach_unwritable_json_fails_before_root():
    # must be a usage error (1), not "needs root" (2): outputs are checked first
    r = cli("attach", "--json", "/nonexistent-dir/x.json", "-p", "1")
    assert_one_line_error(r, 1)
    assert "/nonexistent-dir" in r.stderr


def test_attach_folded_into_directory_fails(tmp_path):
    assert_one_line_error(cli("attach", "--folded", str(tmp_path), "-p", NO_PID), 1)


@pytest.mark.parametrize("path", ["/bin/true", "/nonexistent", "."])
def test_probes_target_errors(path):
    # no probes / no such file / a directory: all "target" errors
    assert_one_line_error(cli("probes", path), 3)


def test_probes_lists_kvsim_lib():
    if not os.path.exists(LIB):  # a failed build fails the test: no skip
        r = subprocess.run(["make", "-s", "-C", TARGET_DIR], capture_output=True, text=True)
        assert r.returncode == 0, f"cannot build tests/target: {r.stderr.strip()[-300:]}"
    r = cli("probes", LIB)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == LIB
    names = sorted(l.split()[0] for l in lines[1:])
    assert names == sorted(f"{p}:{n}" for p, n in readelf_probes(LIB))
    assert names == sorted(f"vllm:{n}" for n in ALL_PROBES)
    assert all("sem 0x" in l for l in lines[1:])  # every probe has a semaphore


# -- files.py ------------------------------------------------------------------

def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_open_private_creates_0600(tmp_path):
    path = tmp_path / "out.json"
    old = os.umask(0)  # even with a permissive umask
    try:
        with open_private(str(path)) as f:
            f.write("{}\n")
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    assert path.read_text() == "{}\n"


def test_open_private_narrows_existing_file(tmp_path):
    path = tmp_path / "out.folded"
    path.write_text("old content that is longer\n")
    os.chmod(path, 0o644)
    with open_private(str(path)) as f:
        f.write("new\n")
    assert mode(path) == 0o600
    assert path.read_text() == "new\n"  # truncated, not overwritten in place


def test_open_private_unwritable(tmp_path):
    with pytest.raises(UsageError):
        open_private(str(tmp_path / "no" / "such" / "dir.json"))


def test_check_writable(tmp_path):
    check_writable(str(tmp_path / "fine.json"))  # must not raise
    with pytest.raises(UsageError, match="no such directory"):
        check_writable(str(tmp_path / "missing" / "x.json"))
    with pytest.raises(UsageError, match="is a directory"):
        check_writable(str(tmp_path))
