#!/usr/bin/env python3
"""A fixed offline vLLM workload on the tiny model: the real target.

Runs LLM.generate on token-id prompts (no tokenizer, dummy weights) with
greedy sampling, and prints what vLLM generated as one JSON object on the
last line of stdout (and to --out): per request, the prompt length and the
generated token ids.  The tests compute the expected KV-cache writes from
that alone (docs/stock-vllm.md), never from the tracer.

With --wait, it builds the engine, prints "READY <pid>" to stderr and waits
for SIGUSR1 before generating, so that a tracer can attach in between.

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

    if args.wait:  # block them before vLLM starts threads: sigwait needs that
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})

    from vllm import LLM, SamplingParams

    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    t0 = time.time()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              block_size=args.block_size, enforce_eager=True, max_model_len=512,
              enable_prefix_caching=args.prefix_caching == "on", seed=args.seed,
              kv_cache_memory_bytes=args.kv_cache_bytes)
    t_init = time.time() - t0

    rng = random.Random(args.seed)
    vocab = config["vocab_size"]
    requests = parse_requests(args.requests)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(plen)]}
               for plen, _ in requests]
    params = [SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, detokenize=False)
              for _, gen in requests]

    if args.wait:
        print(f"READY {os.getpid()}", file=sys.stderr, flush=True)
    for round_no in range(1, max(1, args.rounds) + 1):
        if args.wait:
            signal.sigwait({signal.SIGUSR1})
        generate_round(llm, prompts, params, args, config, t_init, round_no)
        if args.rounds > 1:
            print(f"ROUND {round_no} DONE", file=sys.stderr, flush=True)


def stop_requested() -> bool:
    """--until-stopped: SIGUSR2 arrived (it stays pending, blocked, until
    taken here, whichever thread it was sent to)."""
    if signal.SIGUSR2 not in signal.sigpending():
        return False
    signal.sigwait({signal.SIGUSR2})
    return True


def generate_round(llm, prompts, params, args, config, t_init, round_no=1):
    results = []
    t1 = time.time()
    batches = 0
    while True:
        for out in llm.generate(prompts, params, use_tqdm=False):
            results.append({"prompt_len": len(out.prompt_token_ids),
                            "generated": list(out.outputs[0].token_ids)})
        batches += 1
        if args.wait and args.until_stopped:
            # an event for a test: a whole batch went through the engine
            print(f"ROUND {round_no} BATCH {batches}", file=sys.stderr, flush=True)
            if stop_requested():
                break
        elif batches >= args.repeat:
            break
    t_gen = time.time() - t1
    doc = {"pid": os.getpid(), "block_size": args.block_size,
           "num_layers": config["num_hidden_layers"],
           "prefix_caching": args.prefix_caching == "on", "seed": args.seed,
           "init_s": round(t_init, 3), "generate_s": round(t_gen, 3),
           "batches": batches,
           "generated_tokens": sum(len(r["generated"]) for r in results),
           "requests": results}
    line = json.dumps(doc)
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":  # vLLM's worker processes re-import this file
    main()
