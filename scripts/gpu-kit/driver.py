#!/usr/bin/env python3
"""driver.py - the GPU kit's run (scripts/gpu-kit/README.md): the fork's
cache ops traced by kvtrace-bpf, against the driver's own ground truth.

    python3 scripts/gpu-kit/driver.py [--kit DIR] [--cpu] [--replays N] [--out DIR]

Without --child it is the outer run: it mounts tracefs if needed, unpacks the
kit's wheels that fit this Python, and runs `kvtrace-bpf attach --json`
(the tracer of this checkout, loading the kit's compiled BPF program through
KVTRACE_PROGRAM_ENTRY with the kit's libbcc_bpf) on itself with --child.
The child writes known slot mappings through the kit's ops: eagerly (two
layers, three steps, padding included), one block copy and one swap out,
then, on a GPU, as a captured CUDA graph replayed N times.  It records what
it did (truth.json) and checks on the GPU that the writes and the replays
happened (cache values, a counter inside the graph).  The outer run then
prints the tracer's per-block counts beside that truth and one verdict line.

Expected on a GPU: every eager launch counted exactly; the graph's replays
not seen by the op tier (a replay runs no host code: docs/fork.md, "CUDA
graphs"), which is what this shows, not a failure.  --cpu runs the same
probe sites with host memory (no CUDA call is made) and no graph.

Exit codes: 0 the verdict holds, 1 it does not (or a step failed), 2 usage.
--compile-entry (scripts/gpu-kit/build.sh) compiles the program with bcc
into the kit instead of loading the kit's entry, with the same attach flags.
"""
import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NB, BS, H, D = 64, 16, 4, 32           # blocks, block size, heads, head size
LAYERS = 2
# (slots) per eager step, every layer alike, as vLLM writes: a prefill of 40
# tokens with 2 padding slots, a decode of 2 requests, and 7 tokens in block 9
EAGER_STEPS = [list(range(40)) + [-1, -1], [40, 5 * BS + 3], list(range(9 * BS, 9 * BS + 7))]
COPY_PAIRS = [[0, 10], [1, 11]]        # layer 0's key cache, device to device
SWAP_PAIRS = [[2, 0]]                  # layer 0's key cache block 2 -> host block 0
GRAPH_SLOTS = [48, 49, 50, 51]         # block 3: the captured decode step
BLOCK_BYTES = BS * H * D * 4
ATTACH = ["attach", "-q"]              # the flags the kit's entry is compiled for


def dense(pairs, n):
    out = [0] * n
    for block, count in pairs:
        out[block] = count
    return out


def per_block(steps):
    out = [0] * NB
    for slots in steps:
        for s in slots:
            if s >= 0:
                out[s // BS] += 1
    return out


# -- the child: the ops, and the truth --------------------------------------

def child(args):
    lib = ctypes.CDLL(str(Path(args.kit) / "libkvtrace_kit_ops.so"))
    lib.kit_reshape_and_cache_flash.argtypes = [
        ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_int64, ctypes.c_int,
                                                      ctypes.c_void_p]
    lib.kit_swap_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_int64, ctypes.c_void_p] + \
        [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p]
    deadline = time.monotonic() + 60
    while not lib.kit_probes_attached():  # the tracer rescans every 0.25 s
        if args.traced and time.monotonic() > deadline:
            print("driver: the tracer did not attach within 60 s", file=sys.stderr)
            return 1
        if not args.traced:
            break
        time.sleep(0.05)
    row = H * D
    truth = dict(pid=os.getpid(), num_blocks=NB, block_size=BS, gpu=not args.cpu,
                 replays=0, checks={})
    if args.cpu:
        caches = [((ctypes.c_float * (NB * BS * row))(), (ctypes.c_float * (NB * BS * row))())
                  for _ in range(LAYERS)]
        host = (ctypes.c_float * (4 * BS * row))()

        def ptr(x):
            return ctypes.addressof(x)

        def write(layer, slots, fill):
            n = len(slots)
            idx = (ctypes.c_int64 * n)(*slots)
            kv = (ctypes.c_float * (n * row))(*([fill] * (n * row)))
            rc = lib.kit_reshape_and_cache_flash(ptr(kv), ptr(kv), ptr(caches[layer][0]),
                                                 ptr(caches[layer][1]), ptr(idx), n, H, D,
                                                 BS, NB, 0, None)
            assert rc == 0, rc

        def swap(kind, src, dst, pairs):
            bm = (ctypes.c_int64 * (2 * len(pairs)))(*sum(pairs, []))
            assert lib.kit_swap_blocks(kind, src, dst, BLOCK_BYTES, ptr(bm), len(pairs),
                                       2, 1, 0, None) == 0

        def value(layer, slot):
            return caches[layer][0][slot * row]
    else:
        import torch
        dev = torch.device("cuda")
        caches = [(torch.zeros(NB, BS, H, D, device=dev), torch.zeros(NB, BS, H, D, device=dev))
                  for _ in range(LAYERS)]
        host = torch.zeros(4, BS, H, D).pin_memory()

        def ptr(x):
            return x.data_ptr()

        def stream():
            return torch.cuda.current_stream().cuda_stream

        def launch(layer, idx, kv):
            rc = lib.kit_reshape_and_cache_flash(ptr(kv), ptr(kv), ptr(caches[layer][0]),
                                                 ptr(caches[layer][1]), ptr(idx), idx.numel(),
                                                 H, D, BS, NB, 1, stream())
            assert rc == 0, f"launch: cudaError {rc}"

        def write(layer, slots, fill):
            idx = torch.tensor(slots, dtype=torch.int64, device=dev)
            launch(layer, idx, torch.full((len(slots), H, D), fill, device=dev))

        def swap(kind, src, dst, pairs):
            bm = torch.tensor(pairs, dtype=torch.int64)
            assert lib.kit_swap_blocks(kind, src, dst, BLOCK_BYTES, ptr(bm), len(pairs),
                                       bm.stride(0), bm.stride(1), 1, stream()) == 0
            torch.cuda.current_stream().synchronize()

        def value(layer, slot):
            return caches[layer][0].view(-1, row)[slot, 0].item()

    # eager: every launch's host code runs, and with it the probe site
    for step, slots in enumerate(EAGER_STEPS):
        for layer in range(LAYERS):
            write(layer, slots, float(10 * step + layer + 1))
    swap(0, ptr(caches[0][0]), ptr(caches[0][0]), COPY_PAIRS)
    swap(1, ptr(caches[0][0]), ptr(host), SWAP_PAIRS)
    eager_ok = all(value(layer, s) == float(10 * step + layer + 1)
                   for step, slots in enumerate(EAGER_STEPS) for layer in range(LAYERS)
                   for s in slots if s >= 0)
    copied_ok = value(0, 10 * BS) == value(0, 0) and value(0, 11 * BS + 5) == value(0, BS + 5)
    truth["checks"].update(eager_values=eager_ok, copy_values=copied_ok)

    graph = [0] * NB
    if not args.cpu:
        import torch
        idx = torch.tensor(GRAPH_SLOTS, dtype=torch.int64, device=dev)
        kv = torch.zeros(len(GRAPH_SLOTS), H, D, device=dev)
        counter = torch.zeros(1, dtype=torch.int64, device=dev)
        side = torch.cuda.Stream()  # warm up the counter's op outside the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            counter.add_(0)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # the site sees a capturing stream and fires nothing
            for layer in range(LAYERS):
                launch(layer, idx, kv)
            counter.add_(1)
        for i in range(args.replays):
            kv.fill_(float(1000 + i))
            g.replay()
        torch.cuda.synchronize()
        truth["replays"] = int(counter.item())
        truth["checks"]["graph_values"] = all(
            value(layer, s) == float(1000 + args.replays - 1)
            for layer in range(LAYERS) for s in GRAPH_SLOTS)
        truth["checks"]["graph_replays"] = truth["replays"] == args.replays
        graph = [truth["replays"] * c for c in per_block([GRAPH_SLOTS])]

    eager = per_block(EAGER_STEPS)
    truth["layers"] = [dict(layer=layer, cache_id=ptr(caches[layer][0]), eager_writes=eager,
                            graph_writes=graph) for layer in range(LAYERS)]
    n_slots = sum(eager)
    n_pad = sum(s < 0 for slots in EAGER_STEPS for s in slots)
    truth["ops"] = {
        "reshape_and_cache_flash": dict(
            calls=len(EAGER_STEPS) * LAYERS, slots=n_slots * LAYERS, padding=n_pad * LAYERS,
            graph_launches=truth["replays"] * LAYERS,
            graph_slots=truth["replays"] * LAYERS * len(GRAPH_SLOTS)),
        "copy_blocks": dict(calls=1, items=len(COPY_PAIRS), bytes=len(COPY_PAIRS) * BLOCK_BYTES),
        "swap_blocks": dict(calls=1, items=len(SWAP_PAIRS), bytes=len(SWAP_PAIRS) * BLOCK_BYTES),
    }
    truth["blocks"] = dict(copy_src=per_block([[p[0] * BS for p in COPY_PAIRS]]),
                           copy_dst=per_block([[p[1] * BS for p in COPY_PAIRS]]),
                           swap_out=per_block([[p[0] * BS for p in SWAP_PAIRS]]))
    Path(args.truth).write_text(json.dumps(truth))
    return 0 if all(truth["checks"].values()) else 1


# -- the outer run --------------------------------------------------------------

def mount_tracefs():
    path = "/sys/kernel/tracing"
    if os.path.ismount(path):
        return "tracefs: mounted"
    r = subprocess.run(["mount", "-t", "tracefs", "nodev", path], capture_output=True, text=True)
    return ("tracefs: mounted now" if r.returncode == 0 else
            f"tracefs: could not mount ({r.stderr.strip()}); the tracer does not need it")


def unpack_wheels(kit: Path, site: Path) -> list:
    """The kit's wheels that fit this Python (pure ones, or this cpXY), unpacked
    into site: pip is not needed, and none is fetched."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    used = []
    for whl in sorted((kit / "wheels").glob("*.whl")):
        py = whl.name.split("-")[-3]
        if py.startswith("py3") or tag in py.split("."):
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
            used.append(whl.name)
    return used


def compare(doc, truth) -> tuple:
    """(problems, lines): the trace against the truth, and the table."""
    problems, lines = [], []
    if not doc.get("exact"):
        problems.append(f"trace not exact: {doc.get('inexact_reasons')}")
    procs = [p for p in doc.get("processes", []) if p["pid"] == truth["pid"]]
    if not procs:
        return problems + [f"no traced process {truth['pid']}"], lines
    proc = procs[0]
    got_layers = {l["cache_id"]: l for l in proc["layers"]}
    lines.append(f"{'':22}{'block':>6}{'eager (truth)':>15}{'graph (truth)':>15}"
                 f"{'traced':>8}")
    for want in truth["layers"]:
        got = got_layers.get(want["cache_id"])
        if got is None:
            problems.append(f"layer {want['layer']}: not traced")
            continue
        if (got["block_size"], got["num_blocks"]) != (truth["block_size"], truth["num_blocks"]):
            problems.append(f"layer {want['layer']}: geometry {got['block_size']}x"
                            f"{got['num_blocks']}")
        traced = dense(got["writes"], truth["num_blocks"])
        for b in range(truth["num_blocks"]):
            e, g, t = want["eager_writes"][b], want["graph_writes"][b], traced[b]
            if e or g or t:
                lines.append(f"  layer {want['layer']} writes      {b:>6}{e:>15}{g:>15}{t:>8}")
        if traced != want["eager_writes"]:
            problems.append(f"layer {want['layer']}: traced writes differ from the eager truth")
    lines.append(f"{'':22}{'op':>6}{'calls (truth)':>15}{'traced':>15}")
    for op, want in truth["ops"].items():
        got = doc["ops"].get(op, {})
        lines.append(f"  {op:<26}{want['calls']:>11}{got.get('calls', 0):>15}")
        for k in ("calls", "slots", "padding", "items", "bytes"):
            if k in want and got.get(k, 0) != want[k]:
                problems.append(f"{op}: {k} traced {got.get(k, 0)}, truth {want[k]}")
    for kind, want in truth["blocks"].items():
        got = dense(proc["blocks"][kind], truth["num_blocks"])
        lines.append(f"  {kind:<10} blocks (truth) {[b for b, c in enumerate(want) if c]}"
                     f" traced {[b for b, c in enumerate(got) if c]}")
        if got != want:
            problems.append(f"{kind}: traced {proc['blocks'][kind]}")
    return problems, lines


def outer(args) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # in order with the tracer's stderr
    kit = Path(args.kit).resolve()
    out = Path(args.out or tempfile.mkdtemp(prefix="kvtrace-kit-"))
    out.mkdir(parents=True, exist_ok=True)
    print(mount_tracefs())
    # not under out: the device tool brings back at most 8 files from $OUT
    site = Path(tempfile.mkdtemp(prefix="kvtrace-kit-site-"))
    print(f"wheels: {', '.join(unpack_wheels(kit, site)) or 'none fit'}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               LD_LIBRARY_PATH=os.pathsep.join(
                   p for p in [str(kit / "lib"), os.environ.get("LD_LIBRARY_PATH")] if p))
    if args.compile_entry:
        cache = out / "cache"
        cache.mkdir(mode=0o700, exist_ok=True)
        env.update(KVTRACE_CACHE_DIR=str(cache))
        env.pop("KVTRACE_PROGRAM_ENTRY", None)
    else:
        env.update(KVTRACE_PROGRAM_ENTRY=str(kit / "bpf-entry.json"), KVTRACE_CACHE_DIR="off")
    agg, truth_path = out / "agg.json", out / "truth.json"
    cmd = [sys.executable, "-m", "tracer.cli", *ATTACH, "--json", str(agg), "--",
           # the child gets this machine's own LD_LIBRARY_PATH back: the kit's
           # libraries are the tracer's, not torch's
           "/usr/bin/env"] + ([f"LD_LIBRARY_PATH={os.environ['LD_LIBRARY_PATH']}"]
                              if os.environ.get("LD_LIBRARY_PATH") else
                              ["-u", "LD_LIBRARY_PATH"]) + [
           sys.executable, str(Path(__file__).resolve()), "--child", "--traced", "--kit", str(kit),
           "--truth", str(truth_path), "--replays", str(args.replays)] + \
        (["--cpu"] if args.cpu else [])
    with open(out / "attach.log", "w") as log:  # the summary: agg.json has it all
        r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.PIPE,
                           text=True)
    shutil.rmtree(site, ignore_errors=True)
    sys.stderr.write(r.stderr)
    if r.returncode != 0 or not agg.exists() or not truth_path.exists():
        sys.stdout.write((out / "attach.log").read_text()[-3000:])
        print(f"verdict: FAIL: kvtrace-bpf attach exited {r.returncode}")
        return 1
    doc, truth = json.loads(agg.read_text()), json.loads(truth_path.read_text())
    if args.compile_entry:
        (entry,) = cache.glob("bpf-*.json")
        shutil.copyfile(entry, kit / "bpf-entry.json")
        print(f"entry: {kit / 'bpf-entry.json'}")
    problems, lines = compare(doc, truth)
    print("\n".join(lines))
    print(f"driver checks: {truth['checks']}")
    if doc.get("target_exit_status") != 0:
        problems.append(f"the child exited {doc.get('target_exit_status')}")
    if problems:
        print("verdict: FAIL: " + "; ".join(problems))
        return 1
    ops = truth["ops"]["reshape_and_cache_flash"]
    eager = (f"eager launches counted exactly ({ops['calls']} reshape_and_cache_flash calls, "
             f"{ops['slots']} slots, {ops['padding']} padding; 1 copy_blocks, 1 swap_blocks)")
    if truth["gpu"]:
        print(f"verdict: PASS on the GPU: {eager}; graph replays not seen by the op tier, "
              f"as expected ({truth['replays']} replays x {LAYERS} layers = "
              f"{ops['graph_launches']} launches, {ops['graph_slots']} slots written on the "
              f"GPU, 0 traced: docs/fork.md, \"CUDA graphs\")")
    else:
        print(f"verdict: PASS on the CPU path: {eager}; not run without a GPU: the "
              "device-to-host copy, the capture check, the kernel and the graph replays")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", default=str(ROOT / "build" / "gpu-kit"))
    ap.add_argument("--cpu", action="store_true", help="host memory, no CUDA call, no graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", help="where agg.json and truth.json go (default: a temp dir)")
    ap.add_argument("--compile-entry", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--truth", help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return child(args) if args.child else outer(args)


if __name__ == "__main__":
    sys.exit(main())
