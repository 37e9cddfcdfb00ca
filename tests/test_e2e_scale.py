"""Production sizes with the default limits: a cache of 131,072 blocks, 80
layers and 16 traced processes, each exact against kvsim's own truth.  No
--max-blocks, --max-layers or --max-procs anywhere: the defaults must hold
them (bpf/kvtrace.h KVTRACE_MAX_*, docs/design.md "Sized for the largest
single-GPU caches")."""

import json

import pytest

from conftest import (KVSIM, Kvsim, assert_matches_truth, assert_reads_match_truth,
                      run_kvtrace)
from tracer import abi

pytestmark = pytest.mark.usefixtures("no_leftovers")

PRODUCTION_BLOCKS = 131072  # an H200's cache of an 8B model, rounded up
PRODUCTION_LAYERS = 80  # a 70B-class model's layers on one GPU
PRODUCTION_PROCS = 16  # 8 engines and their workers


def test_the_defaults_hold_production_sizes():
    assert abi.DEFAULT_MAX_BLOCKS >= PRODUCTION_BLOCKS
    assert abi.DEFAULT_MAX_CACHES >= PRODUCTION_LAYERS
    assert abi.DEFAULT_MAX_PROCS >= PRODUCTION_PROCS


def test_131072_blocks_exact_by_default(tmp_path):
    """kvsim's stress workload over a pool of 131,072 blocks: its FIFO free
    list hands out blocks in order, so the run reaches far past the first
    32,768 (checked on the truth), and every count is still exact."""
    out, truth_path = tmp_path / "agg.json", tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", "stress",
                    "--blocks", PRODUCTION_BLOCKS, "--truth", truth_path, "--quiet",
                    timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    truth = json.loads(truth_path.read_text())
    assert truth["num_blocks"] == PRODUCTION_BLOCKS
    highest = max(b for layer in truth["layers"]
                  for b, n in enumerate(layer["writes"]) if n)
    assert highest >= 32768, highest  # the workload reaches deep into the pool
    assert max(b for b, _ in truth["reads"]["per_block"]) >= 32768
    assert doc["max_blocks"] >= PRODUCTION_BLOCKS
    assert_matches_truth(doc, truth)
    assert_reads_match_truth(doc, truth)


def test_production_workload_exact_by_default(tmp_path):
    """kvsim's production-sized workload: 131,072 blocks, 80 layers, 1,024
    requests sharing a prefix, a sliding window and swap preemptions, every
    count exact against its truth with no limit flag."""
    out, truth_path = tmp_path / "agg.json", tmp_path / "truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", "prod",
                    "--truth", truth_path, "--quiet", timeout=900)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    truth = json.loads(truth_path.read_text())
    assert (truth["num_blocks"], truth["num_layers"]) == (PRODUCTION_BLOCKS,
                                                          PRODUCTION_LAYERS)
    assert truth["reads"]["requests"] >= 1024
    assert_matches_truth(doc, truth)
    assert_reads_match_truth(doc, truth)


def test_16_processes_of_80_layers_in_all_exact_by_default(tmp_path):
    """16 kvsim processes under one tracer, 5 layers each: 80 caches, every
    row its own process's truth.  The tracer is the one attach loads, at
    its default sizes, attached to each paused kvsim before it runs."""
    from tracer.commands.attach import _aggregate
    from tracer.kernel.session import Tracer
    from tracer.probes import discover

    per_proc = PRODUCTION_LAYERS // PRODUCTION_PROCS
    sims, tracer = [], None
    try:
        for _ in range(PRODUCTION_PROCS):
            sims.append(Kvsim(tmp_path, "default", "--layers", per_proc))
        tracer = Tracer()
        for sim in sims:
            assert tracer.attach(sim.pid, discover.process_probe_files(sim.pid, stock=False))
        for sim in sims:
            sim.go()
        for sim in sims:
            assert sim.wait(timeout=300) == 0
        tracer.detach()
        tracer.drain()
        raw = tracer.read_maps()
        doc = _aggregate(tracer, raw).to_json(max_blocks=tracer.max_blocks,
                                              max_layers=tracer.max_caches)
    finally:
        if tracer is not None:
            tracer.close()
        for sim in sims:
            sim.kill()
    assert doc["exact"] is True, doc["inexact_reasons"]
    assert len(doc["processes"]) == PRODUCTION_PROCS
    assert sum(len(p["layers"]) for p in doc["processes"]) == PRODUCTION_LAYERS
    by_pid = {p["pid"]: p for p in doc["processes"]}
    for sim in sims:
        truth = sim.truth()
        assert truth["num_layers"] == per_proc
        proc = by_pid[sim.pid]
        # one process's figures, as attach's --json gives them for one
        one = dict(doc, processes=[proc], ops=proc["ops"])
        assert_matches_truth(one, truth)
        assert_reads_match_truth(one, truth)
