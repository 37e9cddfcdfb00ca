"""The tracer's memory at production size, for bench/run.py's row 11.

Loads the tracer's program at its default sizes (bpf/kvtrace.h
KVTRACE_MAX_*), attaches it to PROCS paused kvsim processes of
LAYERS / PROCS layers each over a pool of BLOCKS blocks, runs them, reads
the counters once a second as attach's refresh does, and prints one JSON
line: the BPF maps' bytes (the kernel's memlock figure of each map the
tracer holds), this process's RSS before the load, after it, and at its
most while the counters were read, and whether the counts were exact.

    python bench/memory_probe.py PROCS LAYERS BLOCKS
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KVSIM = ROOT / "tests" / "target" / "kvsim"


def rss_mb(field="VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def map_bytes() -> dict:
    """memlock of each BPF map this process holds, by map name."""
    out = {}
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            info = dict(line.split(":\t", 1) for line in
                        open(f"/proc/self/fdinfo/{fd}").read().splitlines() if ":\t" in line)
        except OSError:
            continue
        if "map_type" in info and "memlock" in info:
            name = f"{info.get('map_id', fd).strip()}"
            out[name] = int(info["memlock"])
    return out


def main():
    procs, layers, blocks = map(int, sys.argv[1:4])
    from tracer.commands.attach import _aggregate
    from tracer.kernel.session import Tracer
    from tracer.probes import discover

    before = rss_mb()
    sims = []
    tracer = None
    try:
        for i in range(procs):
            p = subprocess.Popen([KVSIM, "--workload", "default", "--layers",
                                  str(layers // procs), "--blocks", str(blocks), "--pause",
                                  "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
            sims.append(p)
            p.stderr.readline()  # "paused"
        tracer = Tracer()
        loaded = rss_mb()
        maps = map_bytes()
        for p in sims:
            tracer.attach(p.pid, discover.process_probe_files(p.pid, stock=False))
        for p in sims:
            os.kill(p.pid, signal.SIGUSR1)
        peak = loaded
        while any(p.poll() is None for p in sims):
            tracer.poll(1000)
            _aggregate(tracer)
            peak = max(peak, rss_mb())
        tracer.detach()
        tracer.drain()
        doc = _aggregate(tracer).to_json()
        peak = max(peak, rss_mb())
        print(json.dumps({
            "procs": procs, "layers": layers, "blocks": blocks,
            "max_blocks": tracer.max_blocks, "max_layers": tracer.max_caches,
            "max_procs": tracer.max_procs,
            "map_bytes": sum(maps.values()), "maps": len(maps),
            "rss_before_mb": before, "rss_loaded_mb": loaded, "rss_peak_mb": peak,
            "hwm_mb": rss_mb("VmHWM"), "exact": doc["exact"],
            "status": [p.returncode for p in sims]}))
    finally:
        if tracer is not None:
            tracer.close()
        for p in sims:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
