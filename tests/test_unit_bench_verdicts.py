"""bench/run.py's verdicts on its goals, from made-up results (pure logic).

A verdict is "met" or "MISSED" on the median, and "(unresolved)" when the
median's 95% interval holds the goal's edge or when the A/A control beside
it (the same code against itself) does not resolve 1%: a machine whose
control spreads 5% cannot say whether a site costs 1%."""

import importlib.util

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def ratio(median, lo, hi):
    return {"min": lo, "median": median, "max": hi, "n": 9, "values": [median],
            "ci95": [lo, hi]}


def read_site_verdict(b_over_a, control):
    one = {"min": 1.0, "median": 1.0, "max": 1.0, "n": 1, "values": [1.0]}
    res = {"reads": {"a_ns_per_op": one, "b_ns_per_op": one, "c_ns_per_op": one,
                     "b_over_a": b_over_a, "a_again_over_a": control,
                     "attached_ns_per_op": one, "attached_ns_per_entry": one,
                     "counts_equal_truth": True}}
    [row] = [r for r in bench.table_rows(res) if r[0] == "8 read site b/a (1 entry)"]
    return row[-1]


@pytest.mark.parametrize("b_over_a, control, verdict", [
    (ratio(1.002, 0.998, 1.006), ratio(1.0, 0.996, 1.004), "met"),
    (ratio(1.05, 1.03, 1.07), ratio(1.0, 0.996, 1.004), "MISSED"),
    # the interval holds the goal's edge
    (ratio(1.005, 0.995, 1.02), ratio(1.0, 0.996, 1.004), "met (unresolved)"),
    # a tight b/a beside a control that spreads past 1%: no verdict either way
    (ratio(0.85, 0.80, 0.90), ratio(1.0, 0.96, 1.05), "met (unresolved)"),
    (ratio(1.09, 1.05, 1.11), ratio(1.0, 0.99, 1.011), "MISSED (unresolved)"),
    # no control (results from before it): nothing says what noise gives
    (ratio(1.09, 1.05, 1.11), None, "MISSED (unresolved)"),
])
def test_a_verdict_is_unresolved_where_its_control_does_not_resolve_1pc(b_over_a, control,
                                                                        verdict):
    assert read_site_verdict(b_over_a, control) == verdict


def test_the_control_and_its_interval_are_rows_of_their_own():
    res = {"reads": {k: {"min": 1, "median": 1, "max": 1, "n": 1, "values": [1]} for k in
                     ("a_ns_per_op", "b_ns_per_op", "c_ns_per_op", "attached_ns_per_op",
                      "attached_ns_per_entry")}}
    res["reads"].update(b_over_a=ratio(1.0, 0.99, 1.01), a_again_over_a=ratio(1.0, 0.97, 1.04),
                        counts_equal_truth=True)
    rows = {r[0]: r for r in bench.table_rows(res)}
    control = rows["8 read site (a) again/(a), A/A control"]
    assert control[-2] == "1: what noise alone gives" and control[-1] == ""
    assert [r[1] for r in bench.table_rows(res) if "CI of the median" in r[0]] == \
        ["0.990", "0.970"]


def test_every_control_must_resolve_1pc():
    """Row 1's b/a at 1 slot has two controls: separate processes of one
    build (a again) and layout (two identical ops in one process)."""
    tight, wide = ratio(1.0, 0.995, 1.005), ratio(0.83, 0.70, 1.41)
    assert bench.resolves_1pc(tight, tight)
    assert not bench.resolves_1pc(tight, wide)
    assert not bench.resolves_1pc(ratio(1.0, 0.985, 1.004))
    # an absent control resolves nothing (results from before it)
    assert not bench.resolves_1pc(None, tight)
    assert not bench.resolves_1pc({"median": 1.0})  # a control without its interval
    assert bench.resolves_1pc()  # a figure that is no ratio against a 1% goal


def vllm_verdict(counts):
    tight = ratio(1.0, 0.996, 1.004)
    s = {k: {"min": 1, "median": 1, "max": 1, "n": 1, "values": [1]} for k in
         ("untraced_tokens_per_s", "full_tokens_per_s", "calls_only_tokens_per_s",
          "full_tracer_cpu_s_per_s", "calls_only_tracer_cpu_s_per_s")}
    s.update(full_ratio=ratio(0.999, 0.995, 1.0), calls_only_ratio=ratio(0.999, 0.995, 1.0),
             untraced_again_ratio=tight)
    if counts is not None:
        s["traced_counts"] = counts
    rows = {r[0]: r for r in bench.table_rows({"vllm": s})}
    return rows["3 vLLM full/untraced"][-1], rows["3 vLLM calls-only/untraced"][-1]


@pytest.mark.parametrize("counts, verdicts", [
    ({"full": [(120, 900), (118, 880)], "calls_only": [(119, 0), (120, 0)]},
     ("met", "no verdict: no proof it traced")),  # calls-only read no slot: not traced
    ({"full": [(120, 900), (0, 0)], "calls_only": [(1, 1)]},
     ("no verdict: no proof it traced", "met")),  # one full measurement counted nothing
    (None, ("no verdict: no proof it traced",) * 2),  # results without counts
])
def test_a_traced_ratio_needs_proof_that_it_traced(counts, verdicts):
    assert vllm_verdict(counts) == verdicts


def plugin_rows(control, counts):
    s = {"hook_ns": {"a": 100.0}, "semaphore_read_ns": 20.0,
         "untraced_ratio": ratio(1.0, 0.995, 1.005), "traced_ratio": ratio(0.99, 0.98, 1.0),
         "traced_counts": counts}
    if control is not None:
        s["untraced_again_ratio"] = control
    return {r[0]: r for r in bench.table_rows({"plugin": s})}


def test_the_plugin_row_is_judged_beside_its_a_a_control():
    rows = plugin_rows(ratio(1.0, 0.997, 1.004), {"block_table": 40, "request": 8})
    assert rows["10 vLLM tokens/s, plugin / none, untraced"][-1] == "met"
    assert rows["10 vLLM tokens/s, none / none (A/A control)"][-2] == "1: what noise alone gives"
    assert rows["10 traced batches counted plugin ops (proof it traced)"][2] == "yes"
    # two engines that spread 5% against each other resolve no 1% goal
    rows = plugin_rows(ratio(1.0, 0.95, 1.05), {"block_table": 0})
    assert rows["10 vLLM tokens/s, plugin / none, untraced"][-1] == "met (unresolved)"
    assert rows["10 traced batches counted plugin ops (proof it traced)"][2] == "NO"
    # results from before the control: no verdict resolved
    rows = plugin_rows(None, {})
    assert rows["10 vLLM tokens/s, plugin / none, untraced"][-1] == "met (unresolved)"
    assert "10 vLLM tokens/s, none / none (A/A control)" not in rows


def sched_scale(added, counts, control):
    one = {"min": 1, "median": 1, "max": 1, "n": 1, "values": [1]}
    return {"requests": 256, "entries_per_step": one, "untraced_us": one, "traced_us": one,
            "added_us": added, "untraced_again_added_us": one, "traced_ratio": one,
            "untraced_again_ratio": control, "added_ns_per_request": one,
            "traced_counts": counts, "trace_bytes_per_decode_step": 100.0,
            "recorded_steps": 60, "report_s": 1.0}


@pytest.mark.parametrize("added, counts, control, verdict", [
    (ratio(30, 20, 40), [(20, 500_000)] * 3, ratio(1.0, 0.995, 1.005), "met"),
    (ratio(300, 250, 350), [(20, 500_000)] * 3, ratio(1.0, 0.995, 1.005), "MISSED"),
    # the interval holds 50 us
    (ratio(45, 20, 70), [(20, 500_000)] * 3, ratio(1.0, 0.995, 1.005), "met (unresolved)"),
    # the control spreads past 1%
    (ratio(30, 20, 40), [(20, 500_000)] * 3, ratio(1.0, 0.97, 1.03), "met (unresolved)"),
    # one traced measurement counted no step: it did not trace
    (ratio(30, 20, 40), [(20, 500_000), (0, 0)], ratio(1.0, 0.995, 1.005),
     "no verdict: no proof it traced"),
])
def test_the_scheduler_row_needs_its_proof_and_its_control(added, counts, control, verdict):
    res = {"sched": {"scales": {"25k": sched_scale(added, counts, control)}}}
    rows = {r[0]: r for r in bench.table_rows(res)}
    assert rows["12 25k: 256 req, tracing adds a step"][-1] == verdict


def grid_rows(traced, skipped=None):
    grid = {size: {"untraced": {"tables_us": 10.0, "deltas_us": 5.0}} for size in
            ("8x4", "64x64", "256x128", "256x512", "1024x256")}
    for size, (tables, deltas) in traced.items():
        grid[size]["traced"] = {"tables_us": tables, "deltas_us": deltas}
    return {r[0]: r for r in bench.table_rows({"plugin_grid": {"grid": grid,
                                                               "traced_skipped": skipped}})}


def test_the_plugin_grid_is_judged_on_the_row_changes_262k_against_4k():
    rows = grid_rows({"64x64": (70.0, 10.0), "1024x256": (5000.0, 15.0)})
    assert rows["13 traced step_rows: 262k entries / 4k"][2] == "1.500"
    assert rows["13 traced step_rows: 262k entries / 4k"][-1] == "met"
    assert rows["13 traced block_table: 262k entries / 4k"][-1] == ""  # no goal
    assert rows["13 1024x256 traced, step_rows, a request"][2] == "14.65"  # 15 us / 1024
    rows = grid_rows({"64x64": (70.0, 10.0), "1024x256": (5000.0, 35.0)})
    assert rows["13 traced step_rows: 262k entries / 4k"][-1] == "MISSED"
    # no tracer attached: untraced figures only, no verdict
    rows = grid_rows({}, skipped="not root")
    assert "13 traced step_rows: 262k entries / 4k" not in rows
    assert rows["13 traced"][2] == "skipped: not root"


@pytest.mark.parametrize("counted, verdict", [
    (12, "met"), (0, "no verdict: no proof it traced"), (None, "no verdict: no proof it traced")])
def test_the_site_rows_attached_cost_needs_proof_that_it_traced(counted, verdict):
    """Rows 1 and 8 judge what the attached tracer adds (traced against
    untraced): only where the tracer counted the traced loops' ops (row 1)
    or counted what kvbench passed (row 8)."""
    one = {"min": 1.0, "median": 1.0, "max": 1.0, "n": 1, "values": [1.0]}

    class Figures(dict):  # every figure of the row 1, one value each
        def __missing__(self, key):
            return one

    site = Figures(big_slots=4096)
    if counted is not None:
        site["traced_calls_counted"] = counted
    reads = {k: one for k in ("a_ns_per_op", "b_ns_per_op", "c_ns_per_op", "b_over_a",
                              "attached_ns_per_op", "attached_ns_per_entry")}
    reads["counts_equal_truth"] = bool(counted)
    rows = {r[0]: r[-1] for r in bench.table_rows({"site": site, "reads": reads})}
    assert rows["1 attached adds, per op"] == verdict
    assert rows["1 attached adds, per slot"] == verdict
    assert rows["8 read attached adds, per entry"] == verdict
