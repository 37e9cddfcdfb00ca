"""A process that runs vLLM's real scheduler with no model, step after step,
the kvtrace plugin loaded as vLLM would load it: a target for the tracer's
tests of what the plugin tells it (tests/test_e2e_plugin.py).

    vllm_scheduler_loop.py --model DIR [--version X] [--remove CLASS.METHOD]

--version makes vLLM report release X (one outside the tested matrix);
--remove deletes a method the plugin's hooks need (a layout it refuses).
Prints "READY <pid>" once the scheduler is built, then schedules requests
(prefix hits, evictions) until its stdin is closed.  Run with vLLM's python.
"""

import argparse
import os
import random
import select
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_conformance as vc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--version")
    ap.add_argument("--remove")
    a = ap.parse_args()
    import vllm
    if a.version:
        vllm.__version__ = a.version
    if a.remove:
        import importlib
        cls, meth = a.remove.split(".")
        mods = {"BlockPool": "vllm.v1.core.block_pool",
                "Scheduler": "vllm.v1.core.sched.scheduler",
                "KVCacheManager": "vllm.v1.core.kv_cache_manager"}
        delattr(getattr(importlib.import_module(mods[cls]), cls), meth)
    import kvtrace_vllm
    kvtrace_vllm.register()  # as vLLM's plugin loader does
    sc = vc.scenario("full-16")
    sched = vc.make_scheduler(a.model, sc)
    print("READY", os.getpid(), flush=True)
    rng = random.Random(1)
    prefix = [rng.randint(3, 999) for _ in range(48)]
    n = 0
    while True:
        if select.select([sys.stdin], [], [], 0.02)[0] and not sys.stdin.readline():
            return
        if len(sched.requests) < 4:
            toks = prefix[:rng.randint(16, 48)] + [rng.randint(3, 999) for _ in range(20)]
            sched.add_request(vc.make_request(f"loop-{n}", toks, rng.randint(1, 16), 16))
            n += 1
        out = sched.schedule()
        sched.update_from_output(out, vc.model_output(out, rng, 0))


if __name__ == "__main__":
    main()
