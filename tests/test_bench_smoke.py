"""`make bench` runs and writes well-formed results (the quick variant).

A smoke test, not a benchmark: no figure is compared with a goal or with
another figure here.  What it does check beside the shape of the results are
the properties that hold at any speed: the exact counters (writes, and the
read site's) equal the driver's and kvsim's own ground truth at every rate,
and every per-op record is either delivered or counted lost."""

import json
import math
import subprocess
import sys

from conftest import ROOT


def check_stats(s, where):
    assert s is not None, where
    assert s["n"] >= 1 and len(s["values"]) == s["n"], where
    assert all(math.isfinite(v) for v in s["values"]), where
    assert s["min"] <= s["median"] <= s["max"], where


def test_quick_bench_writes_well_formed_results(tmp_path, bpf_env, no_leftovers):
    subprocess.run(["make", "-s", "-C", ROOT / "bench"], check=True)
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, ROOT / "bench" / "run.py", "--quick", "--out", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["schema"] == "kvtrace-bpf/bench" and res["quick"] is True

    site = res["site"]
    for key in ("a_ns_per_op", "b_ns_per_op", "c_ns_per_op", "a_ns_per_slot",
                "c_ns_per_slot", "b_over_a", "c_over_a", "attached_ns_per_op",
                "attached_ns_per_slot", "e_entry_emulated_ns_per_op",
                "f_entry_single_stepped_ns_per_op", "g_entry_picked_ns_per_op"):
        check_stats(site[key], f"site.{key}")
    assert site["traced_calls_counted"] > 0
    # the controls beside b/a, the cold runs (every op after its caches and
    # TLB were evicted), and what the detached site adds to the op, read
    # from its instructions: a semaphore test on the path, the probe's
    # block out of line, so at most a load, a test and a branch
    for key in ("a_again_over_a", "a_again_over_a_big", "twins_ratio", "a_cold_ns_per_op",
                "c_cold_ns_per_op", "d_cold_ns_per_op", "bpf_run_time_cold_ns_per_op"):
        check_stats(site[key], f"site.{key}")
    for key in ("b_over_a", "a_again_over_a"):
        lo, hi = site[key]["ci95"]
        assert lo <= site[key]["median"] <= hi, key
    added = site["site_instructions"]
    assert 1 <= len(added["on_path"]) <= 3, added
    assert "nop" in added["out_of_line"], added  # the USDT site itself

    reads = res["reads"]  # row 8: the read site, its counts against kvbench's own
    for key in ("a_ns_per_op", "b_ns_per_op", "c_ns_per_op", "b_over_a",
                "attached_ns_per_op", "attached_ns_per_entry"):
        check_stats(reads[key], f"reads.{key}")
    assert reads["passed"]["calls"] > 0
    assert reads["counted"] == reads["passed"], (reads["counted"], reads["passed"])
    assert not any(reads["not_counted"].values()), reads["not_counted"]
    events = res["events"]  # row 8 too: a block event's site, its counts likewise
    for key in ("a_ns_per_op", "b_ns_per_op", "c_ns_per_op", "b_over_a",
                "attached_ns_per_op", "attached_ns_per_id"):
        check_stats(events[key], f"events.{key}")
    assert events["passed"]["calls"] > 0 and events["passed"]["items"] > events["passed"]["calls"]
    assert (events["counted"]["calls"], events["counted"]["items"], events["counted"]["valid"]) \
        == (events["passed"]["calls"], events["passed"]["items"], events["passed"]["items"])
    assert not any(events["not_counted"].values()), events["not_counted"]

    stress = res["stress"]
    for key in ("untraced_slots_per_s", "traced_slots_per_s", "ratio", "records", "lost"):
        check_stats(stress[key], f"stress.{key}")
    assert stress["counts_equal_truth"] is True
    for key in ("cpu_s_per_s", "rss_mb_during", "peak_rss_mb"):
        check_stats(res["footprint"][key], f"footprint.{key}")

    assert "skipped" in res["vllm"]  # --quick leaves vLLM out

    steps = res["capacity"]["steps"]
    assert steps
    for key, step in steps.items():
        assert set(step) == {"perf/1", "perf/64", "perf/fill", "ring/adaptive", "ring/64"}
        for transport, figures in step.items():
            where = f"capacity {key} {transport}"
            check_stats(figures["offered_slots_per_s"], where)
            check_stats(figures["records_per_s"], where)
            assert figures["exact"] is True, where
            assert figures["records_plus_lost_equal_ops"] is True, where

    for kind in ("compiled", "cached"):
        for key in ("live_s", "ready_s", "program_s", "detach_s"):
            check_stats(res["attach"][f"{kind}_{key}"], f"attach.{kind}_{key}")

    # record, report and export all exist here: a skipped row (record failed)
    # is a failure of this test, never a pass without the checks
    offline = res["offline"]
    assert "skipped" not in offline, offline["skipped"]
    for key in ("report", "report_text", "export"):
        check_stats(offline[key], f"offline.{key}")
        for cost in ("user_s", "sys_s", "peak_rss_mb"):
            check_stats(offline[f"{key}_{cost}"], f"offline.{key}_{cost}")
        assert offline[f"{key}_peak_rss_mb"]["min"] > 0
    touch = offline["first_touch"]
    check_stats(touch["us_per_page"], "offline.first_touch")
    assert touch["us_per_page"]["min"] > 0 and touch["us_per_page"]["n"] == touch["gib"]

    prom = res["prometheus"]  # row 9: the tracer's CPU with --prometheus
    for key in ("quiet", "prometheus", "prometheus_scraped"):
        check_stats(prom[f"{key}_tracer_cpu_s_per_s"], f"prometheus.{key}")
    assert prom["scrapes"]["min"] >= 1  # the scraped runs were scraped

    # row 10: each plugin hook's cost with no tracer, measured in vLLM's python
    plugin = res["plugin"]
    assert "skipped" not in plugin, plugin.get("skipped")
    assert len(plugin["hook_ns"]) == 11 and all(isinstance(v, float)
                                                  for v in plugin["hook_ns"].values())
    assert plugin["semaphore_read_ns"] > 0 and "skipped" in plugin["vllm"]

    # row 11: the tracer's memory at its default (production) sizes, over
    # one small kvsim with --quick: the maps are the limits' size, the RSS
    # holds the rows in use, and the counts are exact
    mem = res["memory"]
    assert "skipped" not in mem, mem.get("skipped")
    assert (mem["max_blocks"], mem["max_layers"], mem["max_procs"]) >= (131072, 80, 16)
    # the per-block rows alone: writes per layer, moves and lifecycle per process
    assert mem["map_bytes"] >= 8 * 131072 * (80 + 16 * 9)
    assert 0 < mem["rss_loaded_mb"] <= mem["rss_peak_mb"]
    assert mem["exact"] is True and mem["status"] == [0]

    # row 12 starts vLLM's scheduler: left out with --quick
    assert "skipped" in res["sched"]
    # row 13: the plugin's step at each table size, whole tables and row
    # changes, untraced at least (traced where the tracer attached)
    grid = res["plugin_grid"]
    assert "skipped" not in grid, grid.get("skipped")
    assert set(grid["grid"]) == {"8x4", "64x64", "256x128", "256x512", "1024x256"}
    for size, modes in grid["grid"].items():
        assert modes["untraced"]["tables_us"] > 0 and modes["untraced"]["deltas_us"] > 0, size
        assert ("traced" in modes) == (grid["traced_skipped"] is None), size

    # row 14: the node agent with one engine (--quick): its CPU while it
    # traced and was scraped, its heap, and the maps its limits fix
    (agent,) = res["agent"]["engines"]
    assert agent["engines"] == 1 and agent["scrapes"] >= 1
    assert agent["agent_cpu_s_per_s"] > 0 and agent["agent_rss_anon_mb"] > 0
    assert agent["bpf_maps_mb"] >= 8 * 131072 * 80 / 2**20  # the write counters alone

    # the printed table is the same data, one line per figure
    lines = r.stdout.splitlines()[2:]  # after the header and its rule
    assert len(lines) == len(res["table"])
    for line, row in zip(lines, res["table"]):
        assert line.startswith(row["figure"]), (line, row)
