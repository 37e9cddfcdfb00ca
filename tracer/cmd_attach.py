"""`kvtrace-bpf attach`: trace a process live, print a summary on exit."""

import argparse
import json
import os
import signal
import sys
import time

from rich.console import Console
from rich.live import Live

from . import abi, discover, live, target as target_mod
from .aggregate import Aggregate
from .errors import TargetError, UsageError
from .export import folded_lines
from .files import check_writable, open_private
from .tracefile import Recorder

EXAMPLES = """\
examples:
  sudo kvtrace-bpf attach -p 1234                  # live view until Ctrl-C
  sudo kvtrace-bpf attach -p 1234 -d 30 --json kv.json
  sudo kvtrace-bpf attach --folded kv.folded -- tests/target/kvsim --workload beam
  sudo kvtrace-bpf attach -p 1234 -o run.kvt       # live, and record for `report`
  flamegraph.pl --countname=slots kv.folded > kv.svg
"""


def positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def positive_int(text):
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def add_parser(sub):
    p = sub.add_parser(
        "attach", help="trace a vLLM process (or a command) live",
        description="Attach to the vllm:* probes of a running process (-p) or of a\n"
                    "command started under the tracer (-- CMD), show per-block KV-cache\n"
                    "histograms live, and print a summary when tracing ends (Ctrl-C,\n"
                    "SIGTERM, --duration, or the target's exit). Needs root.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", type=positive_int, help="trace this running process")
    p.add_argument("-d", "--duration", type=positive_float, metavar="S",
                   help="stop after S seconds")
    p.add_argument("-i", "--interval", type=positive_float, default=1.0, metavar="S",
                   help="refresh the view every S seconds (default 1)")
    p.add_argument("--json", metavar="FILE", help="write the final aggregate as JSON "
                   "(docs/json-schema.md)")
    p.add_argument("--folded", metavar="FILE", help="write folded stacks weighted by "
                   "slots written or pairs moved (flamegraph.pl, speedscope)")
    p.add_argument("-o", "--output", metavar="FILE", help="also record a trace file "
                   "for `report` and `export` (docs/trace-format.md)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no live view: only the summary at the end")
    p.add_argument("--max-blocks", type=positive_int, default=abi.DEFAULT_MAX_BLOCKS,
                   metavar="N", help="blocks per layer counted exactly "
                   f"(rounded up to a power of two; default {abi.DEFAULT_MAX_BLOCKS})")
    p.add_argument("--max-layers", type=positive_int, default=abi.DEFAULT_MAX_CACHES,
                   metavar="N", help="layers (caches) counted per block, all processes "
                   f"together (default {abi.DEFAULT_MAX_CACHES})")
    p.add_argument("--perf-pages", type=positive_int, metavar="N",
                   help="perf buffer pages per CPU for the per-op records (default 64; "
                   "with -o, which streams every slot, 4096 up to 256 MiB in all)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- CMD [ARG...]: start CMD and trace it")
    p.set_defaults(run=run)
    return p


def _validate(args):
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if bool(args.pid) == bool(args.command):
        raise UsageError("give exactly one of -p PID or -- CMD [ARG...]")
    if args.max_blocks > 1 << 18:
        raise UsageError("--max-blocks must be at most 262144")
    if args.perf_pages is None:
        args.perf_pages = stream_perf_pages() if args.output else 64
    if args.perf_pages & (args.perf_pages - 1):
        raise UsageError("--perf-pages must be a power of two")
    for path in (args.json, args.folded, args.output):
        if path:
            check_writable(path)


def stream_perf_pages() -> int:
    """Perf buffer pages per CPU with the index stream on: 4096 (16 MiB), but
    at most 256 MiB over all CPUs (a 192-CPU host gets 256 pages each).  The
    stream comes in bursts (an 8192-token prefill is 64 KiB per layer) and
    the reader is one Python thread: docs/trace-format.md."""
    per_cpu = max(64, 65536 // max(1, os.cpu_count() or 1))
    return min(4096, 1 << (per_cpu.bit_length() - 1))


def run(args) -> int:
    t_start = time.monotonic()
    _validate(args)
    # imported here so that `--help` and `probes` work without bcc
    from .session import Tracer, check_privileges

    check_privileges()
    probe_cache = {}  # each mapped file is parsed once per run
    if args.pid:
        target_mod.check_pid(args.pid)
        _require_probes(args.pid, probe_cache)  # fail fast, before seconds of compiling
    else:
        target_mod.resolve_command(args.command)

    stop = {"reason": None}

    def on_signal(signum, frame):
        stop["reason"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    tracer = target = recorder = None
    try:
        tracer = Tracer(max_blocks=args.max_blocks, max_caches=args.max_layers,
                        stacks=bool(args.folded or args.output), perf_pages=args.perf_pages,
                        index_stream=bool(args.output))
        target = _start(args, tracer, probe_cache)
        recorder = _open_recorder(args, tracer, target)
        _announce(tracer, target, t_start)
        _trace_loop(args, tracer, target, stop, probe_cache,
                    on_poll=recorder.tick if recorder else None)
    except BaseException:
        if tracer is not None:
            tracer.close()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if tracer is not None:
            tracer.detach()  # first thing: the semaphores drop now
        if target is not None:
            target.end_child()
            target.close()
    try:
        _finish(args, tracer, target, stop["reason"] or "?", recorder)
    finally:
        tracer.close()
    return 0


def _open_recorder(args, tracer, target):
    """-o FILE: the trace file, fed from the tracing loop (tracefile.Recorder)."""
    if not args.output:
        return None
    what = {"pid": target.pid} if args.pid else {"command": args.command, "pid": target.pid}
    return Recorder(args.output, tracer, what)


def _start(args, tracer, probe_cache):
    """The target, with the tracer attached to its probes."""
    if args.pid:
        target = target_mod.Target(args.pid, child=False)
        tracer.attach(args.pid, discover.process_probe_files(args.pid, cache=probe_cache))
    else:
        target = target_mod.launch(args.command, tracer)
        try:
            tracer.attach(target.pid, discover.process_probe_files(target.pid, cache=probe_cache))
        except BaseException:
            target.end_child()  # we started it: do not leave it behind
            raise
        os.kill(target.pid, signal.SIGCONT)  # it waits at its entry point
    return target


def _announce(tracer, target, t_start):
    proc = tracer.procs[target.pid]
    files = ", ".join(os.path.basename(f) for f in proc.probe_files) or "no file yet"
    print(f"kvtrace-bpf: tracing pid {target.pid} ({proc.comm}): {len(proc.uprobes)} probes "
          f"in {files}; ready after {time.monotonic() - t_start:.1f}s (BPF compile "
          f"{tracer.compile_seconds:.1f}s). Ctrl-C to stop.", file=sys.stderr)
    for probe, why in proc.skipped:
        print(f"kvtrace-bpf: skipped {probe.qualified} in {probe.path}: {why}", file=sys.stderr)
    sys.stderr.flush()


def _require_probes(pid, probe_cache):
    files = discover.process_probe_files(pid, cache=probe_cache)
    if not files:
        raise TargetError(
            f"process {pid} ({discover.comm(pid)}) maps no file with {abi.PROVIDER}:* "
            f"probes (is it vLLM built with kvtrace probes? `kvtrace-bpf probes -p {pid}`)")


def _probe_files_now(pid, probe_cache) -> dict:
    try:
        return discover.process_probe_files(pid, cache=probe_cache)
    except TargetError:  # exited meanwhile: the loop notices next time
        return {}


def _aggregate(tracer, raw=None) -> Aggregate:
    return Aggregate.from_maps(
        raw if raw is not None else tracer.read_maps(),
        comms={pid: p.comm for pid, p in tracer.procs.items()},
        probe_files={pid: sorted(p.probe_files) for pid, p in tracer.procs.items()})


def _trace_loop(args, tracer, target, stop, probe_cache, on_poll=None):
    console = Console(highlight=False)
    show_live = console.is_terminal and not args.quiet
    deadline = time.monotonic() + args.duration if args.duration else None
    prev = agg = _aggregate(tracer)
    title = f"kvtrace-bpf  pid {target.pid} ({tracer.procs[target.pid].comm})"
    next_refresh = time.monotonic() + args.interval

    def view():
        return live.render(agg, prev, title=title, width=min(console.width, 120),
                           elapsed=time.monotonic() - tracer.started)

    live_ctx = Live(view(), console=console, auto_refresh=False, transient=True) \
        if show_live else None
    if live_ctx:
        live_ctx.start()
    try:
        while stop["reason"] is None:
            tracer.poll(100)
            if on_poll:
                on_poll()
            now = time.monotonic()
            if target.exited():
                stop["reason"] = "target exited"
            elif deadline is not None and now >= deadline:
                stop["reason"] = "duration"
            if now >= next_refresh and stop["reason"] is None:
                # libraries loaded since (dlopen) may bring probes
                try:
                    tracer.attach(target.pid, _probe_files_now(target.pid, probe_cache))
                except TargetError:  # it exited meanwhile: noticed next time round
                    pass
                prev, agg = agg, _aggregate(tracer)
                next_refresh = now + args.interval
                if live_ctx:
                    live_ctx.update(view(), refresh=True)
    finally:
        if live_ctx:
            live_ctx.stop()


def _finish(args, tracer, target, reason, recorder=None):
    tracer.drain()
    raw = tracer.read_maps()
    agg = _aggregate(tracer, raw)
    elapsed = time.monotonic() - tracer.started
    console = Console(highlight=False)
    if getattr(args, "summary", True):
        console.print(live.render(agg, None, title=f"kvtrace-bpf summary ({reason})",
                                  width=min(console.width, 120), elapsed=elapsed))
    doc = agg.to_json(duration_s=round(elapsed, 3), stop_reason=reason,
                      target_exit_status=target.status if target.child else None,
                      max_blocks=tracer.max_blocks, max_layers=tracer.max_caches)
    if recorder:
        _finish_recording(recorder, tracer, raw, doc)
    if args.json:
        with open_private(args.json) as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.folded:
        layer_of = {(l.pid, l.index): l.layer for p in agg.processes.values() for l in p.layers}
        lines = folded_lines(
            raw["stacks"], tracer.stack_frames,
            lambda pid: tracer.procs[pid].comm if pid in tracer.procs else str(pid),
            lambda pid, idx: layer_of.get((pid, idx)))
        with open_private(args.folded) as f:
            f.write("".join(line + "\n" for line in lines))


def _finish_recording(recorder, tracer, raw, doc):
    """The trace file's END: the exact counters and the symbolized stacks."""
    stacks = {f"{pid}:{sid}": tracer.stack_frames(sid, pid)
              for pid, sid in {(pid, sid) for pid, sid, _, _, _ in raw["stacks"]}}
    recorder.finish(doc, stacks)
    c = tracer.stream
    lost = raw["globals"]["records_lost"] + raw["globals"]["chunks_lost"]
    print(f"kvtrace-bpf: recorded {c.op_records:,} ops and {c.chunk_records:,} slot chunks "
          f"to {recorder.writer.path} ({recorder.writer.bytes / 2**20:.1f} MiB)"
          + (f"; {lost:,} records lost (raise --perf-pages)" if lost else ""),
          file=sys.stderr)
