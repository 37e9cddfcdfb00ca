"""Reads derived from row events (tracer/analysis/derived_rows.py) on real
traces: kvsim fires step_rows from its scheduler's books and block_table
from its attention op, so one trace holds both.  The derived reads, from
step_rows and the block events alone, must equal kvsim's own count of what
attention read (its C bookkeeping, tests/target/kvsim.c write_reads), and,
step by step and row by row, the tables the BPF program streamed."""

import pytest

from conftest import dense, trace_stream
from tracer.analysis import access_stream, derived_rows
from tracer.trace import stream

pytestmark = pytest.mark.usefixtures("no_leftovers")


def derived_and_counted(ops, truth):
    (d,) = derived_rows.replay_all(stream.step_rows(ops), derived_rows.row_events(ops))
    want = truth["reads"]
    group = {"pid": d.pid, "group_id": want["group_id"], "block_size": want["block_size"]}
    (st,) = access_stream.steps_of(ops, [group])
    rows = access_stream.rows_of(ops, st)
    return d, st, rows


def assert_derived_equal_truth(d, truth):
    want, n = truth["reads"], truth["num_blocks"]
    assert d.exact, d.reasons
    assert (d.block_size, d.num_blocks) == (want["block_size"], n)
    got = {"steps": len(d), "requests": int(d.rows.sum()), "tokens": int(d.tokens.sum()),
           "reads": int(d.reads.sum()), "distinct": int(d.distinct.sum()),
           "held_tokens": int(d.held_tokens.sum())}
    assert got == {k: want[k] for k in got}
    assert d.out_of_range == 0
    per_block = [(b, int(c)) for b, c in enumerate(d.reads_per_block.tolist()) if c]
    last = [(b, int(c)) for b, c in enumerate(d.last_read_step.tolist()) if c]
    assert dense(per_block, n) == dense(want["per_block"], n)
    assert dense(last, n) == dense(want["last_step"], n)


@pytest.mark.parametrize("workload", ["default", "prefix", "window", "swap"])
def test_derived_reads_equal_kvsims_truth_and_its_tables(tmp_path, workload):
    """Plain decoding, prefix hits (shared blocks), a sliding window
    (entries nulled by block_free) and swap preemption (rows sent whole
    again): the reads per block, the last read step, and every step's
    rows, reads, working set and tokens held."""
    ops, _raw, truth = trace_stream(tmp_path, workload)
    d, st, rows = derived_and_counted(ops, truth)
    assert_derived_equal_truth(d, truth)
    v = derived_rows.verify(d, d._t["pos"], st, rows, rows.scan())
    assert (v["steps"], v["rows"]) == (len(st), truth["reads"]["requests"])
    assert (v["steps_differ"], v["rows_differ"], v["blocks_differ"], v["unmatched"]) == \
        (0, 0, 0, 0), v["first"]
    if workload == "window":
        assert truth["window_drops"] > 0
    if workload == "swap":
        assert truth["preemptions"] > 0
    # the live path, fed the same ops in batches of about a fifth
    live = derived_rows.LiveRows()
    o = ops.ops
    cut = len(o) // 5 + 1
    for a in range(0, len(o), cut):
        live.add(ops.select(slice(a, a + cut)))
    (g,) = live.snapshot()
    assert (g["steps"], g["reads"], g["distinct"], g["held_tokens"]) == \
        (len(d), int(d.reads.sum()), int(d.distinct.sum()), int(d.held_tokens.sum()))
    assert g["reads_per_block"][:len(d.reads_per_block)].tolist() == d.reads_per_block.tolist()


def test_derived_reads_of_a_production_sized_cache(tmp_path):
    """kvsim --workload prod: 131,072 blocks, 80 layers, 1,024 requests
    sharing a prefix, a sliding window and a preemption every other step:
    the derived reads equal kvsim's count, and the tables, step by step."""
    ops, _raw, truth = trace_stream(tmp_path, "prod", perf_pages=1024)
    d, st, rows = derived_and_counted(ops, truth)
    assert truth["num_blocks"] == 131_072 and truth["preemptions"] > 0
    assert truth["window_drops"] > 0 and truth["prefix_hits"] > 0
    assert_derived_equal_truth(d, truth)
    v = derived_rows.verify(d, d._t["pos"], st, rows, rows.scan())
    assert (v["steps_differ"], v["rows_differ"], v["blocks_differ"], v["unmatched"]) == \
        (0, 0, 0, 0), v["first"]
    assert int(d.rows.max()) == 1024 and v["steps"] == len(st) > 0


def test_a_tracer_attached_mid_run_gets_every_row_whole_first(tmp_path):
    """A tracer that attaches while kvsim runs knows no row from before: the
    first step_rows it sees sends every row from 0 (kvsim, as the plugin,
    starts its rows over after a step no tracer saw), so the replay is exact
    from there and equals the tables step by step."""
    import time
    from conftest import Kvsim
    from tracer.probes import discover
    from tracer.kernel.session import Tracer

    sim = Kvsim(tmp_path, "prefix", "--repeat", 1000, "--step-delay-us", 2000)
    tracer = None
    try:
        tracer = Tracer(index_stream=True)  # compiled before kvsim goes
        sim.go()
        time.sleep(0.5)  # steps no tracer sees (checked below from the truth)
        tracer.attach(sim.pid, discover.process_probe_files(sim.pid))
        batches = []
        for _ in range(20):  # about a second of traced steps
            tracer.poll(50)
            batches.append(tracer.stream.take())
        assert sim.stop() == 0
        tracer.detach()
        tracer.drain()
        batches.append(tracer.stream.take())
    finally:
        if tracer is not None:
            tracer.close()
        sim.kill()
    ops, truth = stream.decode(batches), sim.truth()
    sr = stream.step_rows(ops)
    d, st, rows = derived_and_counted(ops, truth)
    assert 0 < len(d) < truth["reads"]["steps"], "not attached mid-run"
    first = sr.tail_from[int(sr.lo[0]):int(sr.lo[1])]
    assert len(first) and not first.any(), first
    assert d.exact, d.reasons
    v = derived_rows.verify(d, d._t["pos"], st, rows, rows.scan())
    assert v["steps"] == len(st) and v["rows"] > 0
    assert (v["steps_differ"], v["rows_differ"], v["blocks_differ"], v["unmatched"]) == \
        (0, 0, 0, 0), v["first"]


@pytest.mark.parametrize("workload", ["prefix", "window", "swap"])
def test_plain_attach_shows_the_derived_reads(tmp_path, workload):
    """Plain `attach` (no -o, no --prometheus) on a target whose reads only
    step_rows carries (kvsim --no-block-table: its attention fires no
    block_table, as the plugin's scheduler fires none without
    --verify-rows): the summary and --json, the aggregate every view draws,
    hold the reads kvsim counted, per block and per step; not an empty
    reads panel beside its writes."""
    import json
    from conftest import KVSIM, run_kvtrace
    out, truth_path = tmp_path / "agg.json", tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", workload,
                    "--no-block-table", "--truth", truth_path, "--quiet")
    assert r.returncode == 0, r.stderr
    doc, truth = json.loads(out.read_text()), json.loads(truth_path.read_text())
    want, n = truth["reads"], truth["num_blocks"]
    (proc,) = doc["processes"]
    assert proc["tier"] == "plugin" and "block_table" not in proc["ops"]
    (got,) = proc["groups"]
    # (step_rows names the scheduler's KV-cache group, as the block events do)
    assert (got["group_id"], got["block_size"]) == \
        (truth["lifecycle"]["group_id"], want["block_size"])
    for k in ("steps", "requests", "tokens", "reads", "distinct", "held_tokens"):
        assert got[k] == want[k], k
    assert dense(got["reads_per_block"], n) == dense(want["per_block"], n)
    assert dense(got["last_read_step"], n) == dense(want["last_step"], n)
    assert doc["exact"], doc["inexact_reasons"]
    assert f"{want['reads']:,} block reads" in r.stdout
    if workload == "window":
        assert truth["window_drops"] > 0
    if workload == "swap":
        assert truth["preemptions"] > 0


@pytest.mark.parametrize("workload", ["prefix", "window", "swap"])
def test_report_from_derived_reads_alone(tmp_path, workload, monkeypatch):
    """A recording's report where the group's tables are left out (as
    without --verify-rows): its reads come from step_rows and the block
    events alone, and every access figure, the read heatmap's blocks and every
    request's access equal the report from the tables, and kvsim's count."""
    import numpy as np
    from test_e2e_record import record
    from tracer.analysis import report
    from tracer.trace import tracefile
    trace, truth = record(tmp_path, workload)
    counted = report.Report(tracefile.load(str(trace)))
    monkeypatch.setattr(tracefile.Trace, "groups", property(lambda self: []))
    derived = report.Report(tracefile.load(str(trace)))
    (dr,) = derived.derived_check
    assert dr["used"] and dr["exact"] and dr["verified"] is None
    (cr,) = counted.derived_check
    assert not cr["used"] and cr["verified"]["rows_differ"] == 0
    (a,), (b,) = report.access_figures(counted), report.access_figures(derived)
    # (but the layers, which the plugin's group has not, and what is timed:
    # a derived step's time is its step_rows op's, the scheduler's, before
    # the step's writes and the table's op)
    layered = ("group_id", "layers", "reads_all_layers", "layers_note", "age_s_at_end",
               "idle_before_reuse_s")
    assert {k: v for k, v in a.items() if k not in layered} == \
        {k: v for k, v in b.items() if k not in layered}
    reads = truth["reads"]
    assert (b["steps"], b["reads"], b["distinct"], b["held_tokens"]) == \
        (reads["steps"], reads["reads"], reads["distinct"], reads["held_tokens"])
    assert b["prefix_reuse"]["blocks"] == truth["prefix_hits"]
    assert derived.reasons == counted.reasons
    h1, h2 = counted.heatmap(9, 31, kind="reads"), derived.heatmap(9, 31, kind="reads")
    # (per block: a derived step's time is the scheduler's, so a step near
    # a row's edge may fall in the row before)
    assert np.array_equal(h1.cells.sum(axis=0), h2.cells.sum(axis=0))
    assert h2.cells.sum() == reads["reads"]
    ra, sa = report.report_request_access(counted)
    rb, sb = report.report_request_access(derived)
    assert sorted(ra) == sorted(rb) and len(ra) == truth["requests"]
    for req, fa in ra.items():
        fb = rb[req]
        assert (fa["steps"], fa["tokens_written"], fa["block_reads"]) == \
            (fb["steps"], fb["tokens_written"], fb["block_reads"]), req
        for col in ("block", "tokens_written", "reads"):
            assert np.array_equal(fa["blocks"][col], fb["blocks"][col]), (req, col)
        for col in ("first_write_s", "last_write_s", "first_read_s", "last_read_s"):
            # the same steps, at the derived step's time
            assert np.array_equal(np.isnan(fa["blocks"][col]), np.isnan(fb["blocks"][col]))


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["preemption", "prefix_chunked"])
def test_vllm_derived_reads_equal_its_tables_and_the_worker(tmp_path, tiny_model, no_leftovers,
                                                           case):
    """Real vLLM on the CPU with the plugin, its whole tables attached
    beside step_rows: the rows kept from step_rows and the block events
    equal the tables the scheduler held, step by step and row by row; and
    the reads derived from them equal what the worker's stock uprobe
    counted on the attention op, another process reading its own tables.
    Preemption (a 10-block cache), and prefix caching with chunked prefill
    (a 96-token step budget)."""
    from test_e2e_plugin import REQUESTS_PREEMPT, REQUESTS_PREFIX, SHARED, tiers, trace_run
    import numpy as np
    from tracer.analysis import report
    from tracer.trace import tracefile
    extra = ("--num-gpu-blocks", 10, "--max-model-len", 256) if case == "preemption" else \
        ("--prefix-caching", "on", "--shared-prefix", SHARED, "--max-num-batched-tokens", 96)
    requests = REQUESTS_PREEMPT if case == "preemption" else REQUESTS_PREFIX
    generated, _records, doc, trace = trace_run(tmp_path, tiny_model, requests, *extra)
    plugin, worker = tiers(doc)
    rep = report.Report(tracefile.load(str(trace)))
    (check,) = rep.derived_check
    (d,) = rep.derived
    if case == "preemption":
        assert generated["preemptions"] > 0
    else:  # some prompt prefilled in chunks of at most 96 tokens, over several steps
        new, req = d._t["new"], d._t["rq"]
        assert new.max() <= 96
        assert max(np.bincount(req[new > 1])) > 1
    assert check["pid"] == plugin["pid"] and check["exact"] and not check["used"]
    v = check["verified"]
    assert v["steps"] == plugin["groups"][0]["steps"] == len(d) > 0
    assert (v["steps_differ"], v["rows_differ"], v["blocks_differ"], v["unmatched"]) == \
        (0, 0, 0, 0), v["first"]
    (wg,) = worker["groups"]
    assert (len(d), int(d.rows.sum()), int(d.tokens.sum()), int(d.reads.sum()),
            int(d.distinct.sum()), int(d.held_tokens.sum())) == \
        (wg["steps"], wg["requests"], wg["tokens"], wg["reads"], wg["distinct"],
         wg["held_tokens"])
    assert [[b, int(n)] for b, n in enumerate(d.reads_per_block.tolist()) if n] == \
        wg["reads_per_block"]
