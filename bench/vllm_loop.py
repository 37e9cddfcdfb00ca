#!/usr/bin/env python3
"""One warm vLLM for the bench's vLLM rows: generate a fixed batch on demand.

The engine is built once (30-50 s here); then every line read on stdin
generates the batch --repeat times and prints one JSON line on stdout with
generate_s and generated_tokens.  The bench attaches and detaches the tracer
between batches, so untraced, traced and calls-only batches alternate in one
process, side by side, with the same warm engine.  EOF on stdin ends it.

The engine is configured as scripts/vllm-workload.py configures it (tiny
dummy-weight model, token-id prompts, greedy sampling, eager mode), and,
as there, vLLM's queue readers nap instead of spinning on sched_yield
(--busy-wait keeps vLLM's way): on a 2-CPU machine the engine core's spin
takes the CPU the tracer needs, and a batch's time then measures how the
kernel shares that CPU, not what tracing costs.

Run it with the vLLM venv's python:
  .venv-vllm/bin/python bench/vllm_loop.py --model build/tiny-llama
"""
import argparse
import importlib.util
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workload():
    """scripts/vllm-workload.py as a module (its name has a hyphen)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_workload", os.path.join(ROOT, "scripts", "vllm-workload.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=8, help="requests per batch")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=1, help="batches per line read")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--busy-wait", action="store_true",
                   help="keep vLLM's sched_yield loops (default: nap 100 us a turn)")
    args = p.parse_args()
    workload = _workload()
    if args.busy_wait:
        os.environ[workload.BUSY_WAIT_ENV] = "1"  # for the engine core and worker too
    workload.no_busy_wait()

    from vllm import LLM, SamplingParams

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              block_size=args.block_size, enforce_eager=True, max_model_len=512,
              enable_prefix_caching=False, seed=args.seed,
              kv_cache_memory_bytes=64 << 20)
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, config["vocab_size"])
                                     for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, not measured
    print(f"READY {os.getpid()}", file=sys.stderr, flush=True)

    for _ in sys.stdin:
        tokens, each = 0, []
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            t = time.perf_counter()
            for out in llm.generate(prompts, params, use_tqdm=False):
                tokens += len(out.outputs[0].token_ids)
            each.append(round(time.perf_counter() - t, 4))
        dt = time.perf_counter() - t0
        # each: every repetition's own time (the first after an idle spell
        # is the slow one)
        print(json.dumps({"generate_s": round(dt, 4), "generated_tokens": tokens,
                          "each_s": each}), flush=True)


if __name__ == "__main__":  # vLLM's worker processes re-import this file
    main()
if __name__ == "__mp_main__":  # in the engine core and the worker, as in main
    _workload().no_busy_wait()
