"""The conformance driver: one vLLM release's real Scheduler, KVCacheManager
and BlockPool, run with no model, the plugin's hooks in place, and at every
step the plugin's events checked against the block pool's own state.

Run with vLLM's python (.venv-vllm), by tests/test_conformance.py:

    vllm_conformance.py --model DIR --record FILE --out FILE
                        [--sdist TREE] [--scenario NAME ...]

--sdist puts a release's unpacked source tree first on sys.path: with no
device build there, vLLM picks its unspecified platform, and the scheduler
needs no device.  The model directory holds a config.json only
(scripts/make-tiny-model.py): ModelConfig reads it, nothing else does.

The plugin writes every probe firing to --record (KVTRACE_PLUGIN_RECORD).
After each step (schedule, then the step's output) this reads the new
firings and replays them into its own picture of the pool: which requests
hold which blocks (alloc and hit give, free takes back) and which blocks
are cached (cache adds, evict removes).  That picture is then compared with
what the pool itself holds, read here from vLLM's objects: every group's
req_to_blocks, each block's ref_cnt, the free queue, the cached-hash map and
num_free_blocks.  The rows step_rows gave (each the row kept for its
request and group cut at tail_from, then its tail; block_free nulls freed
ids) are compared with req_to_blocks as the step's schedule() left it.
The first difference ends the scenario, described in the result; the
result of each scenario is one JSON object in --out.

The replay is written from vLLM's documented semantics of the pool, not
from the plugin's code: a test of the plugin must not share its mistakes.
"""

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections import Counter, defaultdict


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# ---- scenarios ------------------------------------------------------------------
#
# Each: the KV-cache groups ("full", "swa", "mamba"), the block size, the
# pool's size (small enough to preempt and evict), and the workload's knobs.
# Prompts share prefixes (prefix hits) and are longer than the step's token
# budget (chunked prefill).

BASE = dict(groups=("full",), block_size=16, num_blocks=48, prefix_caching=True,
            max_batched=96, max_seqs=8, spec_tokens=0, async_sched=False, aborts=0,
            reset=False, evict=False, mamba_mode="none", hash_div=1, repeats=False,
            requests=24, steps=400, seed=1)

SCENARIOS = {
    # prefix caching, preemption (a pool of 48 blocks), chunked prefill
    "full-16": dict(num_blocks=24, aborts=3),
    "full-64": dict(block_size=64, num_blocks=12, max_batched=192, aborts=3),
    "no-prefix-caching": dict(prefix_caching=False),
    "aborts": dict(aborts=8),
    "reset-prefix-cache": dict(reset=True),
    # KVCacheManager.evict_blocks, as a KV connector calls it for blocks
    # whose contents it reports invalid: every other cached block, mid-run
    "evict-blocks": dict(evict=True),
    "spec-decode": dict(spec_tokens=3),
    "async": dict(async_sched=True, aborts=2),
    "sliding-window": dict(groups=("full", "swa")),
    "sliding-window-64": dict(groups=("full", "swa"), block_size=64, num_blocks=24,
                              max_batched=192),
    "mamba": dict(groups=("full", "mamba"), prefix_caching=False),
    "mamba-align": dict(groups=("full", "mamba"), mamba_mode="align"),
    # repeats: every third prompt is an earlier one's, then more tokens: a
    # hit that ends inside a block, on the partial block the earlier one's
    # prompt end cached (copy-on-write for a new request)
    "mamba-align-fine-hash": dict(groups=("full", "mamba"), mamba_mode="align",
                                  hash_div=4, block_size=64, num_blocks=32,
                                  max_batched=192, repeats=True),
}


def scenario(name):
    s = dict(BASE)
    s.update(SCENARIOS[name])
    return s


# ---- building vLLM's scheduler ---------------------------------------------------

def only_fields(cls, kw):
    """kw less what cls (a dataclass or pydantic dataclass) does not take:
    the configs grow and lose fields between releases."""
    # __dataclass_fields__ has the InitVar pseudo-fields too
    names = set(getattr(cls, "__dataclass_fields__", kw))
    return {k: v for k, v in kw.items() if k in names}


def make_scheduler(model_dir, sc):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    bs = sc["block_size"]
    max_len = 1024
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=max_len)
    scheduler_config = SchedulerConfig(**only_fields(SchedulerConfig, dict(
        max_num_seqs=sc["max_seqs"], max_num_batched_tokens=sc["max_batched"],
        max_model_len=max_len, enable_chunked_prefill=True,
        async_scheduling=sc["async_sched"], is_encoder_decoder=False, watermark=0.0)))
    cache_config = CacheConfig(**only_fields(CacheConfig, dict(
        block_size=bs, gpu_memory_utilization=0.9, cache_dtype="auto",
        enable_prefix_caching=sc["prefix_caching"], mamba_cache_mode=sc["mamba_mode"])))
    spec = None
    if sc["spec_tokens"]:
        spec = SpeculativeConfig(model="ngram", num_speculative_tokens=sc["spec_tokens"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, parallel_config=ParallelConfig(),
                             speculative_config=spec,
                             # the unspecified platform of a source tree names none
                             device_config=DeviceConfig(device="cpu"))
    groups = []
    for i, kind in enumerate(sc["groups"]):
        if kind == "full":
            s = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32)
        elif kind == "swa":
            s = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32, sliding_window=2 * bs)
        else:
            s = MambaSpec(**only_fields(MambaSpec, dict(
                block_size=bs, shapes=((1, 1),), dtypes=(torch.float32,),
                mamba_cache_mode=sc["mamba_mode"],
                num_speculative_blocks=1 if sc["spec_tokens"] else 0)))
        groups.append(KVCacheGroupSpec([f"layer{i}"], s))
    kv_cache_config = KVCacheConfig(num_blocks=sc["num_blocks"], kv_cache_tensors=[],
                                    kv_cache_groups=groups)
    cache_config.num_gpu_blocks = sc["num_blocks"]
    try:
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        register_all_kvcache_specs(vllm_config)
    except ImportError:
        pass
    cls = Scheduler
    if sc["async_sched"]:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        cls = AsyncScheduler
    kw = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
              block_size=bs, log_stats=True,
              structured_output_manager=StructuredOutputManager(vllm_config))
    if sc["hash_div"] > 1:
        kw["hash_block_size"] = bs // sc["hash_div"]
    return cls(**kw)


def make_request(rid, tokens, max_tokens, hash_block_size):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not getattr(make_request, "init", False):
        init_none_hash(sha256)
        make_request.init = True
    sp = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    kw = dict(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
              pooling_params=None, block_hasher=get_request_block_hasher(hash_block_size, sha256))
    import inspect
    params = inspect.signature(Request.__init__).parameters
    if "eos_token_id" in params:
        kw["eos_token_id"] = 2
    if "mm_features" in params:
        kw["mm_features"] = None
    return Request(**{k: v for k, v in kw.items() if k in params})


def model_output(sched_out, rng, spec_tokens):
    """What a model run of sched_out would return: one sampled token per
    request with tokens scheduled (more when drafts were accepted)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    sampled = []
    drafts = getattr(sched_out, "scheduled_spec_decode_tokens", {}) or {}
    for rid in ids:
        n = 1
        d = drafts.get(rid)
        if d:
            n += rng.randint(0, len(d))
        sampled.append([rng.randint(3, 999) for _ in range(n)])
    kw = dict(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
              sampled_token_ids=sampled)
    return ModelRunnerOutput(**only_fields(ModelRunnerOutput, kw))


def propose_drafts(sched, rng, k):
    """Draft tokens for the running requests, as the worker's proposer hands
    them back (update_draft_token_ids)."""
    try:
        from vllm.v1.outputs import DraftTokenIds
    except ImportError:
        return
    reqs = [r.request_id for r in sched.running]
    if reqs:
        sched.update_draft_token_ids(
            DraftTokenIds(reqs, [[rng.randint(3, 999) for _ in range(k)] for _ in reqs]))


# ---- the pool's own state, read from vLLM's objects ---------------------------------

def pool_truth(sched):
    m = sched.kv_cache_manager
    pool = m.block_pool
    held = {}
    for stm in m.coordinator.single_type_managers:
        g = stm.kv_cache_group_id
        for rid, blocks in stm.req_to_blocks.items():
            ids = sorted(b.block_id for b in blocks if not b.is_null)
            if ids:
                held[(fnv1a64(rid), g)] = ids
    ref = {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null}
    free = set()
    q = pool.free_block_queue
    node = q.fake_free_list_head.next_free_block
    while node is not None and node is not q.fake_free_list_tail:
        free.add(node.block_id)
        node = node.next_free_block
    cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
    # the hash map's values: blocks, {id: block} (0.32, 0.33) or ids (0.34,
    # with the ids of keys several blocks share in _dup_ids)
    in_map = set()
    cmap = pool.cached_block_hash_to_block
    for v in list(cmap._cache.values()) + list(getattr(cmap, "_dup_ids", {}).values()):
        if isinstance(v, int):
            in_map.add(v)
        elif isinstance(v, dict):
            in_map.update(v)
        else:
            in_map.add(v.block_id)
    return dict(held=held, ref=ref, free=free, cached=cached, in_map=in_map,
                num_free=pool.get_num_free_blocks(), num_blocks=pool.num_gpu_blocks)


def rows_truth(sched):
    """Every group's req_to_blocks as block ids (the null block 0), by
    (request hash, group): the rows as the scheduler holds them."""
    out = {}
    for stm in sched.kv_cache_manager.coordinator.single_type_managers:
        for rid, blocks in stm.req_to_blocks.items():
            out[(fnv1a64(rid), stm.kv_cache_group_id)] = [
                0 if b.is_null else b.block_id for b in blocks]
    return out


def count_cow(out, rows):
    """The step's copy-on-write copies (SchedulerOutput.kv_cache_block_copies,
    the copies the worker is told to run), as (the request moved to the copy:
    its table holds dst, a new request's partial hit; the cache moved to the
    copy: its table keeps src, a running request's partial hit)."""
    to_request = to_cache = 0
    held = {b for row in rows.values() for b in row}
    for c in getattr(out, "kv_cache_block_copies", None) or ():
        if c.dst_block_id in held:
            to_request += 1
        elif c.src_block_id in held:
            to_cache += 1
    return to_request, to_cache


# ---- the picture the plugin's events give -------------------------------------------

class Replay:
    def __init__(self):
        self.held = defaultdict(Counter)   # (req, group) -> block id -> count
        self.cached = set()
        self.counts = Counter()
        # step_rows: each (req, group)'s row kept from the deltas, and the
        # rows the last step_rows ops gave, as they gave them
        self.rows = {}
        self.reported = {}

    def apply_rows(self, ev):
        """A step_rows op: each row is the kept row cut at tail_from, then
        its tail; a block_free nulls the freed ids in its request's kept
        row.  The first inconsistency, or None."""
        if ev["probe"] == "block_free":
            row = self.rows.get((ev["req"], ev["group"]))
            if row:
                row[:] = [0 if b in ev["ids"] else b for b in row]
            return None
        at, tail = 0, ev["tail"]
        for req, _seq, _new, n, frm in ev["rows"]:
            key = (req % 2**64, ev["group"])
            cur = self.rows.get(key, []) if frm else []
            if frm > len(cur):
                return f"step_rows: request {key[0]:x} tail from {frm}, kept {len(cur)}"
            row = cur[:frm] + tail[at:at + n - frm]
            at += n - frm
            if len(row) != n:
                return f"step_rows: request {key[0]:x} row of {len(row)}, row_len {n}"
            self.rows[key] = row
            self.reported[key] = list(row)
        if at != len(tail):
            return f"step_rows: {len(tail) - at} tail entries left over"
        return None

    def compare_rows(self, truth):
        """The rows the step's step_rows gave against req_to_blocks as the
        schedule left it (truth: rows_truth()); then forgets them."""
        got, self.reported = self.reported, {}
        for key, row in got.items():
            if truth.get(key) != row:
                return (f"row of request {key[0]:x} group {key[1]}: req_to_blocks "
                        f"{truth.get(key)}, step_rows {row}")
        return None

    def apply(self, ev):
        p = ev["probe"]
        if p in ("step_rows", "block_free"):
            why = self.apply_rows(ev)
            if why:
                return why
        if p not in ("block_alloc", "block_hit", "block_cache", "block_free", "block_evict"):
            self.counts[p] += 1
            return None
        self.counts[p] += len(ev["ids"])
        key = (ev["req"], ev["group"])
        if p in ("block_alloc", "block_hit"):
            for b in ev["ids"]:
                self.held[key][b] += 1
        elif p == "block_free":
            for b in ev["ids"]:
                if self.held[key][b] <= 0:
                    return f"block_free of block {b} that request {ev['req']:x} " \
                           f"group {ev['group']} does not hold"
                self.held[key][b] -= 1
                if not self.held[key][b]:
                    del self.held[key][b]
            if not self.held[key]:
                del self.held[key]
        elif p == "block_cache":
            for b in ev["ids"]:
                if b in self.cached:
                    return f"block_cache of block {b}, already cached"
                self.cached.add(b)
        elif p == "block_evict":
            for b in ev["ids"]:
                if b not in self.cached:
                    return f"block_evict of block {b}, never reported cached"
                self.cached.discard(b)
        return None

    def compare(self, t):
        """The first difference between this picture and the pool's truth t."""
        held = {k: sorted(c.elements()) for k, c in self.held.items() if c}
        if held != t["held"]:
            for k in sorted(set(held) | set(t["held"])):
                if held.get(k) != t["held"].get(k):
                    return (f"req_to_blocks of request {k[0]:x} group {k[1]}: pool "
                            f"{t['held'].get(k)}, events {held.get(k)}")
        ref = Counter()
        for c in self.held.values():
            ref.update(c)
        for b, n in t["ref"].items():
            if ref.get(b, 0) != n:
                return f"ref_cnt of block {b}: pool {n}, events {ref.get(b, 0)}"
        free = {b for b in t["ref"] if not ref.get(b)}
        if free != t["free"]:
            return (f"free queue: pool {sorted(t['free'] - free)} free and "
                    f"{sorted(free - t['free'])} not, against the events")
        if t["num_free"] != len(free):
            return f"num_free_blocks: pool {t['num_free']}, events {len(free)}"
        if self.cached != t["cached"] or self.cached != t["in_map"]:
            return (f"cached blocks: pool {sorted(t['cached'] ^ self.cached)[:20]} differ "
                    f"(map {sorted(t['in_map'] ^ self.cached)[:20]})")
        return None


class RecordReader:
    def __init__(self, path):
        self.path = path
        self.pos = 0

    def new(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            data = f.read()
        end = data.rfind("\n") + 1
        self.pos += len(data[:end].encode())
        return [json.loads(line) for line in data[:end].splitlines()]


# ---- one scenario ---------------------------------------------------------------------

def run(name, model_dir, reader):
    from vllm.v1.request import RequestStatus

    sc = scenario(name)
    rng = random.Random(sc["seed"])
    reader.new()  # what earlier scenarios left
    sched = make_scheduler(model_dir, sc)
    from kvtrace_vllm import hooks
    plugin_status = hooks.status
    bs = sc["block_size"]
    hbs = bs // sc["hash_div"]
    prefixes = [[rng.randint(3, 999) for _ in range(3 * bs)] for _ in range(3)]
    pending = []
    prompts = []
    for i in range(sc["requests"]):
        n = rng.randint(bs // 2, 4 * bs)
        if sc["repeats"] and i % 3 == 2:
            toks = prompts[rng.randrange(i - 1)] + [rng.randint(3, 999) for _ in range(n)]
        else:
            toks = rng.choice(prefixes)[:rng.randint(0, 3 * bs)] + \
                [rng.randint(3, 999) for _ in range(n)]
        prompts.append(toks)
        pending.append(make_request(f"{name}-{i}", toks, rng.randint(1, 32), hbs))
    replay = Replay()
    result = dict(scenario=name, steps=0, checks=0, rows_checked=0, error=None, aborted=0,
                  reset=False,
                  connector_evicted=0, plugin_status=plugin_status,
                  cow_to_request=0, cow_to_cache=0,
                  draft_tokens=0, scheduler=type(sched).__name__)
    queue = []  # async: outputs a step behind
    aborted = set()
    for step in range(sc["steps"]):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if sc["aborts"] and result["aborted"] < sc["aborts"] and rng.random() < 0.1:
            live = [r for r in sched.requests if r not in aborted]
            if live:
                rid = rng.choice(live)
                aborted.add(rid)
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                result["aborted"] += 1
        if sc["spec_tokens"]:
            propose_drafts(sched, rng, sc["spec_tokens"])
        out = sched.schedule()
        held_rows = rows_truth(sched)
        cow = count_cow(out, held_rows)
        result["cow_to_request"] += cow[0]
        result["cow_to_cache"] += cow[1]
        result["draft_tokens"] += sum(
            map(len, (getattr(out, "scheduled_spec_decode_tokens", None) or {}).values()))
        if sc["async_sched"]:
            queue.append(out)
            if len(queue) > 1:
                done = queue.pop(0)
                sched.update_from_output(done, model_output(done, rng, sc["spec_tokens"]))
        else:
            sched.update_from_output(out, model_output(out, rng, sc["spec_tokens"]))
        if sc["evict"] and step in (15, 30):
            pool = sched.kv_cache_manager.block_pool
            ids = sorted(b.block_id for b in pool.blocks if b.block_hash is not None)[::2]
            sched.kv_cache_manager.evict_blocks(set(ids))
            result["connector_evicted"] += len(ids)
        if sc["reset"] and not result["reset"] and step > 40 and not sched.requests:
            result["reset"] = bool(sched.reset_prefix_cache())
        result["steps"] += 1
        for ev in reader.new():
            why = replay.apply(ev)
            if why:
                result["error"] = f"step {step}: {why}"
                break
        if not result["error"]:
            result["error"] = replay.compare(pool_truth(sched))
            if result["error"]:
                result["error"] = f"step {step}: {result['error']}"
        if not result["error"]:
            result["rows_checked"] += len(replay.reported)
            result["error"] = replay.compare_rows(held_rows)
            if result["error"]:
                result["error"] = f"step {step}: {result['error']}"
        result["checks"] += 1
        if result["error"]:
            break
        if not pending and not sched.requests:
            if sc["reset"] and not result["reset"]:
                result["reset"] = bool(sched.reset_prefix_cache())
                for ev in reader.new():
                    replay.apply(ev)
                result["error"] = replay.compare(pool_truth(sched))
                if result["error"]:
                    result["error"] = f"after reset_prefix_cache: {result['error']}"
            break
    result["events"] = dict(replay.counts)
    result["finished"] = not pending and not sched.requests
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist")
    ap.add_argument("--model", required=True)
    ap.add_argument("--record", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenario", action="append")
    a = ap.parse_args()
    if a.sdist:
        sys.path.insert(0, a.sdist)
    os.environ["KVTRACE_PLUGIN_RECORD"] = a.record
    import vllm
    from kvtrace_vllm import hooks

    head = dict(release=vllm.__version__.split("+")[0], vllm=os.path.dirname(vllm.__file__),
                installed=hooks.install(), status=hooks.status)
    results = []
    reader = RecordReader(a.record)
    for name in a.scenario or list(SCENARIOS):
        t = time.monotonic()
        try:
            r = run(name, a.model, reader)
        except Exception:  # noqa: BLE001 - reported, the next scenario still runs
            r = dict(scenario=name, error="raised: " + traceback.format_exc()[-2000:])
        r["seconds"] = round(time.monotonic() - t, 2)
        r["hook_errors"] = hooks.errors
        results.append(r)
    head["scenarios"] = results
    with open(a.out, "w") as f:
        json.dump(head, f, indent=1)


if __name__ == "__main__":
    main()
