"""Reads on real vLLM (CPU, stock uprobes): which KV blocks attention reads.

The tracer counts, per KV-cache group and forward step, the blocks that
vLLM's cpu_attention_with_kv_cache reads: the first ceil(seq_len /
block_size) entries of each request's block-table row (docs/access.md).
Expected values never come from the tracer.  They come from:

- the identity (docs/access.md, "Where reads come from in vLLM"): a request
  with prompt P that generates G tokens runs at steps with seq_len P (its
  prefill, when not chunked), then P + 1 .. P + G - 1, and reads
  sum_{s=P}^{P+G-1} ceil(s / block_size) blocks per group; prefix caching
  changes which blocks, not how many;
- scripts/vllm-workload.py --record-reads: the seq_lens and block-table
  rows vLLM's CPU backend passed to the op at every step, recorded inside
  vLLM's worker at the Python level (index tensors only);
- vLLM's own prefix-cache counters (LLM.get_metrics(), in tokens).

Four runs: prefix caching off; on, with a shared prefix; on, with a
conversation whose turns find each other cached; and chunked prefill (a
small step budget splits the identity's first term).  The
recorder is checked against the identity and against what vLLM generated
before anything of the tracer is looked at: that part holds without the
tracer (it runs even if the tracer fails to attach).
Like tests/test_e2e_vllm.py these take a minute or more each.
"""

import collections
import json
import math
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, VLLM_PYTHON, Tracer, make_tiny_model, run_kvtrace

pytestmark = pytest.mark.vllm

WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
BLOCK_SIZE = 32
# three layers, not the default two: layer_calls = steps x layers is then
# not satisfied by accident by a count of 2 per step
LAYERS = 3
NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block

# prefix caching off: lengths straddle block boundaries (32), one request
# spans many blocks, one generates a single token
REQUESTS_OFF = "100:8,40:8,7:3,33:5,64:1,250:12,31:2"
# prefix caching on: six prompts share their first 160 tokens (5 full
# blocks).  --repeat 2: the second pass finds every full block of its prompt
# cached, whatever the first pass's scheduling was, so vLLM's hits are > 0
REQUESTS_ON = "200:4,200:4,200:4,200:4,180:3,170:2"
SHARED_PREFIX = 160


@pytest.fixture(scope="module")
def model(tmp_path_factory, bpf_env):
    return make_tiny_model(tmp_path_factory, "--layers", LAYERS)


class Workload:
    """scripts/vllm-workload.py --wait --record-reads: the engine is built,
    generation waits for SIGUSR1.  Its logs go to a file."""

    def __init__(self, tmp_path, model, requests, *extra):
        self.out = tmp_path / "generated.json"
        self.record = tmp_path / "reads.jsonl"
        self.log = tmp_path / "vllm.log"
        argv = [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(model), "--requests", requests,
                "--block-size", str(BLOCK_SIZE), "--out", str(self.out), "--wait",
                "--record-reads", str(self.record), *map(str, extra)]
        with open(self.log, "w") as log:
            # its own process group: vLLM's engine and worker outlive a
            # killed parent, and a failed test must not leave them behind
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 300
        while f"READY {self.pid}" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError("vLLM did not get ready:\n" + self.log.read_text()[-3000:])
            time.sleep(0.5)

    def go(self):
        os.kill(self.pid, signal.SIGUSR1)

    def result(self, timeout=300):
        assert self.proc.wait(timeout) == 0, self.log.read_text()[-3000:]
        return json.loads(self.out.read_text())

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# -- the recorder's file -----------------------------------------------------

def recorded_steps(path, round_no=1):
    """One round of a --record-reads file: one entry per (step, group) with
    the full record of its first layer and layer_calls = how many layers
    called the op at that step.  Every later layer must have seen exactly
    the same seq_lens and block table (vLLM builds the metadata once per
    group per step), or the once-per-step reading would be wrong."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    marks = [i for i, l in enumerate(lines) if l.get("round") == round_no]
    assert [lines[i]["event"] for i in marks] == ["start", "end"], marks
    start, end = marks
    # nothing ran after the round: the worker wrote each step before its
    # output reached the process that wrote the end marker
    assert not [l for l in lines[end + 1:] if "step" in l]
    steps = {}
    for line in lines[start + 1:end]:
        assert "event" not in line, line
        key = (line["pid"], line["step"], line["group"])
        if key not in steps:
            assert "rows" in line, line
            steps[key] = dict(line, layer_calls=1)
        else:
            assert line["same"] is True, f"layers of step {key} saw different tables: {line}"
            steps[key]["layer_calls"] += 1
    return [steps[k] for k in sorted(steps, key=lambda k: (k[1], -1 if k[2] is None else k[2]))]


def truth_per_group(steps):
    """What the tracer must report per group, computed from the record:
    the schema of the tracer's --json "groups" entries (steps numbered from
    0 at the round's first step)."""
    groups = {}
    for s in steps:
        g = groups.setdefault(s["group"], {
            "block_size": s["block_size"], "num_blocks": s["num_blocks"], "steps": 0,
            "layer_calls": 0, "requests": 0, "tokens": 0, "reads": 0, "distinct": 0,
            "null_entries": 0, "shared": 0, "reads_per_block": collections.Counter(),
            "last_read_step": {}})
        assert (s["block_size"], s["num_blocks"]) == (g["block_size"], g["num_blocks"])
        step = g["steps"]
        g["steps"] += 1
        g["layer_calls"] += s["layer_calls"]
        g["requests"] += len(s["rows"])
        g["tokens"] += sum(s["seq_lens"])
        readers = collections.Counter()
        for row in s["rows"]:
            blocks = [b for b in row if b != NULL_BLOCK]
            g["null_entries"] += len(row) - len(blocks)
            g["reads"] += len(blocks)
            g["reads_per_block"].update(blocks)
            readers.update(set(blocks))
            for b in blocks:
                g["last_read_step"][b] = step
        g["distinct"] += len(readers)
        g["shared"] += sum(1 for n in readers.values() if n > 1)
    return groups


def identity_reads(generated):
    """sum over requests of sum_{s=P}^{P+G-1} ceil(s / block_size)."""
    bs = generated["block_size"]
    return sum(math.ceil(s / bs)
               for r in generated["requests"]
               for s in range(r["prompt_len"], r["prompt_len"] + len(r["generated"])))


def per_request(steps, generated):
    """Each request's steps, [(seq_len, query_len, row)], in the order of
    generated["requests"].  vLLM's engine adds a random suffix to the
    request ids LLM.generate gives out ("3" -> "3-8e0bd607")."""
    seen = collections.defaultdict(list)
    for s in steps:
        assert s["req_ids"] is not None and len(s["req_ids"]) == len(s["rows"])
        for rid, seq_len, qlen, row in zip(s["req_ids"], s["seq_lens"], s["query_lens"],
                                           s["rows"]):
            seen[rid.rsplit("-", 1)[0]].append((seq_len, qlen, row))
    assert sorted(seen) == sorted(generated["request_ids"])
    return [seen[rid] for rid in generated["request_ids"]]


def check_record(steps, generated, chunked=False):
    """The recorder against what vLLM generated and the identity; returns
    the tokens each request found in the prefix cache (its first step's
    seq_len - query_len: vLLM's num_computed_tokens when it was admitted)."""
    bs = generated["block_size"]
    assert steps, "the recorder saw no step"
    assert len({s["pid"] for s in steps}) == 1  # one worker ran the model
    for s in steps:
        # one full-attention group; the table as docs/access.md describes it
        assert s["group"] == 0 and s["block_size"] == bs
        assert s["sliding_window"] == -1 and s["causal"] is True
        assert s["layer_calls"] == generated["num_layers"] == LAYERS
        assert s["table_dtype"] == "torch.int32" and s["seq_lens_dtype"] == "torch.int32"
        n, width = s["table_shape"]
        assert n == len(s["seq_lens"]) == len(s["rows"])
        # a row slice [:num_reqs] of the persistent [max_num_reqs, W] buffer
        assert s["table_contiguous"] and s["table_storage_offset"] == 0
        assert s["table_stride"] == [width, 1]
        assert all(len(row) == math.ceil(sl / bs) <= width
                   for row, sl in zip(s["rows"], s["seq_lens"]))
        # entries past the ones read are the null block: nothing else is
        # allocated to a request beyond its computed + scheduled tokens
        assert s["tail_nonzero"] == [0] * n
    hits = []
    for req, mine in zip(generated["requests"], per_request(steps, generated)):
        plen, gen = req["prompt_len"], len(req["generated"])
        seq = [sl for sl, _, _ in mine]
        # every step computes query_len tokens on top of the cache: seq_len
        # grows by exactly that, and the last step ends at P + G - 1
        first_cached = mine[0][0] - mine[0][1]
        assert first_cached % bs == 0  # hits are whole blocks
        hits.append(first_cached)
        assert [sl - q for sl, q, _ in mine] == [first_cached] + seq[:-1]
        assert seq[-1] == plen + gen - 1
        if not chunked:  # the prefill in one step, then one token a step
            assert seq == list(range(plen, plen + gen)), (req, mine)
        # a request's blocks keep their place in its row from step to step
        for (_, _, a), (_, _, b) in zip(mine, mine[1:]):
            assert b[:len(a)] == a
    if not chunked:
        reads = sum(len([b for b in row if b != NULL_BLOCK]) for s in steps for row in s["rows"])
        assert reads == identity_reads(generated)
    return hits


def check_hits_are_earlier_blocks(steps, generated, hits):
    """The blocks a request found cached (the first hit / block_size entries
    of its first row) are blocks another request's row held before: at an
    earlier step of the round, or in an earlier row of the same step (vLLM
    caches a block's hash when it allocates it).  The prefix reuse the
    tracer can infer is exactly these."""
    bs = generated["block_size"]
    first_row = {}
    seen_before = set()
    for s in steps:
        in_step = set()
        for rid, row, sl, q in zip(s["req_ids"], s["rows"], s["seq_lens"], s["query_lens"]):
            rid = rid.rsplit("-", 1)[0]
            if rid not in first_row:
                first_row[rid] = row
                cached = row[:(sl - q) // bs]
                assert set(cached) <= seen_before | in_step, (rid, cached)
            in_step.update(row)
        seen_before |= in_step
    return sum(len(first_row[rid][:h // bs]) for rid, h in zip(generated["request_ids"], hits))


# -- the tracer's JSON -------------------------------------------------------

def traced_groups(doc, tier="uprobe"):
    """The process of `tier` with read groups: the worker (its stock uprobe
    on the attention op), or the engine core (the plugin's block_table from
    the scheduler; make setup installs the plugin into .venv-vllm)."""
    procs = [p for p in doc["processes"] if p.get("groups") and p["tier"] == tier]
    assert len(procs) == 1, [(p["pid"], p["comm"], p["tier"]) for p in doc["processes"]]
    return procs[0]


def check_tracer(doc, truth, generated):
    """Every figure of the tracer's groups against the record, exactly."""
    assert doc["exact"], doc["inexact_reasons"]
    proc = traced_groups(doc)
    assert proc["pid"] != generated["pid"]  # the worker, a descendant
    assert [g["group"] for g in proc["groups"]] == sorted(truth)
    assert len({g["group_id"] for g in proc["groups"]}) == len(truth)
    for got in proc["groups"]:
        want = truth[got["group"]]
        for key in ("block_size", "num_blocks", "steps", "layer_calls", "requests", "tokens",
                    "reads", "distinct", "null_entries"):
            assert got[key] == want[key], (key, got[key], want[key])
        assert got["layer_calls"] == got["steps"] * generated["num_layers"]
        assert (got["out_of_range"], got["truncated"], got["read_errors"]) == (0, 0, 0)
        assert dict(got["reads_per_block"]) == dict(want["reads_per_block"])
        assert sum(n for _, n in got["reads_per_block"]) == got["reads"]
        # the tracer may number steps from 0 or 1: the same offset for all
        last = dict(got["last_read_step"])
        assert sorted(last) == sorted(want["last_read_step"])
        assert len({last[b] - s for b, s in want["last_read_step"].items()}) == 1
    # the plugin tier, where the scheduler runs, passes the same tables:
    # the same reads from another process, once a step (no layers there)
    plugin = traced_groups(doc, "plugin")
    assert plugin["pid"] != proc["pid"]
    assert [g["group"] for g in plugin["groups"]] == sorted(truth)
    for got in plugin["groups"]:
        want = truth[got["group"]]
        for key in ("block_size", "num_blocks", "steps", "requests", "tokens", "reads",
                    "distinct", "null_entries"):
            assert got[key] == want[key], ("plugin", key, got[key], want[key])
        assert got["layer_calls"] == got["steps"]
        assert dict(got["reads_per_block"]) == dict(want["reads_per_block"])
    return proc["groups"]


def trace_round(tmp_path, model, requests, *extra, trace_file=None):
    """Start the workload, attach the tracer, run one round, stop both.
    Returns (what vLLM generated, the round's recorded steps, the tracer's
    JSON or None, the tracer's failure or None).  trace_file: also record
    the stream there (attach -o)."""
    wl = Workload(tmp_path, model, requests, *extra)
    out_json = tmp_path / "kv.json"
    failure = doc = tracer = None
    try:
        # --verify-rows: the plugin's whole tables, read here as a tier
        tracer = Tracer("-q", "-p", wl.pid, "--json", out_json, "--verify-rows",
                        *(("-o", trace_file) if trace_file else ()))
        try:
            tracer.wait_attached(timeout=180)
        except AssertionError as e:  # checked after the ground truth
            failure, tracer = e, None
        wl.go()
        generated = wl.result()
        if tracer is not None:
            rc, out, err = tracer.finish(timeout=300)  # ends with vLLM
            if rc != 0 or "target exited" not in out:
                failure = AssertionError(f"tracer exit {rc}:\n{err[-3000:]}")
            else:
                doc = json.loads(out_json.read_text())
    finally:
        wl.kill()
        if tracer is not None and tracer.proc.poll() is None:  # vLLM failed first
            tracer.proc.kill()
            tracer.proc.wait()
    return generated, recorded_steps(wl.record), doc, failure


def test_reads_exact_prefix_caching_off(tmp_path, model, no_leftovers):
    """Prefix caching off: the tracer's reads equal the identity and the
    recorder's per-block counts, step for step."""
    generated, steps, doc, failure = trace_round(tmp_path, model, REQUESTS_OFF)
    assert not generated["prefix_caching"]
    hits = check_record(steps, generated)
    assert hits == [0] * len(hits)
    truth = truth_per_group(steps)
    want = identity_reads(generated)
    assert truth[0]["reads"] == want
    # the recorded tokens are the identity's seq_lens, summed
    assert truth[0]["tokens"] == sum(s for r in generated["requests"]
                                     for s in range(r["prompt_len"],
                                                    r["prompt_len"] + len(r["generated"])))
    # without prefix caching no two requests share a block
    assert truth[0]["shared"] == 0 and truth[0]["distinct"] == truth[0]["reads"]
    assert generated["prefix_cache"] == {"unit": "tokens", "queries": 0, "hits": 0}

    if failure is not None:
        raise failure
    (group,) = check_tracer(doc, truth, generated)
    assert group["reads"] == want


def test_reads_exact_prefix_caching_on(tmp_path, model, no_leftovers):
    """Prefix caching on, six prompts with a 160-token shared prefix, the
    batch generated twice: the shared blocks are read by every request that
    holds them, at every step; the reads still follow the identity; vLLM's
    own prefix-cache hits are exactly the cached blocks the rows show."""
    trace_file = tmp_path / "run.kvt"
    generated, steps, doc, failure = trace_round(
        tmp_path, model, REQUESTS_ON, "--prefix-caching", "on",
        "--shared-prefix", SHARED_PREFIX, "--repeat", 2, trace_file=trace_file)
    assert generated["prefix_caching"] and generated["shared_prefix"] == SHARED_PREFIX
    hits = check_record(steps, generated)
    truth = truth_per_group(steps)
    bs = generated["block_size"]
    # vLLM's own counters (tokens): every request looked up once, at
    # admission, for its whole prompt; its hits are what its first step
    # shows as already computed, and those blocks were in earlier rows
    cache = generated["prefix_cache"]
    assert cache["unit"] == "tokens"
    assert cache["queries"] == sum(r["prompt_len"] for r in generated["requests"])
    assert cache["hits"] == sum(hits) > 0
    hit_blocks = check_hits_are_earlier_blocks(steps, generated, hits)
    assert hit_blocks == cache["hits"] // bs
    # the second pass hits every full block of each prompt but the last
    # token's: (P - 1) // bs blocks each
    second = hits[len(hits) // 2:]
    assert second == [(r["prompt_len"] - 1) // bs * bs
                      for r in generated["requests"][len(hits) // 2:]]
    # reads do not change with prefix caching; sharing makes distinct smaller
    assert truth[0]["reads"] == identity_reads(generated)
    assert truth[0]["shared"] > 0 and truth[0]["distinct"] < truth[0]["reads"]

    if failure is not None:
        raise failure
    (group,) = check_tracer(doc, truth, generated)
    assert group["reads"] == identity_reads(generated)
    assert group["distinct"] < group["reads"]

    # the recording: report's reads, from the stream, equal the maps', and
    # the prefix reuse it infers (rows at their first step, blocks that step
    # did not write) is vLLM's own prefix-cache hits, in blocks
    r = run_kvtrace("report", trace_file, "--format", "json")
    assert r.returncode == 0, r.stderr
    access = json.loads(r.stdout)["access"]
    worker = traced_groups(doc)["pid"]
    (acc,) = [a for a in access if a["pid"] == worker]
    # the plugin's group, in the engine core: the same reads
    (pacc,) = [a for a in access if a["pid"] == traced_groups(doc, "plugin")["pid"]]
    assert (pacc["reads"], pacc["distinct"]) == (group["reads"], group["distinct"])
    assert acc["reads"] == group["reads"] and acc["distinct"] == group["distinct"]
    assert acc["held_tokens"] == group["held_tokens"]
    assert acc["prefix_reuse"]["by"] == "rows"  # the worker has no step_reqs
    assert acc["prefix_reuse"]["requests"] == len(generated["requests"])
    assert acc["prefix_reuse"]["steps_without_writes"] == 0
    assert acc["prefix_reuse"]["blocks"] * bs == cache["hits"]
    # the plugin's group has no layers, hence no writes, but step_reqs
    # names its rows: the same figure, by request id
    assert pacc["prefix_reuse"]["by"] == "request ids"
    assert pacc["prefix_reuse"]["requests"] == len(generated["requests"])
    assert pacc["prefix_reuse"]["blocks"] * bs == cache["hits"]


# a conversation: turn 1 writes 57 + 8 - 1 = 64 tokens (its last sampled
# token is never written), 2 full blocks; each later turn's prompt is the
# turns before plus 24 new tokens, so each turn again ends on a full block
# (96, then 128 tokens) and the next turn finds all of its blocks cached
CONVERSATION = ("57:8", "--conversation", 3, "--turn-tokens", 24)


def test_prefix_reuse_the_next_turn_of_a_conversation(tmp_path, model, no_leftovers):
    """The next turn of a conversation hits every block of the turn before,
    whose last block is full: the case the rows alone get wrong
    (docs/access.md, "Prefix reuse").  The plugin tier names each row's
    request, and its prefix reuse is vLLM's own hits."""
    trace_file = tmp_path / "run.kvt"
    plen, extra = CONVERSATION[0], CONVERSATION[1:]
    generated, steps, doc, failure = trace_round(
        tmp_path, model, plen, "--prefix-caching", "on", *extra, trace_file=trace_file)
    bs = generated["block_size"]
    hits = check_record(steps, generated)
    prompts = [r["prompt_len"] for r in generated["requests"]]
    assert prompts == [57, 57 + 8 + 24, 57 + 2 * (8 + 24)]
    # every turn's written tokens fill its blocks, and the next turn finds
    # them all: vLLM's counters and the recorder's first steps agree
    assert all((p + len(r["generated"]) - 1) % bs == 0
               for p, r in zip(prompts, generated["requests"]))
    assert hits == [0, 64, 96] and generated["prefix_cache"]["hits"] == sum(hits)
    assert check_hits_are_earlier_blocks(steps, generated, hits) == sum(hits) // bs

    if failure is not None:
        raise failure
    r = run_kvtrace("report", trace_file, "--format", "json")
    assert r.returncode == 0, r.stderr
    access = json.loads(r.stdout)["access"]
    (pacc,) = [a for a in access if a["pid"] == traced_groups(doc, "plugin")["pid"]]
    assert pacc["prefix_reuse"]["by"] == "request ids"
    assert pacc["prefix_reuse"]["requests"] == 3
    assert pacc["prefix_reuse"]["blocks"] * bs == sum(hits)
    # the worker's rows, without names: each turn is taken for the one
    # before continuing (the documented limit), so it sees fewer requests
    (acc,) = [a for a in access if a["pid"] == traced_groups(doc)["pid"]]
    assert acc["prefix_reuse"]["by"] == "rows"
    assert acc["prefix_reuse"]["requests"] < 3
    # the text report says which of the two each figure is
    r = run_kvtrace("report", trace_file)
    assert r.returncode == 0, r.stderr
    assert "prefix reuse (by request id)" in r.stdout
    assert "prefix reuse (inferred from rows)" in r.stdout


def test_reads_exact_chunked_prefill(tmp_path, model, no_leftovers):
    """A 96-token step budget: long prompts are prefilled in chunks, each
    chunk a step whose seq_len is the chunk's end.  The identity's first
    term splits; the tracer must still match the record exactly."""
    generated, steps, doc, failure = trace_round(tmp_path, model, REQUESTS_OFF,
                                                 "--max-num-batched-tokens", 96)
    check_record(steps, generated, chunked=True)
    truth = truth_per_group(steps)
    bs = generated["block_size"]
    mine = per_request(steps, generated)
    # some prompt was chunked (more steps than tokens generated), and then
    # the reads are the identity with each prefill chunk's end as a term
    assert any(len(m) > len(r["generated"]) for m, r in zip(mine, generated["requests"]))
    assert truth[0]["reads"] == sum(math.ceil(sl / bs) for m in mine for sl, _, _ in m)
    assert truth[0]["reads"] > identity_reads(generated)

    if failure is not None:
        raise failure
    check_tracer(doc, truth, generated)
