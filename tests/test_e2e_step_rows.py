"""step_rows, the plugin tier's default reads (bpf/kvtrace_probes.h): each
step's rows sent as deltas, kept by replaying them with the block frees,
equal kvsim's own rows at every step.

kvsim fires step_rows from its scheduler's books (tests/target/kvsim.c
fire_step_rows()) and writes the rows its sequences hold, step by step
(--truth-rows): the truth, independent of the tracer.  The BPF program
streams the op (rows, then the tails' int32 in 8-byte words);
tracer/trace/stream.py decodes it; tests/rows_replay.py replays it."""

import json

import pytest

from conftest import trace_stream
from rows_replay import replay

pytestmark = pytest.mark.usefixtures("no_leftovers")


def truth_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_against_truth(tmp_path, workload, *extra, perf_pages=256):
    rows_path = tmp_path / f"{workload}.rows.jsonl"
    ops, raw, truth = trace_stream(tmp_path, workload, "--truth-rows", rows_path, *extra,
                                   perf_pages=perf_pages)
    want = truth_rows(rows_path)
    got = replay(ops)
    assert len(got) == len(want) == truth["steps"] > 0
    for (pid, group, rows), step in zip(got, want):
        assert group == 0
        # (req, seq_len, new_tokens, row) as kvsim's sequences hold them
        assert [(r[0], r[1], r[2], r[4]) for r in rows] == \
            [(req, seq, new, row) for req, seq, new, row in step["rows"]], step["step"]
    return got, truth


@pytest.mark.parametrize("workload", ["default", "prefix", "window", "swap"])
def test_rows_kept_from_deltas_equal_kvsims_rows(tmp_path, workload):
    """Prefix hits (rows starting with shared blocks), a sliding window
    (entries nulled by their block_free), swap preemption (a row sent whole
    again after its blocks moved) and plain decoding."""
    got, truth = check_against_truth(tmp_path, workload)
    if workload == "window":
        assert truth["window_drops"] > 0
        assert any(0 in r[4] for _, _, rows in got for r in rows)
    if workload == "swap":
        assert truth["preemptions"] > 0


def test_deltas_carry_only_new_entries(tmp_path):
    """Each op's tails are what the rows gained: over a run, the tail
    entries sent are the rows' final lengths plus what resets sent again,
    far fewer than the tables' entries over all steps."""
    rows_path = tmp_path / "rows.jsonl"
    ops, _raw, _truth = trace_stream(tmp_path, "default", "--truth-rows", rows_path)
    from tracer.trace import stream
    sr = stream.step_rows(ops)
    assert sr.complete.all() and len(sr.pos) > 0
    table_entries = int(sr.row_len.sum())
    assert 0 < len(sr.tail) < table_entries / 4
    # a row's tail starts where its last report ended: no request is sent
    # twice from 0 without a reset in between (default has none)
    first = {}
    for r in range(len(sr.req)):
        req = int(sr.req[r])
        if req in first:
            assert sr.tail_from[r] == first[req], req
        first[req] = int(sr.row_len[r])


def test_production_sized_rows(tmp_path):
    """131,072 blocks, 80 layers, 1,024 requests sharing a prefix, a
    sliding window and preemption (kvsim --workload prod): every step's
    rows, over 130k entries, kept exactly from deltas of a few thousand."""
    got, truth = check_against_truth(tmp_path, "prod", perf_pages=1024)
    assert truth["preemptions"] > 0 and truth["window_drops"] > 0
    assert truth["prefix_hits"] > 0
    assert max(len(rows) for _, _, rows in got) == 1024
    assert max(sum(r[3] for r in rows) for _, _, rows in got) > 130_000
