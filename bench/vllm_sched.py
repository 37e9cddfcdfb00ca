#!/usr/bin/env python3
"""vLLM's real scheduler at production scale, for bench/run.py's row 12.

One warm process builds vLLM's v1 Scheduler with the kvtrace plugin
registered, as vLLM's plugin loader does (tests/vllm_conformance.py's way,
no model: a step's model output is one sampled token per request), adds
--requests requests that share a --prefix-token prompt prefix and have
--own tokens of their own, and runs their prefill.  Then every line read on
stdin runs that many decode steps and prints one JSON line: each step's
Scheduler.schedule() time in us, timed here, outside the plugin's wrapper,
and the block-table entries each step held (the scheduled requests' blocks
in every KV-cache group, counted after the timed call).  The bench
attaches and detaches the tracer between lines, so untraced and traced
steps alternate in this one process.  EOF on stdin ends it.

Run it with vLLM's python:
  .venv-vllm/bin/python bench/vllm_sched.py --model build/tiny-llama
"""

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import vllm_conformance as vc  # noqa: E402


def make_scheduler(model_dir, block_size, num_blocks, max_seqs, max_batched, max_len):
    """tests/vllm_conformance.py's make_scheduler, one full-attention group,
    sized for long prompts and many requests."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    only = vc.only_fields
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=max_len)
    scheduler_config = SchedulerConfig(**only(SchedulerConfig, dict(
        max_num_seqs=max_seqs, max_num_batched_tokens=max_batched, max_model_len=max_len,
        enable_chunked_prefill=True, async_scheduling=False, is_encoder_decoder=False,
        watermark=0.0)))
    cache_config = CacheConfig(**only(CacheConfig, dict(
        block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
        enable_prefix_caching=True)))
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, parallel_config=ParallelConfig(),
                             device_config=DeviceConfig(device="cpu"))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    cache_config.num_gpu_blocks = num_blocks
    try:
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        register_all_kvcache_specs(vllm_config)
    except ImportError:
        pass
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     block_size=block_size, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config))


def entries(sched, out) -> int:
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    ids = list(out.num_scheduled_tokens)
    return sum(len(m.req_to_blocks.get(r, ())) for m in managers for r in ids)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prefix", type=int, default=3072, help="shared prompt tokens")
    p.add_argument("--own", type=int, default=64, help="each request's own prompt tokens")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-batched", type=int, default=8192)
    args = p.parse_args()

    # no model runs here: the tiny model's 1024 positions bound nothing
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    import kvtrace_vllm
    kvtrace_vllm.register()  # as vLLM's plugin loader does

    decode_room = 4096  # tokens each request may generate: never finishes here
    max_len = args.prefix + args.own + decode_room
    per_req = -(-(args.own + decode_room) // args.block_size) + 1
    num_blocks = -(-args.prefix // args.block_size) + args.requests * per_req + 1
    sched = make_scheduler(args.model, args.block_size, num_blocks, args.requests,
                           args.max_batched, max_len)
    rng = random.Random(1)
    prefix = [rng.randint(3, 999) for _ in range(args.prefix)]
    for i in range(args.requests):
        toks = prefix + [rng.randint(3, 999) for _ in range(args.own)]
        sched.add_request(vc.make_request(f"r{i}", toks, decode_room, args.block_size))

    def step():
        t = time.perf_counter()
        out = sched.schedule()
        dt = time.perf_counter() - t
        sched.update_from_output(out, vc.model_output(out, rng, 0))
        return out, dt

    # prefill, chunked, until every request decodes one token a step
    while True:
        out, _ = step()
        if len(out.num_scheduled_tokens) == args.requests and \
                all(n == 1 for n in out.num_scheduled_tokens.values()):
            break
    print(f"READY {os.getpid()} entries {entries(sched, out)}", file=sys.stderr, flush=True)
    for line in sys.stdin:
        n = int(line.split()[0]) if line.split() else 1
        us, ent = [], []
        for _ in range(n):
            out, dt = step()
            us.append(round(dt * 1e6, 1))
            ent.append(entries(sched, out))
        print(json.dumps({"schedule_us": us, "entries": ent,
                          "requests": len(out.num_scheduled_tokens)}), flush=True)


if __name__ == "__main__":
    main()
