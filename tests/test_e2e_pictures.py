"""report --html/--svg/--png and two recordings side by side (docs/pictures.md):
real BPF, real kvsim recordings, the page opened in real headless Chromium
(tests/browser.py), and every figure's numbers checked against kvsim's own
ground truth (--truth), never against the tracer's code."""

import argparse
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from browser import open_page
from conftest import KVSIM, ROOT, WRITE_OPS, assert_one_line_error, dense, run_kvtrace
from tracer.analysis import lifecycle
from tracer.commands import pictures
from tracer.exporters import figures

pytestmark = pytest.mark.usefixtures("no_leftovers")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(tmp, workload, *extra, name=None):
    name = name or workload
    trace, truth = tmp / f"{name}.kvt", tmp / f"{name}.truth.json"
    r = run_kvtrace("record", "-o", trace, "--", KVSIM, "--workload", workload,
                    "--truth", truth, "--quiet", *extra)
    assert r.returncode == 0, r.stderr
    return trace, json.loads(truth.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """kvsim's prefix workload (reads, prefix hits, the plugin tier) and its
    swap workload (preemptions, swaps), recorded, with their truths; and
    the prefix workload at vLLM 0.34's default block size, 64."""
    tmp = tmp_path_factory.mktemp("pics")
    out = {w: record(tmp, w) for w in ("prefix", "swap")}
    out["prefix-64"] = record(tmp, "prefix", "--block-size", "64", name="prefix-64")
    return out


def docs_of(*paths):
    args = argparse.Namespace(partial=False, pid=None, layer=0)
    labels = pictures.labels_of([str(p) for p in paths])
    return [(label, pictures.document_of(str(p), label, args))
            for p, label in zip(paths, labels)]


def by_name(runs_):
    out = {}
    for f in figures.figures(runs_):
        f.close()
        out[f.name] = f
    return out


def assert_opens_clean(page, shot, want_drawn=()):
    """The page in Chromium: a screenshot, no console message or error, no
    request but its own (inline data: images are no request over a network),
    and every figure present, sized and with content."""
    got = open_page(page, shot)
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 10_000
    assert got["console"] == [] and got["errors"] == [], (got["console"], got["errors"])
    assert [u for u in got["requests"] if not u.startswith("data:")] == []
    assert [f["id"] for f in got["figures"]] == list(figures.NAMES)
    for f in got["figures"]:
        assert f["width"] > 100 and f["height"] > 50 and f["text"] > 50, f
        if f["missing"] == "no":
            assert f["svg"] and f["shapes"] > 10, f
        else:
            assert not f["svg"], f
    drawn = {f["id"] for f in got["figures"] if f["missing"] == "no"}
    assert set(want_drawn) <= drawn, drawn
    return got


def assert_self_contained(page):
    text = page.read_text()
    assert "<script" not in text.lower()
    # every src/href inside the page: a fragment or inline data, nothing fetched
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text)
    assert all(r.startswith(("#", "data:")) for r in refs), [r[:40] for r in refs]
    assert "@import" not in text and "url(http" not in text


def test_the_page_opens_in_chromium(runs, tmp_path):
    trace, _ = runs["prefix"]
    page = tmp_path / "report.html"
    r = run_kvtrace("report", trace, "--html", page, timeout=300)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert_self_contained(page)
    assert oct(page.stat().st_mode & 0o777) == "0o600"
    assert_opens_clean(page, tmp_path / "shot.png", want_drawn=(
        "heatmap_writes", "heatmap_reads", "fill", "utilization_over_time",
        "access_frequency", "working_set", "residency", "request_timeline", "flame_graph"))


def test_svg_and_png_files_one_per_figure(runs, tmp_path):
    trace, _ = runs["swap"]
    r = run_kvtrace("report", trace, "--svg", tmp_path / "svg", "--png", tmp_path / "png",
                    timeout=300)
    assert r.returncode == 0, r.stderr
    for name in figures.NAMES:
        svg = tmp_path / "svg" / f"{name}.svg"
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg") and len(list(root.iter())) > 10, name
        assert (tmp_path / "png" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)


def residency_buckets(ns):
    """vLLM's buckets of kvsim's residency times, counted here: a sample in
    the first bound it does not exceed, +Inf last."""
    bounds = np.asarray(lifecycle.RESIDENCY_BUCKETS, np.float64)
    idx = np.searchsorted(bounds, np.asarray(ns, np.float64) / 1e9, side="left")
    return np.bincount(idx, minlength=len(bounds) + 1)


@pytest.mark.parametrize("workload", ["prefix", "swap", "prefix-64"])
def test_every_figure_agrees_with_kvsim(runs, workload):
    trace, truth = runs[workload]
    (label, doc), = docs_of(trace)
    f = by_name([(label, doc)])
    n, bs = truth["num_blocks"], truth["block_size"]
    assert bs == (64 if workload.endswith("-64") else 16)
    # the heatmaps' cells sum to kvsim's slot writes and block reads
    assert f["heatmap_writes"].data[label]["total"] == truth["slots_written"]
    assert f["heatmap_reads"].data[label]["total"] == truth["reads"]["reads"]
    # access frequency: reads per block are kvsim's, the histogram's reads
    # and blocks sum to its reads and the blocks it read
    acc = f["access_frequency"].data[label]
    want = np.asarray(dense(truth["reads"]["per_block"], n))
    assert acc["reads_per_block"][:n].tolist() == want.tolist()
    assert int(acc["reads"].sum()) == acc["total_reads"] == truth["reads"]["reads"]
    assert int(acc["blocks"].sum()) == acc["blocks_read"] == int(np.count_nonzero(want))
    hot = np.sort(want[want > 0])[::-1]
    assert acc["hottest_10pct"] == pytest.approx(
        hot[:max(1, round(0.1 * len(hot)))].sum() / hot.sum())
    # fill: generations by tokens held at their end, as kvsim counted them
    fill = f["fill"].data[label]
    assert len(fill["fill_hist"]) == bs + 1  # 0 to the target's block size
    assert fill["fill_hist"].tolist() == np.bincount(
        truth["generations"]["fill"], minlength=bs + 1).tolist()
    # the working set: kvsim's distinct blocks at each step
    (ws,) = f["working_set"].data[label]
    assert ws["steps"] == truth["reads"]["steps"] and ws["steps"] <= figures.MAX_POINTS
    assert int(round(ws["distinct"].sum())) == truth["reads"]["distinct"]
    # residency, in vLLM's buckets, from kvsim's own times
    res = f["residency"].data[label]
    for key in ("lifetime", "idle_before_evict", "reuse_gap"):
        got = res[key]["counts"]
        assert got.tolist() == residency_buckets(
            truth["lifecycle"]["residency"][f"{key}_ns"]).tolist(), key
    # the timeline: every request, its preemptions and prefix hits marked
    tl = f["request_timeline"].data[label]
    assert tl["requests"] == len(truth["lifecycle"]["requests"])
    shown = tl["shown"]
    assert len(shown) == min(figures.TIMELINE_REQUESTS, tl["requests"])
    if tl["requests"] <= figures.TIMELINE_REQUESTS:
        assert sum(len(r["marks"].get("preempt", [])) for r in shown) == truth["preemptions"]
        assert sum(r["blocks"] for r in shown) == \
            truth["lifecycle"]["totals"]["alloc"] + truth["lifecycle"]["totals"]["hit"]
    # the flame graph weighs every slot written and block pair (or batch
    # entry) moved, as export --folded does
    assert f["flame_graph"].data[label]["total"] == sum(
        o["slots"] if op in WRITE_OPS else o["pairs"] for op, o in truth["ops"].items())


def test_two_recordings_side_by_side(runs, tmp_path):
    (a, ta), (b, tb) = runs["prefix"], runs["swap"]
    page = tmp_path / "cmp.html"
    r = run_kvtrace("report", a, b, "--html", page, timeout=300)
    assert r.returncode == 0, r.stderr
    # the terminal's table: both runs, and b - a
    lines = r.stdout.splitlines()
    assert "prefix.kvt" in r.stdout and "swap.kvt" in r.stdout and "difference" in r.stdout
    row = next(l for l in lines if l.strip().startswith("slot writes"))
    want = [f"{ta['slots_written']:,}", f"{tb['slots_written']:,}",
            f"{tb['slots_written'] - ta['slots_written']:+,}"]
    assert row.split()[-4:-1] == want, row
    assert_opens_clean(page, tmp_path / "cmp.png")
    text = page.read_text()
    assert text.count("prefix.kvt") >= 2 and text.count("swap.kvt") >= 2
    # every figure drawn from both, each run's numbers its own truth's
    f = by_name(docs_of(a, b))
    for label, truth in (("prefix.kvt", ta), ("swap.kvt", tb)):
        assert f["heatmap_writes"].data[label]["total"] == truth["slots_written"]
        assert f["access_frequency"].data[label]["total_reads"] == truth["reads"]["reads"]


def test_two_recordings_without_pictures_print_the_table(runs):
    (a, ta), (b, tb) = runs["prefix"], runs["swap"]
    r = run_kvtrace("report", a, b)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    row = next(l for l in r.stdout.splitlines() if l.strip().startswith("block reads"))
    assert row.split()[2:4] == [f"{ta['reads']['reads']:,}", f"{tb['reads']['reads']:,}"]


def test_several_processes(tmp_path):
    trace = tmp_path / "two.kvt"
    r = run_kvtrace("record", "-o", trace, "--", "bash", "-c",
                    f"{KVSIM} --workload prefix --repeat 20 --step-delay-us 2000 --quiet & "
                    f"{KVSIM} --workload default --repeat 20 --step-delay-us 2000 --quiet; wait")
    assert r.returncode == 0, r.stderr
    (label, doc), = docs_of(trace)
    pids = {p["pid"] for p in doc["blocks"]["processes"] if p["layers"]}
    if len(pids) < 2:
        pytest.fail(f"one kvsim was not traced: {pids}")
    f = by_name([(label, doc)])
    assert set(f["fill"].data[label]["pids"]) == pids
    assert {s["pid"] for s in doc["steps"]} == pids
    page = tmp_path / "two.html"
    r = run_kvtrace("report", trace, "--html", page, timeout=300)
    assert r.returncode == 0, r.stderr
    assert_opens_clean(page, tmp_path / "two.png", want_drawn=("heatmap_writes", "fill"))


def test_a_recording_without_reads_says_so_in_place(tmp_path):
    """tests/data/before-reads.kvt: recorded before the read probe existed."""
    page = tmp_path / "noreads.html"
    r = run_kvtrace("report", ROOT / "tests/data/before-reads.kvt", "--html", page,
                    timeout=300)
    assert r.returncode == 0, r.stderr
    got = assert_opens_clean(page, tmp_path / "noreads.png", want_drawn=("heatmap_writes",))
    missing = {f["id"] for f in got["figures"] if f["missing"] == "yes"}
    assert {"heatmap_reads", "access_frequency", "working_set",
            "utilization_over_time"} <= missing
    assert "no block reads in this recording" in page.read_text()


def test_a_damaged_recording_fails_in_one_line_or_renders_with_partial(runs, tmp_path):
    trace, _ = runs["prefix"]
    cut = tmp_path / "cut.kvt"
    data = trace.read_bytes()
    cut.write_bytes(data[:len(data) * 2 // 3])
    page = tmp_path / "cut.html"
    assert_one_line_error(run_kvtrace("report", cut, "--html", page), 4, "truncated")
    assert not page.exists()
    r = run_kvtrace("report", cut, "--partial", "--html", page, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--partial" in r.stderr or "using those" in r.stderr
    assert_opens_clean(page, tmp_path / "cut.png")


@pytest.mark.parametrize("args,words", [
    (("a.kvt", "b.kvt", "c.kvt"), ("at most two",)),
    (("X", "--html", "/nonexistent/dir/r.html"), ("cannot write", "no such directory")),
    (("X", "--html", "r.html", "--format", "json"), ("--html",)),
    (("X", "--png", "/proc/version/figs"), ("--png",)),
])
def test_user_mistakes_are_one_line(runs, tmp_path, args, words):
    trace, _ = runs["prefix"]
    args = [str(trace) if a == "X" else a for a in args]
    args = [tmp_path / a if a == "r.html" else a for a in args]
    assert_one_line_error(run_kvtrace("report", *args), 1, *words)


@pytest.mark.vllm
def test_make_findings(tmp_path):
    """`make findings` as the README says, for one of its five workloads
    (FINDINGS_RUNS=preempt: each is a real vLLM run of a minute or more):
    the recording, its page, and the figures docs/findings.md shows of it.
    vLLM's own preemption counter is the truth that the workload preempts."""
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(["make", "-s", "findings", f"FINDINGS_OUT={out}",
                        f"FINDINGS_WORK={work}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200, env={**os.environ, "FINDINGS_RUNS": "preempt",
                                          "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for fig in ("fill", "access_frequency", "request_timeline", "heatmap_writes"):
        assert (out / f"preempt-{fig}.png").read_bytes().startswith(PNG_MAGIC), fig
    generated = json.loads((work / "preempt.out.json").read_text())
    assert generated["preemptions"] > 0
    doc = json.loads((work / "preempt.json").read_text())
    preempts = sum(e[1] == "preempt" for q in doc["lifecycle"]["requests"] for e in q["events"])
    assert preempts == generated["preemptions"]
    assert_opens_clean(work / "preempt.html", tmp_path / "shot.png", want_drawn=(
        "heatmap_writes", "heatmap_reads", "fill", "access_frequency", "request_timeline"))


def test_the_browser_sees_what_a_page_must_not_do(tmp_path):
    """The checks above can fail: a page that logs an error, throws and
    asks for a file over the network is caught by each."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><figure id='x'><h2>x</h2></figure>"
                   "<img src='http://127.0.0.1:9/x.png'>"
                   "<script>console.error('boom'); undefined_function();</script>"
                   "</body></html>")
    got = open_page(bad, tmp_path / "bad.png")
    assert (tmp_path / "bad.png").read_bytes().startswith(PNG_MAGIC)
    assert any(c.get("type") == "error" for c in got["console"]), got["console"]
    assert any("exceptionDetails" in c for c in got["console"]), got["console"]
    assert "http://127.0.0.1:9/x.png" in got["requests"]
    assert [f["id"] for f in got["figures"]] == ["x"]
