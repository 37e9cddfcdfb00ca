"""Outputs that cannot be written (a full disk: /dev/full) once the work is
done: one line naming what was lost, exit 5 (docs/exit-codes.md), never a
traceback, and every other output still written and right.  Real BPF, real
kvsim; the outputs that survive are checked against kvsim's ground truth."""

import json
import subprocess

import pytest

from conftest import (KVSIM, ROOT, WRITE_OPS, assert_matches_truth, kvtrace_cmd,
                      run_kvtrace)

pytestmark = pytest.mark.usefixtures("no_leftovers")

EXIT_OUTPUT = 5
FULL = "/dev/full"  # every write fails with ENOSPC


def attach(tmp_path, *args, stdout=subprocess.PIPE):
    """attach -q ... -- kvsim --workload swap (copies, swaps and writes)."""
    truth = tmp_path / "truth.json"
    r = subprocess.run(kvtrace_cmd("attach", "-q", *args, "--", KVSIM, "--workload", "swap",
                                   "--truth", truth, "--quiet"),
                       cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)
    return r, json.loads(truth.read_text())


def assert_lost(r, *what):
    """Exit 5; the last stderr line (the ones before are attach's progress)
    is the only error, and names each lost output."""
    assert r.returncode == EXIT_OUTPUT, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    errors = [l for l in r.stderr.splitlines() if "cannot write" in l]
    assert len(errors) == 1 and errors[0] == r.stderr.strip().splitlines()[-1], r.stderr
    assert errors[0].startswith("kvtrace-bpf: ")
    for w in what:
        assert w in errors[0], errors[0]
    assert "No space left on device" in errors[0]


def folded_total(path):
    return sum(int(line.rpartition(" ")[2]) for line in path.read_text().splitlines())


def test_attach_json_to_a_full_disk_keeps_the_rest(tmp_path):
    folded, trace = tmp_path / "kv.folded", tmp_path / "run.kvt"
    r, truth = attach(tmp_path, "--json", FULL, "--folded", folded, "-o", trace)
    assert_lost(r, FULL)
    assert "summary (target exited)" in r.stdout
    assert folded_total(folded) == sum(o["slots"] if op in WRITE_OPS else o["pairs"]
                                       for op, o in truth["ops"].items())
    rep = run_kvtrace("report", trace, "--format", "json")
    assert rep.returncode == 0, rep.stderr
    assert json.loads(rep.stdout)["trace"]["complete"] is True


@pytest.mark.parametrize("lost", ["--folded", "-o"])
def test_attach_folded_or_trace_to_a_full_disk_keeps_the_json(tmp_path, lost):
    out = tmp_path / "kv.json"
    r, truth = attach(tmp_path, "--json", out, lost, FULL)
    assert_lost(r, FULL)
    assert_matches_truth(json.loads(out.read_text()), truth)


def test_attach_summary_to_a_full_disk_keeps_the_files(tmp_path):
    out = tmp_path / "kv.json"
    with open(FULL, "w") as full:
        r, truth = attach(tmp_path, "--json", out, "--folded", FULL, stdout=full)
    assert_lost(r, "the summary to stdout", FULL)
    assert_matches_truth(json.loads(out.read_text()), truth)


def test_record_to_a_full_disk_stops_at_once(tmp_path):
    """record's trace file is its only output: a failed write ends the
    tracing (and the command it started) then, not when the command ends.
    --repeat 1000000 would run for hours."""
    r = subprocess.run(kvtrace_cmd("record", "-o", FULL, "--", KVSIM, "--workload", "default",
                                   "--repeat", 1000000, "--quiet"),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_lost(r, f"cannot write {FULL}")
    assert "recorded" not in r.stderr


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "swap.kvt"
    r = run_kvtrace("record", "-o", path, "--", KVSIM, "--workload", "swap", "--quiet")
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.parametrize("args,to_stdout", [
    (("export", "--folded", "-o", FULL), False),
    (("export", "--folded"), True),
    (("export", "--folded", "--by", "block"), True),
    (("report",), True),
    (("report", "--format", "json"), True),
    (("report", "--format", "csv"), True),
])
def test_offline_commands_to_a_full_disk(recording, args, to_stdout):
    with open(FULL, "w") as full:
        r = subprocess.run(kvtrace_cmd(*args, recording), cwd=ROOT, text=True, timeout=120,
                           stdout=full if to_stdout else subprocess.PIPE, stderr=subprocess.PIPE)
    assert r.returncode == EXIT_OUTPUT, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == ("kvtrace-bpf: cannot write " + ("to stdout" if args[0] == "report"
                        else "the folded stacks to stdout" if to_stdout else FULL)
                        + ": No space left on device")
