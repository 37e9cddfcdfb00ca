#!/usr/bin/env python3
"""Send token-id completion requests to a local vLLM server (vllm-serve.sh)
and print what it generated as JSON: [{"prompt_len", "generated"}].

Greedy sampling, ignore_eos: the number of tokens generated is max_tokens.
Only the standard library: it runs with any python3.

usage: vllm-request.py [--port 8000] [--requests 100:8,40:3] [--seed 0]
"""
import argparse
import json
import random
import time
import urllib.error
import urllib.request


def wait_ready(base, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"vllm-request: no server at {base} after {timeout}s")
        time.sleep(0.5)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--requests", default="100:8,40:8,7:3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--wait", type=float, default=0, metavar="S",
                   help="wait up to S seconds for the server to be healthy")
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    if args.wait:
        wait_ready(base, args.wait)
    rng = random.Random(args.seed)
    results = []
    for item in args.requests.split(","):
        plen, _, gen = item.partition(":")
        prompt = [rng.randrange(3, args.vocab) for _ in range(int(plen))]
        body = {"model": None, "prompt": prompt, "max_tokens": int(gen or 8),
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            body["model"] = json.load(r)["data"][0]["id"]
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.load(r)["choices"][0]
        results.append({"prompt_len": len(prompt), "generated": choice["token_ids"]})
    print(json.dumps({"requests": results}))


if __name__ == "__main__":
    main()
