"""Why the prefix cache missed, traced end to end: real BPF on kvsim's
evicting prefix cache (--workload evict, tests/target/kvsim_evict.c),
whose truth classifies every prompt block a request computed from its
pool's own state and the prompts' tokens (never from hashes): report's
miss classes, removal reasons and regret must be exactly that truth."""

import json
import subprocess

import pytest

import copy

from conftest import KVSIM, Kvsim, Tracer, read_line, run_kvtrace
from test_e2e_prometheus import free_port, promtool_check, scrape, value
from test_e2e_record import report_json
from tracer.analysis import invariants, misses

# a seed whose requests miss in every way (the truth is checked for it)
SEED = "2"
# the target's block size: kvsim's 16, and vLLM 0.34's default of 64 (a
# seed of its own whose requests miss in every way at that size too)
SIZES = [pytest.param((), SEED, id="16"),
         pytest.param(("--block-size", "64"), "5", id="64")]


def evict_truth(tmp_path, *extra, seed=SEED):
    path = tmp_path / "truth.json"
    r = subprocess.run([KVSIM, "--workload", "evict", "--seed", seed, "--truth", path,
                        "--quiet", *extra], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(path.read_text())


@pytest.mark.parametrize("size,seed", SIZES)
def test_evict_truth_agrees_with_itself(tmp_path, size, seed):
    """The truth adds up, and the workload does what it is for: every class
    of miss, evictions, a prefix shorter than a block, two salts."""
    t = evict_truth(tmp_path, *size, seed=seed)
    assert t["block_size"] == (int(size[1]) if size else 16)
    assert all(t["totals"][c]["blocks"] > 0 for c in misses.CAUSES), t["totals"]
    per = {c: [0, 0] for c in misses.CAUSES}
    for r in t["requests"]:
        assert [m["block"] for m in r["misses"]] == \
            list(range(r["hit_blocks"], r["hit_blocks"] + len(r["misses"])))
        assert r["hit_blocks"] + len(r["misses"]) == r["prompt_tokens"] // t["block_size"]
        for m in r["misses"]:
            per[m["cause"]][0] += 1
            per[m["cause"]][1] += m["tokens"]
            assert (m["evicted_for"] is not None) == (m["cause"] == "capacity")
            if m["cause"] == "below_block":
                assert 0 < m["tokens"] < t["block_size"]
                assert m["tokens"] % t["tokens_per_hash"] == 0
    assert per == {c: [v["blocks"], v["tokens"]] for c, v in t["totals"].items()}
    assert {r["salt"] for r in t["requests"]} == {0, 1}
    assert t["removals"]["evicted"] > 0 and t["regret"]["blocks"] == \
        t["totals"]["capacity"]["blocks"]
    assert sum(r["hit_blocks"] for r in t["requests"]) == t["hits"] > 0


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("size,seed", SIZES)
def test_report_miss_causes_match_truth(tmp_path, size, seed):
    """Every class, removal and regret at the target's block size: at 64,
    below_block's tokens are counted to a hash every 4 tokens (64 / 16)."""
    trace, truth_path = tmp_path / "run.kvt", tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "-o", trace, "--", KVSIM, "--workload", "evict",
                    "--seed", seed, *size, "--truth", truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    truth = json.loads(truth_path.read_text())
    doc = report_json(trace)
    m = doc["lifecycle"]["misses"]
    assert m["block_size"] == truth["block_size"] == (int(size[1]) if size else 16)
    assert m["prefix_hashes"]
    assert m["totals"] == truth["totals"]
    got = {r["id"]: r for r in m["requests"]}
    # a prompt shorter than a block has no prompt block to judge: the report
    # lists the requests with one (at 64, kvsim's short prompts have none)
    judged = [w for w in truth["requests"] if w["prompt_tokens"] >= truth["block_size"]]
    assert all(w["hit_blocks"] == 0 and not w["misses"] for w in truth["requests"]
               if w not in judged)
    # at 16 every prompt fills a block; at 64 some do not (the case runs)
    assert (len(judged) < len(truth["requests"])) == bool(size)
    assert sorted(got) == sorted(w["id"] for w in judged)
    for w in judged:
        g = got[w["id"]]
        assert (g["req"], g["prompt_tokens"], g["hit_blocks"]) == \
            (w["req"], w["prompt_tokens"], w["hit_blocks"]), w["id"]
        assert [(x["block"], x["cause"], x["tokens"], x.get("evicted_for_id") or None)
                for x in g["misses"]] == \
            [(x["block"], x["cause"], x["tokens"], x["evicted_for"]) for x in w["misses"]], \
            w["id"]
    rem = m["removals"]["reasons"]
    assert rem == {"finished": truth["removals"]["finished"], "preempted": 0, "window": 0,
                   "evicted": truth["removals"]["evicted"], "reset": 0}
    assert m["regret"]["blocks"] == truth["regret"]["blocks"]
    assert m["regret"]["tokens"] == truth["totals"]["capacity"]["tokens"]
    # beside the LRU curve, the optimal one: never below it, at every size
    lru = doc["lifecycle"]["miss_ratio_curve"]["curve"]
    opt = m["optimal_curve"]
    assert [c for c, _ in opt] == [c for c, _ in lru]
    assert all(o >= h for (_, h), (_, o) in zip(lru, opt))
    # report --check's miss_causes holds here, and fails where the document
    # is broken as an analysis slip would break it: one miss counted under
    # another cause than its total's, one removal without a reason, the
    # optimal curve below LRU's
    r = run_kvtrace("report", trace, "--check")
    assert r.returncode == 0 and "ok   miss_causes: " in r.stdout, r.stdout + r.stderr
    for breaking in ("cause", "removal", "optimal"):
        bad = copy.deepcopy(doc)
        bm = bad["lifecycle"]["misses"]
        if breaking == "cause":
            x = next(x for r in bm["requests"] for x in r["misses"]
                     if x["cause"] == "capacity")
            x["cause"] = "compulsory"
        elif breaking == "removal":
            bm["removals"]["reasons"]["finished"] -= 1
        else:
            bm["optimal_curve"][-1][1] = lru[-1][1] - 0.01
        assert [n for n, _ in invariants.failures(bad)] == ["miss_causes"], breaking


@pytest.mark.usefixtures("no_leftovers")
def test_prometheus_serves_the_miss_classes_live(tmp_path):
    """attach --prometheus (no -o: the block ids' stream alone, hashes and
    prefix_hashes with it) serves kvtrace_prefix_misses_total and
    kvtrace_prefix_miss_tokens_total per cause, kvsim's truth exactly once
    it exited (--prometheus-linger: the whole run)."""
    port = free_port()
    sim = Kvsim(tmp_path, "evict", "--seed", SEED)
    tracer = None
    try:
        tracer = Tracer("-q", "-p", sim.pid, "-i", 600, "--prometheus", port,
                        "--prometheus-linger", 120)
        tracer.wait_attached()
        sim.go()
        assert sim.wait() == 0
        read_line(tracer.proc.stderr, "serving the final metrics", 60)
        m, text = scrape(port)
        truth = sim.truth()
        for cause, t in truth["totals"].items():
            assert value(m, "kvtrace_prefix_misses_total", pid=sim.pid, cause=cause) == \
                t["blocks"], cause
            assert value(m, "kvtrace_prefix_miss_tokens_total", pid=sim.pid, cause=cause) == \
                t["tokens"], cause
        promtool_check(text)
        rc, _, err = tracer.finish(timeout=60)
        assert rc == 0, err
    finally:
        if tracer is not None:
            tracer.kill()
        sim.kill()
