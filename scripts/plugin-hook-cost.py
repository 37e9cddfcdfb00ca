#!/usr/bin/env python3
"""What each hook costs with no tracer attached, in ns per call.

Each hook's wrapper factory (kvtrace_vllm.hooks) wraps a trivial function of
the wrapped method's arity; the cost is the wrapped call minus the plain
call, best of 7 runs of 1,000,000 calls.  Run with vLLM's python, without
KVTRACE_PLUGIN_RECORD (which turns every probe on) and with no tracer:

    .venv-vllm/bin/python scripts/plugin-hook-cost.py
"""
import os
import sys
import timeit

if os.environ.get("KVTRACE_PLUGIN_RECORD"):
    sys.exit("unset KVTRACE_PLUGIN_RECORD: it turns every probe on")

from kvtrace_vllm import hooks  # noqa: E402

hooks.load_probes()  # the semaphores the wrappers check; vLLM's classes untouched

N, REPEAT = (200_000, 3) if "--quick" in sys.argv[1:] else (1_000_000, 7)


def f1(self, a):
    return a


def f7(self, a, b, c, d, e, g, h=None):
    return a


class Obj:
    kv_cache_group_id = 0
    block_pool = None
    request_id = "r"
    requests = {}


o = Obj()
CASES = [
    ("Scheduler.schedule", hooks._schedule, f1, "w(o, 1)"),
    ("Scheduler.add_request", hooks._add_request, f1, "w(o, o)"),
    ("Scheduler._preempt_request", hooks._preempt_request, f1, "w(o, o)"),
    ("Scheduler._free_request", hooks._free_request, f1, "w(o, o)"),
    ("KVCacheManager.allocate_slots", hooks._allocate_slots, f1, "w(o, o)"),
    ("KVCacheManager.free / pop_blocks_for_free", hooks._free, f1, "w(o, o)"),
    ("SingleTypeKVCacheManager.<group methods>", hooks._group_scope, f1, "w(o, 1)"),
    ("BlockPool.get_new_blocks", hooks._get_new_blocks, f1, "w(o, 1)"),
    ("BlockPool.touch", hooks._touch, f1, "w(o, 1)"),
    ("BlockPool._maybe_evict_cached_block", hooks._maybe_evict_cached_block, f1, "w(o, 1)"),
    ("BlockPool.cache_full_blocks", hooks._cache_full_blocks, f7, "w(o, 1, 2, 3, 4, 5, 6)"),
]


def best(stmt, g):
    return min(timeit.repeat(stmt, globals=g, number=N, repeat=REPEAT)) / N * 1e9


def _step(rows, blocks):
    """fire_block_tables and its arguments for one step of `rows` decoding
    requests of `blocks` blocks each (the scheduler's objects stubbed)."""
    import types

    rids = [f"req-{i}-0123abcd" for i in range(rows)]
    owners = {r: [types.SimpleNamespace(block_id=1 + i * blocks + j) for j in range(blocks)]
              for i, r in enumerate(rids)}
    manager = types.SimpleNamespace(
        block_pool=types.SimpleNamespace(num_gpu_blocks=rows * blocks + 1),
        coordinator=types.SimpleNamespace(single_type_managers=[
            types.SimpleNamespace(kv_cache_group_id=0, block_size=16, req_to_blocks=owners)]))
    sched = types.SimpleNamespace(kv_cache_manager=manager)
    out = types.SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=rids,
                                                    num_computed_tokens=[200] * rows),
        num_scheduled_tokens=dict.fromkeys(rids, 1))
    return {"f": hooks.fire_block_tables, "sched": sched, "out": out}


def per_row_ns(rows=64, blocks=16):
    """The Python side of a traced step: fire_block_tables for one step of
    `rows` decoding requests of `blocks` blocks, with block_table alone,
    then step_reqs as well; ns per row.  The probes are the real C
    functions; with no tracer their USDT sites are nops, so the trap and
    the BPF program are not included."""
    g = _step(rows, blocks)
    on, off = (memoryview(bytearray(v)).cast("H") for v in (b"\x01\x00", b"\x00\x00"))
    saved, n = hooks.SEM, max(N // 500, 200)
    try:
        got = {}
        for name, sr in (("block_table", off), ("step_reqs", on)):
            hooks.SEM = {**saved, "block_table": on, "step_reqs": sr}
            got[name] = min(timeit.repeat("f(sched, out)", number=n, repeat=REPEAT,
                                          globals=g)) / n * 1e9
    finally:
        hooks.SEM = saved
    return {"block_table_ns_per_row": round(got["block_table"] / rows, 1),
            "step_reqs_ns_per_row": round((got["step_reqs"] - got["block_table"]) / rows, 1)}


def cold_step_us(rows=8, blocks=4, steps=300):
    """One traced step's Python side (step_reqs and block_table) as the
    scheduler runs it: once a step, after the worker's compute has evicted
    the CPU caches (here: a 64 MiB pass between calls); the median, us."""
    import time
    g = _step(rows, blocks)
    evict = bytearray(64 << 20)
    on = memoryview(bytearray(b"\x01\x00")).cast("H")
    saved, took = hooks.SEM, []
    try:
        hooks.SEM = {**saved, "block_table": on, "step_reqs": on}
        f, sched, out = g["f"], g["sched"], g["out"]
        for _ in range(steps):
            evict[::64] = bytes(len(evict) // 64)  # touches every cache line
            t = time.perf_counter()
            f(sched, out)
            took.append(time.perf_counter() - t)
    finally:
        hooks.SEM = saved
    took.sort()
    return {"cold_step_us": round(took[len(took) // 2] * 1e6, 1), "cold_step_rows": rows}


def main():
    as_json = "--json" in sys.argv[1:]
    on = [n for n, v in hooks.SEM.items() if v[0]]
    if on:
        print(f"warning: probes enabled now (a tracer is attached?): {', '.join(on)}")
    if not as_json:
        print(f"{'hook':45s} {'plain ns':>9s} {'wrapped ns':>11s} {'cost ns':>8s}")
    costs = {}
    for name, factory, fn, call in CASES:
        w = factory(fn)
        stmt = call
        plain = best(stmt.replace("w(", "fn("), {"fn": fn, "o": o})
        wrapped = best(stmt, {"w": w, "o": o})
        costs[name] = round(wrapped - plain, 1)
        if not as_json:
            print(f"{name:45s} {plain:9.1f} {wrapped:11.1f} {wrapped - plain:8.1f}")
    sem = best("s[0]", {"s": hooks.SEM["block_alloc"]})
    rows = per_row_ns()
    cold = cold_step_us()
    if as_json:  # for make bench (bench/run.py, row 10)
        import json
        print(json.dumps({"hook_ns": costs, "semaphore_read_ns": round(sem, 1), **rows,
                          **cold}))
    else:
        print(f"semaphore read alone: {sem:.1f} ns (loop included: {best('pass', {}):.1f} ns)")
        print(f"probes on, per row of a 64-row step: block_table "
              f"{rows['block_table_ns_per_row']:.0f} ns, step_reqs "
              f"{rows['step_reqs_ns_per_row']:.0f} ns more")
        print(f"probes on, a step of {cold['cold_step_rows']} rows with cold caches: "
              f"{cold['cold_step_us']:.1f} us")


if __name__ == "__main__":
    main()
