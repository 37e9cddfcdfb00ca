#!/usr/bin/env python3
"""What each hook costs with no tracer attached, in ns per call.

Each hook's wrapper factory (kvtrace_vllm.hooks) wraps a trivial function of
the wrapped method's arity; the cost is the wrapped call minus the plain
call, best of 7 runs of 1,000,000 calls.  Run with vLLM's python, without
KVTRACE_PLUGIN_RECORD (which turns every probe on) and with no tracer:

    .venv-vllm/bin/python scripts/plugin-hook-cost.py

--grid: instead, a traced step's Python side (fire_block_tables) at 8x4,
64x64, 256x128, 256x512 and 1024x256 rows x blocks, the whole tables
(step_reqs + block_table, --verify-rows) against the deltas (step_rows):
us a step and ns a row, with no tracer and with one attached (`attach -q
-p` this process, --verify-rows, no -o; needs root and the tracer's venv,
--tracer-python, default .venv/bin/python).  A decode step: each row
gains a block every 16 steps; the deltas' first step (every row whole) is
left out.  --json: one JSON object.
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


GRID = ((8, 4), (64, 64), (256, 128), (256, 512), (1024, 256))
GROW_EVERY = 16  # a decode step fills one token of a 16-token block


def grid_step(rows, blocks):
    """_step()'s objects, with room to grow the rows as decoding does."""
    import types

    g = _step(rows, blocks)
    owners = g["sched"].kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    g["rows"] = list(owners.values())
    g["next_id"] = rows * blocks + 1
    g["new"] = types.SimpleNamespace
    return g


def grow(g, k):
    """Step k's new blocks: rows i with i = k (mod GROW_EVERY) gain one."""
    for row in g["rows"][k % GROW_EVERY::GROW_EVERY]:
        row.append(g["new"](block_id=g["next_id"]))
        g["next_id"] += 1


def step_us(rows, blocks, mode, steps):
    """The median of `steps` decode steps' fire_block_tables, us: mode
    "tables" fires step_reqs + block_table, "deltas" step_rows."""
    import time
    g = grid_step(rows, blocks)
    on, off = (memoryview(bytearray(v)).cast("H") for v in (b"\x01\x00", b"\x00\x00"))
    tables = on if mode == "tables" else off
    saved, took = hooks.SEM, []
    try:
        hooks.SEM = {**saved, "block_table": tables, "step_reqs": tables,
                     "step_rows": off if mode == "tables" else on}
        hooks.REPORTED.clear()
        f, sched, out = hooks.fire_block_tables, g["sched"], g["out"]
        f(sched, out)  # the deltas' first step sends every row whole
        for k in range(steps):
            grow(g, k)
            t = time.perf_counter()
            f(sched, out)
            took.append(time.perf_counter() - t)
    finally:
        hooks.SEM = saved
        hooks.REPORTED.clear()
    took.sort()
    return took[len(took) // 2] * 1e6


def attach_self(tracer_python):
    """`kvtrace-bpf attach -q -p` this process, --verify-rows: (the
    process, None) once its probes are attached, or (None, why not)."""
    import subprocess
    import time
    if os.geteuid() != 0:
        return None, "not root"
    if not os.path.exists(tracer_python):
        return None, f"no {tracer_python}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([tracer_python, "-m", "tracer.cli", "attach", "-q", "-p",
                          str(os.getpid()), "--verify-rows"], cwd=root,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    from kvtrace_vllm import _probes
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if all(_probes.enabled(n) for n in ("step_rows", "block_table", "step_reqs")):
            return p, None
        time.sleep(0.2)
    p.kill()
    return None, "the tracer did not attach: " + (p.communicate()[1] or "")[-300:]


def grid(tracer_python, quick):
    """{f"{rows}x{blocks}": {untraced|traced: {tables_us, deltas_us}}}"""
    import signal
    steps = 9 if quick else 31
    out = {f"{r}x{b}": {} for r, b in GRID}

    def run(label):
        for r, b in GRID:
            out[f"{r}x{b}"][label] = {m + "_us": round(step_us(r, b, m, steps), 1)
                                      for m in ("tables", "deltas")}
    run("untraced")
    tracer, why = attach_self(tracer_python)
    if tracer is None:
        return out, why
    try:
        run("traced")
    finally:
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.wait(60)
        except Exception:  # noqa: BLE001 - it is ended either way
            tracer.kill()
    return out, None


def print_grid(out, why):
    print(f"{'rows x blocks':>13s} {'entries':>8s} {'mode':>9s} {'tables us':>10s} "
          f"{'deltas us':>10s} {'tables ns/row':>14s} {'deltas ns/row':>14s}")
    for (r, b) in GRID:
        for label, t in out[f"{r}x{b}"].items():
            print(f"{f'{r}x{b}':>13s} {r * b:8d} {label:>9s} {t['tables_us']:10.1f} "
                  f"{t['deltas_us']:10.1f} {t['tables_us'] * 1e3 / r:14.0f} "
                  f"{t['deltas_us'] * 1e3 / r:14.0f}")
    if why:
        print(f"traced: skipped ({why})")


def main():
    as_json = "--json" in sys.argv[1:]
    if "--grid" in sys.argv[1:]:
        args = sys.argv[1:]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tp = args[args.index("--tracer-python") + 1] if "--tracer-python" in args else \
            os.path.join(root, ".venv", "bin", "python")
        out, why = grid(tp, "--quick" in args)
        if as_json:
            import json
            print(json.dumps({"grid": out, "traced_skipped": why}))
        else:
            print_grid(out, why)
        return
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
