#!/usr/bin/env python3
"""A fixed offline vLLM workload on the tiny model: the real target.

Runs LLM.generate on token-id prompts (no tokenizer, dummy weights) with
greedy sampling, and prints what vLLM generated as one JSON object on the
last line of stdout (and to --out): per request, the prompt length and the
generated token ids.  The tests compute the expected KV-cache writes from
that alone (docs/stock-vllm.md), never from the tracer.

With --wait, it builds the engine, prints "READY <pid>" to stderr and waits
for SIGUSR1 before generating, so that a tracer can attach in between.

Ground truth for reads, from vLLM itself (never from the tracer):
  - "prefix_cache" in the JSON: vLLM's own counters vllm:prefix_cache_queries
    and vllm:prefix_cache_hits for the round, in tokens (LLM.get_metrics(),
    which needs disable_log_stats=False);
  - --record-reads FILE: what vLLM's CPU attention backend passed to the op
    cpu_attention_with_kv_cache at every forward step, per KV-cache group,
    recorded in the worker process (see record_reads below).

Run it with the vLLM venv's python:
  .venv-vllm/bin/python scripts/vllm-workload.py --model build/tiny-llama
"""
import argparse
import json
import os
import random
import signal
import sys
import time

RECORD_ENV = "KVTRACE_WORKLOAD_RECORD_READS"
BLOCKS_ENV = "KVTRACE_WORKLOAD_RECORD_BLOCKS"
BUSY_WAIT_ENV = "KVTRACE_WORKLOAD_BUSY_WAIT"
NAP_S = 100e-6  # no_busy_wait


def parse_requests(text):
    """'100:8,40:3' -> [(prompt_len 100, max_tokens 8), (40, 3)]"""
    out = []
    for item in text.split(","):
        plen, _, gen = item.partition(":")
        out.append((int(plen), int(gen or 8)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a directory with config.json "
                   "(scripts/make-tiny-model.py)")
    p.add_argument("--requests", default="100:8,40:8,7:3,33:5,64:1",
                   help="PROMPT_LEN:MAX_TOKENS,... (default %(default)s)")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size in tokens; the CPU backend needs a multiple of 32")
    p.add_argument("--prefix-caching", choices=("on", "off"), default="off")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N token ids (the rest random): "
                   "with --prefix-caching on, later requests hit the shared blocks")
    p.add_argument("--busy-wait", action="store_true",
                   help="keep vLLM's spinning queue readers (its default; see no_busy_wait)")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="each batch of --repeat draws new prompts (the --shared-prefix "
                   "kept): with prefix caching and a small cache, blocks get evicted")
    p.add_argument("--conversation", type=int, default=0, metavar="TURNS",
                   help="the batch is one conversation of TURNS requests, one after the "
                   "other: the first --requests entry is turn 1, and each later turn's "
                   "prompt is the turn before's prompt and output and --turn-tokens more")
    p.add_argument("--turn-tokens", type=int, default=24, metavar="N",
                   help="with --conversation: new tokens each later turn adds (default "
                   "%(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="vLLM's per-step token budget (default: vLLM's, 4096 for LLM on "
                   "the CPU); a prompt longer than what is left of it is chunked")
    p.add_argument("--record-reads", metavar="FILE",
                   help="record, in vLLM's worker, the seq_lens and block-table rows passed "
                   "to cpu_attention_with_kv_cache at every step (JSON lines, appended)")
    p.add_argument("--record-blocks", metavar="FILE",
                   help="record, in vLLM's scheduler, every request's block ids per KV-cache "
                   "group as KVCacheManager.free is about to release them (JSON lines)")
    p.add_argument("--num-gpu-blocks", type=int, metavar="N",
                   help="vLLM's num_gpu_blocks_override: a KV cache of N blocks (small: "
                   "preemptions)")
    p.add_argument("--max-model-len", type=int, default=512,
                   help="vLLM's max_model_len (default %(default)s; at most what "
                   "--num-gpu-blocks hold)")
    p.add_argument("--kv-events-port", type=int, metavar="PORT",
                   help="vLLM publishes its KV events (BlockStored, BlockRemoved) on "
                   "tcp://*:PORT (its zmq publisher; audit-kv-events reads them)")
    p.add_argument("--report-mode", choices=("incremental", "full"),
                   help="each request's kv_cache_report_mode (sampling extra_args): with "
                   "\"full\", vLLM announces its prefix-cache hits as BlockStored events")
    p.add_argument("--cache-salts", metavar="S1,S2,...",
                   help="batch k of --repeat gets cache_salt S(k mod n) ('' none): the same "
                   "prompts under another salt share no prefix-cache block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                   help="KV cache size (default 64 MiB: vLLM's default wants GiBs)")
    p.add_argument("--wait", action="store_true",
                   help="print READY <pid> to stderr, then wait for SIGUSR1 to generate")
    p.add_argument("--repeat", type=int, default=1, help="generate the batch N times")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --wait: N rounds, each waiting for its own SIGUSR1 and "
                   "rewriting --out; prints 'ROUND i DONE' to stderr after each")
    p.add_argument("--until-stopped", action="store_true",
                   help="with --wait: each round generates the batch again and again, "
                   "printing 'ROUND i BATCH n' to stderr after each, until SIGUSR2 "
                   "(checked between batches; --repeat is ignored)")
    p.add_argument("--out", help="also write the JSON result to this file")
    args = p.parse_args()
    if args.block_size % 32:
        p.error("--block-size must be a multiple of 32 (vLLM's CPU attention)")
    if any(plen < args.shared_prefix for plen, _ in parse_requests(args.requests)):
        p.error("--shared-prefix is longer than a prompt")

    if args.wait:  # block them before vLLM starts threads: sigwait needs that
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    if args.record_reads:
        # vLLM's CPU platform starts the engine core and the worker with
        # multiprocessing's spawn, which imports this file again in them
        # (as __mp_main__): the variable tells those imports to install the
        # recorder (bottom of this file).  The worker is where the op runs.
        os.environ[RECORD_ENV] = os.path.abspath(args.record_reads)
        fd = os.open(args.record_reads, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)

    if args.record_blocks:  # the scheduler runs in the engine core process
        os.environ[BLOCKS_ENV] = os.path.abspath(args.record_blocks)
        fd = os.open(args.record_blocks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)

    if args.busy_wait:
        os.environ[BUSY_WAIT_ENV] = "1"  # for the engine core and worker too
    no_busy_wait()

    # stats are on for the prefix-cache counters (below); their periodic
    # log line is not wanted: vLLM's output goes where the tracer draws
    os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "1e9")

    from vllm import LLM, SamplingParams
    if args.record_reads:  # and here, should vLLM ever run the model in-process
        record_reads(os.environ[RECORD_ENV])
    if args.record_blocks:
        record_blocks(os.environ[BLOCKS_ENV])

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    t0 = time.time()
    extra = {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_gpu_blocks:
        extra["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.kv_events_port:
        from vllm.config.kv_events import KVEventsConfig
        extra["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://*:{args.kv_events_port}")
    # disable_log_stats=False: LLM turns stats off by default, and without
    # them LLM.get_metrics() (vLLM's prefix-cache counters) is refused
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              block_size=args.block_size, enforce_eager=True, max_model_len=args.max_model_len,
              enable_prefix_caching=args.prefix_caching == "on", seed=args.seed,
              kv_cache_memory_bytes=args.kv_cache_bytes, disable_log_stats=False,
              **extra)
    t_init = time.time() - t0

    rng = random.Random(args.seed)
    vocab = config["vocab_size"]
    requests = parse_requests(args.requests)
    shared = [rng.randrange(3, vocab) for _ in range(args.shared_prefix)]
    def draw():
        return [{"prompt_token_ids": shared + [rng.randrange(3, vocab)
                                               for _ in range(plen - len(shared))]}
                for plen, _ in requests]

    prompts = draw()
    args.draw = draw  # --fresh-prompts: each batch after the first draws anew
    args.user_tokens = lambda: [rng.randrange(3, vocab) for _ in range(args.turn_tokens)]
    report = {"extra_args": {"kv_cache_report_mode": args.report_mode}} \
        if args.report_mode else {}
    params = [SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, detokenize=False,
                             **report)
              for _, gen in requests]

    if args.wait:
        print(f"READY {os.getpid()}", file=sys.stderr, flush=True)
    for round_no in range(1, max(1, args.rounds) + 1):
        if args.wait:
            signal.sigwait({signal.SIGUSR1})
        generate_round(llm, prompts, params, args, config, t_init, round_no)
        if args.rounds > 1:
            print(f"ROUND {round_no} DONE", file=sys.stderr, flush=True)


def prefix_cache_counters(llm):
    """vLLM's own prefix-cache counters (Prometheus, summed over engines):
    queries = prompt tokens of the requests it looked up, hits = the tokens
    of those found in the cache (whole blocks; vllm/v1/core/kv_cache_manager.py
    record_prefix_cache_stats).  Cumulative: a round is the difference."""
    got = {"queries": 0, "hits": 0, "preemptions": 0}
    for metric in llm.get_metrics():
        key = {"vllm:prefix_cache_queries": "queries",
               "vllm:prefix_cache_hits": "hits",
               "vllm:num_preemptions": "preemptions"}.get(metric.name)
        if key:
            got[key] += int(metric.value)
    return got


def stop_requested() -> bool:
    """--until-stopped: SIGUSR2 arrived (it stays pending, blocked, until
    taken here, whichever thread it was sent to)."""
    if signal.SIGUSR2 not in signal.sigpending():
        return False
    signal.sigwait({signal.SIGUSR2})
    return True


def generate_round(llm, prompts, params, args, config, t_init, round_no=1):
    results, request_ids = [], []
    mark_round(args, round_no, "start")
    cache0 = prefix_cache_counters(llm)
    t1 = time.time()
    batches = 0
    while True:
        batch = args.draw() if args.fresh_prompts and batches else prompts
        if args.cache_salts is not None:
            salts = args.cache_salts.split(",")
            salt = salts[batches % len(salts)]
            batch = [dict(p, cache_salt=salt) if salt else p for p in batch]
        for out in (converse(llm, batch[0], params[0], args) if args.conversation else
                    llm.generate(batch, params, use_tqdm=False)):
            # num_cached_tokens: vLLM's own per-request prefix-cache hit, in
            # tokens (the tests' truth for the tracer's per-request hits)
            results.append({"prompt_len": len(out.prompt_token_ids),
                            "generated": list(out.outputs[0].token_ids),
                            "num_cached_tokens": out.num_cached_tokens})
            request_ids.append(out.request_id)
        batches += 1
        if args.wait and args.until_stopped:
            # an event for a test: a whole batch went through the engine
            print(f"ROUND {round_no} BATCH {batches}", file=sys.stderr, flush=True)
            if stop_requested():
                break
        elif batches >= args.repeat:
            break
    t_gen = time.time() - t1
    cache1 = prefix_cache_counters(llm)
    # the worker wrote each step's record before the step's output came
    # back here: everything of this round is in the file by now
    mark_round(args, round_no, "end")
    doc = {"pid": os.getpid(), "block_size": args.block_size,
           "num_layers": config["num_hidden_layers"],
           "prefix_caching": args.prefix_caching == "on", "seed": args.seed,
           "init_s": round(t_init, 3), "generate_s": round(t_gen, 3),
           "batches": batches,
           "generated_tokens": sum(len(r["generated"]) for r in results),
           "requests": results,
           # new fields below; the ones above are what other tests parse
           "round": round_no, "shared_prefix": args.shared_prefix,
           "request_ids": request_ids,
           "prefix_cache": {"unit": "tokens",
                            "queries": cache1["queries"] - cache0["queries"],
                            "hits": cache1["hits"] - cache0["hits"]},
           # vLLM's vllm:num_preemptions counter, for the round
           "preemptions": cache1["preemptions"] - cache0["preemptions"],
           "record_reads": args.record_reads, "record_blocks": args.record_blocks}
    line = json.dumps(doc)
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


def converse(llm, prompt, params, args):
    """--conversation: each turn a request of its own, started when the turn
    before has finished, its prompt the whole conversation so far (as a
    chat's next turn is): with prefix caching it finds the turns before in
    the cache."""
    ids = list(prompt["prompt_token_ids"])
    for _ in range(args.conversation):
        (out,) = llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
        yield out
        ids = ids + list(out.outputs[0].token_ids) + args.user_tokens()


def append_line(path, obj):
    """One JSON line, in one write() on an O_APPEND file: the worker and this
    process may both write to it, and lines stay whole."""
    data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def mark_round(args, round_no, event):
    """Round markers in the --record-reads file, written by this process
    while the worker is idle: what lies between a round's start and end
    markers is that round's steps (warm-up and earlier rounds come before)."""
    if args.record_reads:
        append_line(args.record_reads, {"round": round_no, "event": event,
                                        "pid": os.getpid()})


def record_reads(path):
    """Record what vLLM's CPU attention backend passes to the C++ op
    cpu_attention_with_kv_cache, the function the tracer probes.

    vllm/v1/attention/backends/cpu_attn.py calls it as
    `ops.cpu_attention_with_kv_cache(...)` (an attribute of vllm._custom_ops
    looked up at each call), once per attention layer per forward step; this
    wraps that Python function in the process that runs the model.  Only
    index tensors are read (seq_lens, query_start_loc, block_table) and the
    KV cache's shape: never keys, values, queries or prompts.

    One JSON line per call.  A step is one ForwardContext (vLLM makes a new
    one for every model forward, vllm/forward_context.py); the group is the
    KV-cache group whose block table the tensor is (its storage is that
    group's persistent buffer in the model runner).  The first layer of a
    (step, group) writes the full record: seq_lens, query lengths, the
    request ids, and each row's first ceil(seq_len / block_size) entries
    (the blocks attention reads) plus how many non-zero entries follow them.
    Every later layer of the same (step, group) writes only whether it saw
    exactly the same (it always should: the metadata is built once per group
    per step)."""
    import gc

    from vllm import _custom_ops as ops
    from vllm import forward_context

    original = ops.cpu_attention_with_kv_cache
    if getattr(original, "kvtrace_recorder", False):
        return  # imported twice in one process
    import inspect
    signature = inspect.signature(original)
    state = {"ctx": None, "step": -1, "first": {}, "caches": {}, "runner": None}
    pid = os.getpid()

    def model_runner():
        # the worker's model runner, for the request ids and the groups'
        # block-table buffers; found once (it lives as long as the worker)
        if state["runner"] is None:
            mod = sys.modules.get("vllm.v1.worker.gpu_model_runner")
            if mod is not None:
                state["runner"] = next((o for o in gc.get_objects()
                                        if isinstance(o, mod.GPUModelRunner)), None)
        return state["runner"]

    def group_of(block_table, runner):
        ptr = block_table.untyped_storage().data_ptr()
        if runner is not None:
            for gid, bt in enumerate(runner.input_batch.block_table.block_tables):
                if bt.block_table.gpu.untyped_storage().data_ptr() == ptr:
                    return gid
        return None

    def recorder(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        try:
            ctx = forward_context.get_forward_context()
        except AssertionError:
            ctx = None
        if ctx is None or ctx is not state["ctx"]:
            # a new forward step; holding the context keeps its id unique
            state["ctx"], state["first"] = ctx, {}
            state["step"] += 1
        table, seq_lens, qsl, key_cache = (a["block_table"], a["seq_lens"],
                                           a["query_start_loc"], a["key_cache"])
        runner = model_runner()
        group = group_of(table, runner)
        cache_ptr = key_cache.untyped_storage().data_ptr() + key_cache.storage_offset()
        cache = state["caches"].setdefault(cache_ptr, len(state["caches"]))
        bs = int(key_cache.shape[2])
        seq = [int(x) for x in seq_lens.tolist()]
        starts = [int(x) for x in qsl.tolist()]
        rows, tails = [], []
        for i, s in enumerate(seq):
            used = -(-s // bs)
            row = table[i]
            rows.append([int(x) for x in row[:used].tolist()])
            tails.append(int((row[used:] != 0).sum()))
        num_reqs = len(seq)
        req_ids = (list(runner.input_batch.req_ids[:num_reqs])
                   if runner is not None else None)
        payload = {"block_size": bs, "num_blocks": int(key_cache.shape[0]),
                   "sliding_window": int(a["sliding_window"]), "causal": bool(a["causal"]),
                   "table_shape": list(table.shape), "table_stride": list(table.stride()),
                   "table_dtype": str(table.dtype), "table_contiguous": table.is_contiguous(),
                   "table_storage_offset": int(table.storage_offset()),
                   "seq_lens_dtype": str(seq_lens.dtype), "req_ids": req_ids,
                   "seq_lens": seq, "query_lens": [starts[i + 1] - starts[i]
                                                    for i in range(num_reqs)],
                   "rows": rows, "tail_nonzero": tails}
        key = (group, table.untyped_storage().data_ptr())
        line = {"pid": pid, "step": state["step"], "group": group, "cache": cache}
        first = state["first"].get(key)
        if first is None:
            state["first"][key] = payload
            line.update(payload)
        else:
            line["same"] = payload == first
            if not line["same"]:
                line.update(payload)
        append_line(path, line)
        return original(*args, **kwargs)

    recorder.kvtrace_recorder = True
    ops.cpu_attention_with_kv_cache = recorder


def record_blocks(path):
    """Record, in the process that runs vLLM's scheduler, each request's
    blocks as the scheduler releases them: KVCacheManager.free(request)
    (vllm/v1/core/kv_cache_manager.py; called when a request finishes and
    when it is preempted) is wrapped, and before it runs, the request's
    block ids per KV-cache group (coordinator.get_blocks, null blocks left
    out) are written as one JSON line with its id and token counts.  Block
    ids and counts only, never tokens."""
    from vllm.v1.core import kv_cache_manager as kvm

    original = kvm.KVCacheManager.free
    if getattr(original, "kvtrace_recorder", False):
        return
    pid = os.getpid()

    def free(self, request):
        groups = [[b.block_id for b in blocks if not b.is_null]
                  for blocks in self.coordinator.get_blocks(request.request_id)]
        append_line(path, {"pid": pid, "req": request.request_id, "groups": groups,
                           "num_computed_tokens": int(request.num_computed_tokens),
                           "prompt": int(request.num_prompt_tokens),
                           "output": int(request.num_output_tokens),
                           "status": str(request.status)})
        return original(self, request)

    free.kvtrace_recorder = True
    kvm.KVCacheManager.free = free


def no_busy_wait():
    """Make vLLM's shared-memory queue readers nap, not spin on sched_yield.

    After each message a reader (the engine core waiting for the worker's
    output, the worker waiting for the next step) polls the queue in a loop
    with sched_yield() for a second before it blocks.  vLLM's CPU backend
    pins its worker to one CPU and leaves the other to all else; on a 2-CPU
    machine the engine core's loop takes that one, and a sched_yield loop
    starves the other processes there under the kernel's EEVDF scheduler.
    Measured on this VM (Linux 6.18) while vLLM generated: a CPU-bound
    process got 3% of a CPU (nice -20: 5%), the tracer's 8 s BPF compile
    took 273 s, and a tracer told to stop took 55 s to exit.

    Here each turn of the loop sleeps 100 us instead: the reader still sees
    a message within 0.1 ms (a CPU step takes milliseconds), vLLM schedules
    and computes the same steps, and the CPU is left to the tracer and the
    tests.  (Blocking at once, busy_loop_s = 0, is not safe: the queue's
    wake-up messages can be dropped, and a reader then waits for its poll
    timeout.)  --busy-wait keeps vLLM's way."""
    if os.environ.get(BUSY_WAIT_ENV):
        return
    from vllm.distributed.device_communicators import shm_broadcast

    def nap():
        time.sleep(NAP_S)

    shm_broadcast.sched_yield = nap


if __name__ == "__main__":  # vLLM's worker processes re-import this file
    main()
if __name__ == "__mp_main__":
    no_busy_wait()
if __name__ == "__mp_main__" and os.environ.get(BLOCKS_ENV):
    record_blocks(os.environ[BLOCKS_ENV])
if __name__ == "__mp_main__" and os.environ.get(RECORD_ENV):
    # this file imported again by multiprocessing's spawn, in vLLM's engine
    # core or worker: record there (the op is only ever called in the worker)
    record_reads(os.environ[RECORD_ENV])
