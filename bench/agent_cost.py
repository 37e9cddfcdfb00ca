#!/usr/bin/env python3
"""The node agent's own cost: its CPU and memory with N engines traced.

    .venv/bin/python bench/agent_cost.py [--engines 1,4,8] [--seconds S] [--out FILE]

For each N: one agent (--include of this run's own directory, so that no
other process on the machine is traced), N kvsims started after it, each
paced (--step-delay-us) so that together they run for the whole window,
and Prometheus's scrape played by this process (one /metrics a second).
Over the window, measured when every kvsim is traced and running:

  - the agent's CPU seconds per second (schedstat: every thread, exact);
  - its RssAnon (its heap; VmRSS also counts the BPF arrays it mapped);
  - the BPF maps' memory it holds (fdinfo memlock, each map once), which
    --max-procs, --max-layers and --max-blocks fix at the start, whatever N.

Prints one line per N and writes the figures as JSON (default
bench/agent-results.json).  bench/run.py calls row() for its table.
Needs root and `make setup`.  Method: docs/bench.md.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVSIM = ROOT / "tests" / "target" / "kvsim"


def _kvtrace(*args):
    return [sys.executable, "-m", "tracer.cli", *map(str, args)]


def _read_until(stream, needle, timeout):
    import select

    deadline, buf = time.monotonic() + timeout, b""
    fd = stream.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            buf += data
            if needle.encode() in buf:
                return buf.decode(errors="replace")
    raise RuntimeError(f"no {needle!r} within {timeout}s: {buf[-2000:]!r}")


def _cpu_ns(pid):
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


def _rss_anon_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) / 1024


def _memlock_mb(pid):
    """Each map's memlock once, by map_id: the agent holds a map through
    several fds (its own, and one per mmap of it, which Python's mmap
    dups), and fdinfo shows the whole map's memlock on each."""
    maps = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                text = f.read()
        except OSError:
            continue
        if "map_type:" in text:
            info = dict(l.split(":", 1) for l in text.splitlines() if ":" in l)
            maps[int(info["map_id"])] = int(info["memlock"])
    return sum(maps.values()) / 2**20


def measure(n: int, seconds: float, tmp: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = subprocess.Popen(_kvtrace("agent", "--prometheus", port, "--include", tmp),
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sims = []
    try:
        _read_until(agent.stderr, "agent ready", 600)
        for i in range(n):
            # about 0.13 s of work per repetition unpaced; paced so that the
            # window ends before the run does
            sims.append(subprocess.Popen(
                [str(KVSIM), "--workload", "default", "--repeat", "100000",
                 "--step-delay-us", "5000", "--quiet", "--pause",
                 "--truth", os.path.join(tmp, f"truth-{n}-{i}.json")],
                stderr=subprocess.PIPE))
            _read_until(sims[-1].stderr, "paused", 10)
            _read_until(agent.stderr, f"tracing pid {sims[-1].pid} ", 60)
        for sim in sims:
            os.kill(sim.pid, signal.SIGUSR1)
        time.sleep(1.0)  # every engine past its first steps
        cpu0, t0 = _cpu_ns(agent.pid), time.monotonic()
        next_scrape, scrapes = t0, 0
        while time.monotonic() - t0 < seconds:
            if time.monotonic() >= next_scrape:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=10) as r:
                    r.read()
                scrapes += 1
                next_scrape += 1.0
            time.sleep(0.05)
        cpu1, t1 = _cpu_ns(agent.pid), time.monotonic()
        return {"engines": n, "seconds": round(t1 - t0, 2), "scrapes": scrapes,
                "agent_cpu_s_per_s": round((cpu1 - cpu0) / 1e9 / (t1 - t0), 4),
                "agent_rss_anon_mb": round(_rss_anon_mb(agent.pid), 1),
                "bpf_maps_mb": round(_memlock_mb(agent.pid), 1)}
    finally:
        for sim in sims:
            sim.kill()
            sim.wait()
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def row(engines=(1, 4, 8), seconds=10.0) -> list:
    """One dict per N: what bench/run.py puts in its table and JSON."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-agent-bench-") as tmp:
        return [measure(n, seconds, tmp) for n in engines]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,4,8", help="numbers of kvsims (default 1,4,8)")
    ap.add_argument("--seconds", type=float, default=10.0, help="window per N (default 10)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "agent-results.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/agent_cost.py loads BPF programs: run it as root")
    rows = row([int(x) for x in a.engines.split(",")], a.seconds)
    print(f"{'engines':>7} {'agent CPU s/s':>14} {'RssAnon MB':>11} {'BPF maps MB':>12}")
    for r in rows:
        print(f"{r['engines']:>7} {r['agent_cpu_s_per_s']:>14.4f} "
              f"{r['agent_rss_anon_mb']:>11.1f} {r['bpf_maps_mb']:>12.1f}")
    with open(a.out, "w") as f:
        json.dump({"agent": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
