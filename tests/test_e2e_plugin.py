"""The plugin tier traced on real vLLM (CPU): `attach -p` finds the kvtrace
plugin's probes in vLLM's engine core beside the stock uprobes in its
worker, and counts what the scheduler did, exactly.

Expected values never come from the tracer (nor from the plugin):

- scripts/vllm-workload.py --record-blocks: every request's block ids per
  group as vLLM's KVCacheManager.free is about to release them, recorded
  in the engine core by the workload's own wrapper;
- the identities of DESIGN.md: a request holds ceil((prompt + generated -
  1) / block_size) blocks when it finishes;
- vLLM's own counters: prefix-cache hits (tokens) and preemptions;
- the other tier: the worker's stock uprobe on cpu_attention_with_kv_cache
  reads the same block tables the plugin's block_table probe passes from the
  scheduler, step for step (docs/tiers.md); and its uprobe on the write op
  writes the slots that step_reqs splits by request.
"""

import collections
import json
import math
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, Tracer, kvtrace_cmd
from rows_replay import assert_rows_equal_tables
from test_e2e_record import report_json
from tracer.trace import tracefile

pytestmark = pytest.mark.vllm

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
BLOCK_SIZE = 32
# six prompts share their first 96 tokens (3 full blocks): with prefix
# caching on, the later ones hit them; --repeat 2 makes hits certain
REQUESTS_PREFIX = "200:4,160:6,130:3,100:8,96:2,250:5"
SHARED = 96
# a 10-block cache (9 usable) for requests that need 8 + 6 + 5 blocks:
# vLLM must preempt
REQUESTS_PREEMPT = "200:40,150:40,120:40"


def trace_run(tmp_path, model, requests, *extra):
    """vLLM with the plugin (installed by make setup), the tracer attached
    to its tree (-p, --json, -o), one round.  Returns (generated, the
    --record-blocks lines, the tracer's JSON, the trace file)."""
    out, log = tmp_path / "generated.json", tmp_path / "vllm.log"
    blocks = tmp_path / "blocks.jsonl"
    argv = [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(model), "--requests", requests,
            "--block-size", str(BLOCK_SIZE), "--out", str(out), "--wait",
            "--record-blocks", str(blocks), *map(str, extra)]
    env = dict(os.environ, VLLM_PLUGINS="kvtrace")  # this plugin, whatever else is there
    with open(log, "w") as f:
        wl = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                              start_new_session=True)
    tracer = None
    try:
        deadline = time.monotonic() + 300
        while f"READY {wl.pid}" not in log.read_text():
            assert wl.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        js, trace = tmp_path / "kv.json", tmp_path / "run.kvt"
        # --verify-rows: the plugin's whole tables too, beside step_rows
        tracer = Tracer("-q", "-p", wl.pid, "--json", js, "-o", trace, "--verify-rows")
        tracer.wait_attached(timeout=180)
        assert "plugin USDT probes" in tracer.early_err, tracer.early_err
        os.kill(wl.pid, signal.SIGUSR1)
        assert wl.wait(300) == 0, log.read_text()[-3000:]
        rc, stdout, err = tracer.finish(timeout=300)
        assert rc == 0 and "target exited" in stdout, err[-3000:]
        generated = json.loads(out.read_text())
        records = [json.loads(line) for line in blocks.read_text().splitlines()]
        return generated, records, json.loads(js.read_text()), trace
    finally:
        if tracer is not None:
            tracer.kill()
        try:
            os.killpg(wl.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wl.wait()


def tiers(doc):
    """(the engine core's process, the worker's): one of each."""
    plugin = [p for p in doc["processes"] if p["tier"] == "plugin"]
    worker = [p for p in doc["processes"] if p["tier"] == "uprobe" and p["groups"]]
    assert len(plugin) == 1 and len(worker) == 1, \
        [(p["pid"], p["comm"], p["tier"]) for p in doc["processes"]]
    return plugin[0], worker[0]


def check_reads_equal(plugin, worker):
    """Two tiers, two processes, one set of reads: the scheduler's block
    tables (plugin) against the attention op's (worker's stock uprobe)."""
    (pg,), (wg,) = plugin["groups"], worker["groups"]
    for key in ("steps", "requests", "tokens", "reads", "distinct", "held_tokens",
                "null_entries", "block_size"):
        assert pg[key] == wg[key], (key, pg[key], wg[key])
    assert pg["reads_per_block"] == wg["reads_per_block"]
    assert pg["reads"] > 0 and pg["layer_calls"] == pg["steps"]  # one call a step
    assert wg["layer_calls"] == wg["steps"] * 2  # the tiny model's two layers


def check_request_access(lc, plugin, worker):
    """What step_reqs attributes to each request adds up to what the
    worker's stock uprobe saw: block by block, its layer 0's slot writes;
    and to the group's reads.  Returns {id: access}."""
    (pg,) = plugin["groups"]
    assert lc["summary"]["access_steps"] == {"steps": pg["steps"], "unmatched": 0}
    written, reads, out = collections.Counter(), 0, {}
    for t in lc["requests"]:
        a = t["access"]
        assert a is not None, t["id"]
        blocks = a["blocks"]  # a list per figure, a place per block
        for b, w, fr, fw in zip(blocks["block"], blocks["tokens_written"],
                                blocks["first_read_s"], blocks["first_write_s"]):
            written[b] += w
            # a block is read at every step that writes it
            assert w == 0 or fr <= fw, (b, w, fr, fw)
        assert a["tokens_written"] == sum(blocks["tokens_written"])
        assert a["block_reads"] == sum(blocks["reads"])
        reads += a["block_reads"]
        out[t["id"]] = a
    layer0 = worker["layers"][0]
    assert +written == dict(map(tuple, layer0["writes"]))
    assert sum(written.values()) == layer0["slots"] > 0
    assert reads == pg["reads"]
    return out


def by_short_id(ids):
    """{LLM.generate's id: vLLM's}: the engine adds a suffix to each id."""
    return {rid.rsplit("-", 1)[0]: rid for rid in ids}


def per_request(plugin):
    reqs = plugin["lifecycle"]["requests"]
    by_id = {r["id"]: r for r in reqs}
    assert len(by_id) == len(reqs)
    return by_id


def test_plugin_tier_prefix_caching(tmp_path, tiny_model, no_leftovers):
    generated, records, doc, trace = trace_run(
        tmp_path, tiny_model, REQUESTS_PREFIX, "--prefix-caching", "on", "--shared-prefix",
        SHARED, "--repeat", 2)
    assert doc["exact"], doc["inexact_reasons"]
    plugin, worker = tiers(doc)
    assert plugin["pid"] != worker["pid"]
    check_reads_equal(plugin, worker)
    # step_rows' deltas, replayed, are the tables vLLM held, step by step
    assert assert_rows_equal_tables(tracefile.load(str(trace)).ops) == plugin["groups"][0]["steps"]

    # every request, by vLLM's id, as the scheduler freed it
    assert not any(r["status"] == "RUNNING" for r in records)  # no preemption here
    held = {r["req"]: r["groups"][0] for r in records}
    assert len(held) == len(records) == len(generated["requests"])
    mine = per_request(plugin)
    assert sorted(mine) == sorted(held)
    bs = generated["block_size"]
    by_short = by_short_id(held)
    for short, req in zip(generated["request_ids"], generated["requests"]):
        r = mine[by_short[short]]
        want = math.ceil((req["prompt_len"] + len(req["generated"]) - 1) / bs)
        assert len(held[by_short[short]]) == want  # the identity holds for vLLM
        b = r["blocks"]
        assert b["alloc"] + b["hit"] == want == b["free"], (short, b)
        assert r["prompt_tokens"] == req["prompt_len"]
        assert r["output_tokens"] == len(req["generated"])
        assert r["finish_ns"] >= r["first_ns"] > 0 and r["preemptions"] == 0
        # its prefix hits: vLLM's own num_cached_tokens for it, whole blocks
        assert b["hit"] * bs == req["num_cached_tokens"], short
    # and in all: vLLM's own counter
    hits = sum(r["blocks"]["hit"] for r in mine.values())
    assert hits * bs == generated["prefix_cache"]["hits"] == \
        sum(req["num_cached_tokens"] for req in generated["requests"]) > 0
    totals = plugin["lifecycle"]["totals"]
    assert totals["hit"] == hits
    # per block: the references requests took are the ones they dropped,
    # and each is a request that held the block when it was freed
    holders = collections.Counter(b for ids in held.values() for b in ids)
    life = {k: dict(map(tuple, v)) for k, v in plugin["lifecycle"]["blocks"].items()}
    taken = collections.Counter(life["alloc"]) + collections.Counter(life["hit"])
    assert dict(taken) == dict(holders) == life["free"]
    # every block hit had been cached before, by the hash vLLM gave it
    assert set(life["hit"]) <= set(life["cache"])
    assert doc["ops"]["request"]["calls"] == doc["ops"]["req_finish"]["calls"] == len(held)

    # the recording: report's lifecycle from the stream agrees with the counts
    lc = report_json(trace)["lifecycle"]
    assert lc["summary"]["blocks"] == {k: totals[k] for k in lc["summary"]["blocks"]}
    # per request, what it wrote and read (step_reqs): the worker's writes
    # and the group's reads, split by request; and vLLM's identities
    access = check_request_access(lc, plugin, worker)
    for short, req in zip(generated["request_ids"], generated["requests"]):
        rid = by_short[short]
        a, hit = access[rid], mine[rid]["blocks"]["hit"]
        prompt, total = req["prompt_len"], req["prompt_len"] + len(req["generated"]) - 1
        # the blocks it computed are those it held past its prefix hits;
        # the last token generated is never written
        blocks = a["blocks"]
        assert [b for b, w in zip(blocks["block"], blocks["tokens_written"]) if w] == \
            held[rid][hit:]
        assert a["tokens_written"] == total - hit * bs
        # one step for the prompt, one per token after the first: each
        # reads ceil(seq_len / block_size) blocks
        assert a["steps"] == len(req["generated"])
        assert a["block_reads"] == sum(math.ceil(n / bs) for n in range(prompt, total + 1))
    assert lc["summary"]["incomplete_events"] == 0
    assert {t["id"] for t in lc["requests"]} == set(held)
    check_miss_causes(lc["misses"], generated, by_short, bs)
    mrc = lc["miss_ratio_curve"]
    # every reference is a hit or a computed-and-cached block; the hits are
    # the observed ones, and a cache as large as the largest distance hits
    # every re-reference
    assert mrc["observed_hits"] == hits
    assert mrc["references"] == totals["hit"] + totals["cache"]
    assert mrc["curve"][-1][1] == (mrc["references"] - mrc["compulsory"]) / mrc["references"]


def check_miss_causes(m, generated, by_short, bs):
    """report's miss causes (docs/misses.md) on REQUESTS_PREFIX run twice,
    from vLLM's num_cached_tokens and the workload's construction: every
    full prompt block is hit (num_cached_tokens) or missed; the cache is
    large enough that nothing is evicted, so no miss is capacity; the
    prompts share SHARED tokens, whole blocks, and are random after, so
    none is below the block or hash domain (no salt). A second-round
    prompt repeats a first-round one, so all it misses was cached (the
    whole-block prompts' last block: vLLM computes the last token); in the
    first round each shared block is computed first once (compulsory) and
    every block past the shared ones is new."""
    assert m["prefix_hashes"] and m["block_size"] == bs
    assert m["removals"]["reasons"]["evicted"] == 0
    got = {r["id"]: r for r in m["requests"]}
    n = len(generated["requests"]) // 2
    shared_compulsory = 0
    for k, (short, req) in enumerate(zip(generated["request_ids"], generated["requests"])):
        r = got[by_short[short]]
        assert r["hit_blocks"] * bs == req["num_cached_tokens"], short
        assert r["hit_blocks"] + len(r["misses"]) == req["prompt_len"] // bs, short
        for x in r["misses"]:
            if k >= n:
                assert x["cause"] == "resident", (short, x)
            elif x["block"] >= SHARED // bs:
                assert x["cause"] == "compulsory", (short, x)
            else:
                assert x["cause"] in ("compulsory", "resident"), (short, x)
                shared_compulsory += x["cause"] == "compulsory"
    assert shared_compulsory == SHARED // bs
    # the whole-block prompts of the second round recompute their last block
    whole = sum(req["prompt_len"] % bs == 0 for req in generated["requests"][n:])
    assert whole > 0 and m["totals"]["resident"]["blocks"] >= whole
    for cause in ("capacity", "below_block", "hash_domain"):
        assert m["totals"][cause]["blocks"] == 0, cause


# four distinct 200-token prompts (7 blocks each with their output), twice,
# through a 16-block cache: the second round's prompts were cached in the
# first and evicted since
REQUESTS_EVICT = "200:4,200:4,200:4,200:4"


def test_plugin_tier_eviction_and_capacity_misses(tmp_path, tiny_model, no_leftovers):
    """A cache too small for the working set, prefix caching on: vLLM
    evicts.  Every evicted block is one that a request had held when vLLM
    freed it (its own record) before the eviction's allocation, and the
    count of evictions is the kernel's.  Round one's prompts are random,
    so its misses are compulsory; round two repeats them, so each of its
    blocks that vLLM did not serve from the cache (num_cached_tokens) is a
    capacity miss (evicted since: for a request of the run) or, behind
    one, resident."""
    generated, records, doc, trace = trace_run(
        tmp_path, tiny_model, REQUESTS_EVICT, "--prefix-caching", "on", "--repeat", 2,
        "--num-gpu-blocks", 16, "--max-model-len", 256)
    assert doc["exact"], doc["inexact_reasons"]
    plugin, _ = tiers(doc)
    totals = plugin["lifecycle"]["totals"]
    assert totals["evict"] > 0, "vLLM evicted no cached block: the cache is too large"
    lc = report_json(trace)["lifecycle"]
    m = lc["misses"]
    bs = generated["block_size"]
    assert m["removals"]["reasons"]["evicted"] == totals["evict"]
    assert m["removals"]["reasons"]["finished"] == totals["free"] == \
        sum(len(r["groups"][0]) for r in records)
    # each eviction's blocks had been held by a request vLLM freed before it
    held = set()
    by_req = {}
    for r in records:
        by_req.setdefault(r["req"], set()).update(r["groups"][0])
    for t in lc["requests"]:
        for _, kind, _, blocks in t["events"]:
            if kind == "free":
                held.update(blocks)
                assert set(blocks) == by_req[t["id"]], t["id"]
            elif kind == "evict":
                assert set(blocks) <= held, (t["id"], blocks)
    by_short = by_short_id({r["req"] for r in records})
    got = {r["id"]: r for r in m["requests"]}
    n = len(generated["requests"]) // 2
    ids = set(by_short.values())
    for k, (short, req) in enumerate(zip(generated["request_ids"], generated["requests"])):
        r = got[by_short[short]]
        assert r["hit_blocks"] * bs == req["num_cached_tokens"], short
        assert r["hit_blocks"] + len(r["misses"]) == req["prompt_len"] // bs, short
        for x in r["misses"]:
            if k < n:
                assert x["cause"] == "compulsory", (short, x)
            else:
                assert x["cause"] in ("capacity", "resident"), (short, x)
                if x["cause"] == "capacity":
                    assert x["evicted_for_id"] in ids, (short, x)
    assert m["totals"]["capacity"]["blocks"] > 0
    assert m["regret"]["blocks"] == m["totals"]["capacity"]["blocks"]


# two prompts of 3 full blocks (and 4 tokens), three times: under salt a,
# salt b, salt a again
REQUESTS_SALT = "100:2,100:2"
SALTS = "a,b,a"


def test_plugin_tier_cache_salt_misses(tmp_path, tiny_model, no_leftovers):
    """The same prompts under another cache_salt share no block (vLLM hashes
    the salt into a prompt's first block, and every block's hash chains on
    it): the second batch misses everything vLLM's own num_cached_tokens
    says it missed, and each of those misses is hash_domain (the same
    tokens, cached under other hash inputs); the first batch's are
    compulsory, and the third, under the first salt again, hits every full
    block."""
    generated, records, doc, trace = trace_run(
        tmp_path, tiny_model, REQUESTS_SALT, "--prefix-caching", "on", "--repeat", 3,
        "--cache-salts", SALTS)
    assert doc["exact"], doc["inexact_reasons"]
    m = report_json(trace)["lifecycle"]["misses"]
    bs = generated["block_size"]
    by_short = by_short_id({r["req"] for r in records})
    got = {r["id"]: r for r in m["requests"]}
    n = len(REQUESTS_SALT.split(","))
    assert len(generated["requests"]) == 3 * n
    for k, (short, req) in enumerate(zip(generated["request_ids"], generated["requests"])):
        r = got[by_short[short]]
        full = req["prompt_len"] // bs
        assert r["hit_blocks"] * bs == req["num_cached_tokens"], short
        # vLLM's own: nothing cached for the first two batches, all for the third
        assert req["num_cached_tokens"] == (0 if k < 2 * n else full * bs), (k, req)
        want = ["compulsory"] * full if k < n else ["hash_domain"] * full if k < 2 * n else []
        assert [x["cause"] for x in r["misses"]] == want, (k, r["misses"])
    assert m["totals"]["hash_domain"]["blocks"] == n * 3


def test_plugin_tier_preemption(tmp_path, tiny_model, no_leftovers):
    generated, records, doc, trace = trace_run(
        tmp_path, tiny_model, REQUESTS_PREEMPT, "--num-gpu-blocks", 10, "--max-model-len", 256)
    assert doc["exact"], doc["inexact_reasons"]
    plugin, worker = tiers(doc)
    # recomputation included, the two tiers saw the same reads
    check_reads_equal(plugin, worker)
    assert assert_rows_equal_tables(tracefile.load(str(trace)).ops) == plugin["groups"][0]["steps"]
    mine = per_request(plugin)
    preempted = collections.Counter(r["req"] for r in records if r["status"] != "FINISHED_LENGTH_CAPPED")
    assert generated["preemptions"] > 0  # vLLM's own counter: the cache was too small
    assert sum(r["preemptions"] for r in mine.values()) == generated["preemptions"] == \
        doc["ops"]["req_preempt"]["calls"] == sum(preempted.values())
    freed = collections.Counter()
    for rec in records:
        freed[rec["req"]] += len(rec["groups"][0])
    for rid, r in mine.items():
        assert r["preemptions"] == preempted[rid]
        assert r["blocks"]["free"] == freed[rid]
        assert r["blocks"]["alloc"] + r["blocks"]["hit"] == r["blocks"]["free"]
    # the tokens a preempted request lost are what it had computed when
    # the scheduler freed its blocks for the preemption
    lost = sum(rec["num_computed_tokens"] for rec in records
               if rec["status"] != "FINISHED_LENGTH_CAPPED")
    assert sum(r["recomputed"] for r in mine.values()) == lost > 0

    # per request, what it wrote and read, recomputation included: a
    # preempted request writes its lost tokens again
    access = check_request_access(report_json(trace)["lifecycle"], plugin, worker)
    by_short = by_short_id(mine)
    for short, req in zip(generated["request_ids"], generated["requests"]):
        rid = by_short[short]
        lost = sum(rec["num_computed_tokens"] for rec in records
                   if rec["req"] == rid and rec["status"] != "FINISHED_LENGTH_CAPPED")
        # less what a prefix hit gave back (its own blocks, still cached)
        hit = mine[rid]["blocks"]["hit"] * generated["block_size"]
        want = req["prompt_len"] + len(req["generated"]) - 1 + lost - hit
        assert access[rid]["tokens_written"] == want, (rid, lost, hit)


# -- what the plugin tells the tracer (docs/plugin.md, "What the tracer is told") --

LOOP = ROOT / "tests" / "vllm_scheduler_loop.py"


class SchedulerLoop:
    """vLLM's real scheduler, no model, stepping in a loop with the plugin
    loaded (tests/vllm_scheduler_loop.py), as a process to trace."""

    def __init__(self, model, *args):
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(LOOP), "--model", str(model),
                                      *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.out = []
        for line in self.proc.stdout:
            self.out.append(line)
            if line.startswith("READY"):
                self.pid = int(line.split()[1])
                return
        raise AssertionError("the scheduler loop ended early:\n" + "".join(self.out)[-3000:])

    def stop(self):
        out, _ = self.proc.communicate("", timeout=120)
        return "".join(self.out) + out


def doctor_checks(pid):
    r = subprocess.run([*kvtrace_cmd("doctor", "-p", pid)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r, [line for line in r.stdout.splitlines() if "vLLM plugin" in line]


def test_an_untested_release_is_traced_and_labelled(tmp_path, tiny_model, no_leftovers):
    """The plugin on a release outside the tested matrix: `doctor -p` says
    so in one line, `attach` says so in one line and traces the plugin's
    events, and its exactness verdict names the release."""
    loop = SchedulerLoop(tiny_model, "--version", "0.99.1")
    tracer = None
    try:
        r, lines = doctor_checks(loop.pid)
        assert len(lines) == 1, r.stdout
        assert lines[0].startswith("WARN  vLLM plugin") and \
            f"pid {loop.pid}" in lines[0] and "untested vLLM release 0.99.1" in lines[0], r.stdout

        js = tmp_path / "agg.json"
        tracer = Tracer("-q", "-p", loop.pid, "-d", 4, "--json", js)
        rc, _out, err = tracer.finish()
        assert rc == 0, err
        said = [line for line in err.splitlines() if "kvtrace vLLM plugin" in line]
        assert said == [f"kvtrace-bpf: pid {loop.pid} (python): kvtrace vLLM plugin: "
                        "untested vLLM release 0.99.1"], err
        doc = json.loads(js.read_text())
        proc = next(p for p in doc["processes"] if p["pid"] == loop.pid)
        assert proc["tier"] == "plugin" and proc["plugin_status"] == "untested vLLM release 0.99.1"
        assert f"pid {loop.pid}: plugin tier on an untested vLLM release 0.99.1" in \
            doc["inexact_reasons"]
        assert not doc["exact"]
        # traced for real: the scheduler's allocations and steps were counted
        assert doc["ops"]["block_alloc"]["calls"] > 0 and doc["ops"]["step_rows"]["calls"] > 0
        # no --verify-rows: the plugin's whole tables are not attached
        assert not {"block_table", "step_reqs"} & {op for op, st in doc["ops"].items()
                                                    if st["calls"]}, doc["ops"]
    finally:
        if tracer is not None:
            tracer.kill()
        loop.stop()


def test_a_refused_layout_says_what_is_missing(tmp_path, tiny_model, no_leftovers):
    """A vLLM whose BlockPool lacks a method the hooks need: the plugin
    installs nothing, and `doctor -p` and `attach` each give its reason in
    one line."""
    loop = SchedulerLoop(tiny_model, "--remove", "BlockPool._maybe_evict_cached_block")
    tracer = None
    try:
        why = ("refused vLLM release 0.32.0: BlockPool._maybe_evict_cached_block is missing")
        r, lines = doctor_checks(loop.pid)
        assert len(lines) == 1, r.stdout
        assert lines[0].startswith("WARN  vLLM plugin") and why in lines[0], r.stdout

        tracer = Tracer("-q", "-p", loop.pid, "-d", 3)
        rc, _out, err = tracer.finish()
        said = [line for line in err.splitlines() if "kvtrace vLLM plugin" in line]
        assert said == [f"kvtrace-bpf: pid {loop.pid} (python): kvtrace vLLM plugin: {why}"], err
        assert "Traceback" not in err
    finally:
        if tracer is not None:
            tracer.kill()
        out = loop.stop()
    assert "a hook failed" not in out
