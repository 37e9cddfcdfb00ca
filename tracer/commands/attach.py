"""`kvtrace-bpf attach`: trace a process live, print a summary on exit."""

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time

from rich.console import Console
from rich.live import Live
from rich.segment import Segment
from rich.style import Style

from .. import abi
from ..analysis import lifecycle, misses
from ..analysis.aggregate import Aggregate
from ..errors import TargetError, UsageError
from ..exporters import prometheus
from ..exporters.folded import folded_lines
from ..files import Outputs, check_writable, open_private, write_file
# session imports no bcc at module level: --help still works without it
from ..kernel.session import DEFAULT_MAX_PROCS, DEFAULT_TRANSPORT, TRANSPORTS
from ..probes import activity, discover, follow, target as target_mod
from ..trace.tracefile import Recorder
from ..views import panels
from .args import (MAX_STACK_BUCKETS, add_stack_storage_size, add_verify_rows, cpu_list,
                   non_negative_float, positive_float, positive_int)

EXAMPLES = """\
examples:
  sudo kvtrace-bpf attach -p 1234                  # live view until Ctrl-C
  sudo kvtrace-bpf attach --full -p 1234           # every panel (a tall terminal)
  sudo kvtrace-bpf attach -p 1234 -d 30 --json kv.json
  sudo kvtrace-bpf attach --folded kv.folded -- tests/target/kvsim --workload beam
  sudo kvtrace-bpf attach -p 1234 -o run.kvt       # live, and record for `report`
  sudo kvtrace-bpf attach -q -p 1234 --prometheus 9472   # /metrics on 127.0.0.1:9472
  sudo kvtrace-bpf attach -q --prometheus --prometheus-linger 5 -- \\
      tests/target/kvsim --workload prefix        # final figures: next scrape, or 5 s
  sudo kvtrace-bpf attach -p 1234 --cpu 1          # the tracer on CPU 1 only
  flamegraph.pl --countname=slots kv.folded > kv.svg   # not in Debian: README, or speedscope
"""


# How often the process tree is scanned for new processes and libraries:
# often while it changes (vLLM starting its workers), then less, since every
# scan reads /proc and costs the traced machine CPU time.
FOLLOW_INTERVAL = 0.25
FOLLOW_INTERVAL_QUIET = 1.0
FOLLOW_QUIET_AFTER = 10.0  # seconds without a change
# How long the tracing loop waits between its duties (a scan, a refresh,
# the end of --duration).  While it reads op records (-o, --prometheus),
# POLL_S: what waits in the buffers is read at least that often.  Without,
# it sleeps until the next duty, up to IDLE_POLL_S, on the target's pidfd
# and a pipe the signal handlers write to: the target's exit and Ctrl-C end
# the wait at once, and an idle tracer wakes once a scan (every wake-up
# costs CPU time on a VM).  POLL_S without a pidfd.
POLL_S = 0.1
IDLE_POLL_S = 1.0
# --prometheus-linger's default: one interval of Prometheus's default
# scrape_interval (1m), so that a scraper at its default sees the final
# figures; the next scrape ends the wait sooner
PROMETHEUS_LINGER_S = 60.0


# The per-block counters are one BPF array of --max-layers rows of
# --max-blocks u64s: at most 2 GiB (2048 layers at the default 131072
# blocks).  Beyond, the kernel refuses the map, and bcc prints its own line.
MAX_COUNTERS = 1 << 28


def add_parser(sub):
    p = sub.add_parser(
        "attach", help="trace a vLLM process (or a command) live",
        description="Attach to the vllm:* probes of a running process (-p) or of a\n"
                    "command started under the tracer (-- CMD), show per-block KV-cache\n"
                    "histograms live, and print a summary when tracing ends (Ctrl-C,\n"
                    "SIGTERM, --duration, or the target's exit). A command runs in its own\n"
                    "process group, which the tracer ends (SIGTERM, then SIGKILL after 5 s)\n"
                    "when tracing stops; a -p process is never signalled. Needs root.\n"
                    "'counts: exact' means the kernel's per-block counters hold every\n"
                    "slot of every probe hit; the view says why when they do not (an op\n"
                    "truncated, an array unreadable, blocks or layers beyond --max-blocks\n"
                    "or --max-layers, hits the kernel skipped). Lost perf records never\n"
                    "change the counts. Words on screen: docs/glossary.md.",
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
    add_stack_storage_size(p)
    add_verify_rows(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no live view: only the summary at the end")
    p.add_argument("--full", action="store_true",
                   help="the live view with every panel: taller histograms, the "
                   "hottest blocks' and the copies' and swaps' tables, items per op "
                   f"(default: a view that fits {panels.FIT_ROWS} rows; the summary at "
                   "the end has them all)")
    p.add_argument("--max-blocks", type=positive_int, default=abi.DEFAULT_MAX_BLOCKS,
                   metavar="N", help="blocks per layer counted exactly "
                   f"(rounded up to a power of two; default {abi.DEFAULT_MAX_BLOCKS})")
    p.add_argument("--max-layers", type=positive_int, default=abi.DEFAULT_MAX_CACHES,
                   metavar="N", help="layers (caches) counted per block, all processes "
                   f"together (default {abi.DEFAULT_MAX_CACHES})")
    p.add_argument("--cpu", type=cpu_list, metavar="LIST",
                   help="run the tracer on these CPUs only (1, 0,2 or 2-3), to keep it "
                   "off the CPUs vLLM's workers are pinned to; a command started with "
                   "-- CMD keeps every CPU (default: no pinning)")
    p.add_argument("--calls-only", action="store_true",
                   help="stock vLLM: count ops without reading their tensors (no "
                   "per-block counts; the cheapest mode)")
    p.add_argument("--max-procs", type=positive_int, default=DEFAULT_MAX_PROCS, metavar="N",
                   help="processes traced at once, the target and its descendants "
                   f"(default {DEFAULT_MAX_PROCS})")
    p.add_argument("--perf-pages", type=positive_int, metavar="N",
                   help="perf buffer pages per CPU for the per-op records: every op's "
                   "with -o, else the plugin tier's events only (default: with -o, which "
                   "streams every slot, 4096 up to 256 MiB in all; else 64)")
    p.add_argument("--transport", choices=TRANSPORTS,
                   help="the per-op records through the per-CPU perf buffer or one BPF "
                   f"ring buffer of the same total size (default {DEFAULT_TRANSPORT}; "
                   "docs/bench.md)")
    p.add_argument("--cmd-output", metavar="FILE",
                   help="-- CMD: where the command's stdout and stderr go, so its log "
                   "lines do not tear the live view (created 0600). Default: with the "
                   "live view, a new file $TMPDIR/kvtrace-cmd-*.log (TMPDIR: /tmp if unset), "
                   "named on screen "
                   "(removed at exit if the command wrote nothing); otherwise, or "
                   "with '-', the tracer's own terminal")
    p.add_argument("--prometheus", nargs="?", metavar="[ADDR:]PORT",
                   const=f"{prometheus.DEFAULT_ADDR}:{prometheus.DEFAULT_PORT}",
                   help="serve Prometheus metrics on http://ADDR:PORT/metrics while "
                   f"tracing (ADDR defaults to {prometheus.DEFAULT_ADDR}; the flag alone: "
                   f"port {prometheus.DEFAULT_PORT}; docs/metrics.md)")
    p.add_argument("--prometheus-linger", type=non_negative_float, default=None,
                   metavar="S",
                   help="--prometheus: when the target exits, serve its final figures "
                   "until one more scrape has fetched them, or S seconds have passed "
                   f"(default {PROMETHEUS_LINGER_S:g}: Prometheus's default scrape "
                   "interval; 0: stop at once; Ctrl-C ends the wait)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- CMD [ARG...]: start CMD and trace it")
    p.set_defaults(run=run)
    return p


def validate(args):
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if bool(args.pid) == bool(args.command):
        raise UsageError("give exactly one of -p PID or -- CMD [ARG...]")
    if args.max_blocks > 1 << 18:
        raise UsageError("--max-blocks must be at most 262144")
    if args.max_procs > 64:
        raise UsageError("--max-procs must be at most 64")
    if args.max_layers * args.max_blocks > MAX_COUNTERS:
        raise UsageError(f"--max-layers x --max-blocks must be at most {MAX_COUNTERS} "
                         f"(2 GiB of counters); {args.max_layers} x {args.max_blocks} is more")
    if args.stack_storage_size is not None:
        if not (args.folded or args.output):
            raise UsageError("--stack-storage-size goes with --folded or -o: without them, "
                             "no stack is taken")
        if args.stack_storage_size > MAX_STACK_BUCKETS:
            raise UsageError(f"--stack-storage-size must be at most {MAX_STACK_BUCKETS}")
    else:
        args.stack_storage_size = abi.STACK_BUCKETS
    # `record` shares run() and has no --prometheus
    args.prometheus_at = prometheus.parse_endpoint(args.prometheus) \
        if getattr(args, "prometheus", None) else None
    if getattr(args, "prometheus_linger", None) is not None and not args.prometheus_at:
        raise UsageError("--prometheus-linger goes with --prometheus")
    args.transport = args.transport or DEFAULT_TRANSPORT
    if args.perf_pages is None:
        args.perf_pages = stream_perf_pages() if index_stream(args) == "all" else 64
    if args.perf_pages & (args.perf_pages - 1):
        raise UsageError("--perf-pages must be a power of two")
    for path in (args.json, args.folded, args.output):
        if path:
            check_writable(path)
    cmd_output = getattr(args, "cmd_output", None)
    if cmd_output and not args.command:
        raise UsageError("--cmd-output goes with -- CMD (a -p process keeps its own output)")
    if cmd_output and cmd_output != "-":
        check_writable(cmd_output)


def program_options(args) -> dict:
    """The Tracer options these arguments choose that pick the BPF program
    (its cflags, so its cache entry: scripts/compile-bpf.py compiles the
    common ones at setup)."""
    return dict(max_blocks=args.max_blocks, max_caches=args.max_layers,
                max_procs=args.max_procs, stacks=bool(args.folded or args.output),
                stack_buckets=args.stack_storage_size, perf_pages=args.perf_pages,
                index_stream=index_stream(args), transport=args.transport,
                gen_fill=bool(args.prometheus_at))


def index_stream(args):
    """What the BPF program streams: every op's index values, to record
    them (-o: "all"); else only the plugin tier's events ("block_ids":
    their records and ids, step_rows' rows and new entries, a few values a
    step, and nothing of the op tiers' ops), from which the live view and
    --prometheus derive the plugin tier's reads (derived_rows.LiveRows),
    and --prometheus its residency histograms (docs/design.md, "Reads
    derived from row events")."""
    return "all" if args.output else "block_ids"


def stream_perf_pages() -> int:
    """Perf buffer pages per CPU with the index stream on: 4096 (16 MiB), but
    at most 256 MiB over all CPUs (a 192-CPU host gets 256 pages each).  The
    stream comes in bursts (an 8192-token prefill is 64 KiB per layer) and
    the reader is one Python thread: docs/trace-format.md."""
    per_cpu = max(64, 65536 // max(1, os.cpu_count() or 1))
    return min(4096, 1 << (per_cpu.bit_length() - 1))


def run(args) -> int:
    t_start = time.monotonic()
    validate(args)
    # pinned before any thread or child starts, so that they inherit it; the
    # command of -- CMD gets back every CPU (target.launch)
    args.every_cpu = os.sched_getaffinity(0)
    if getattr(args, "cpu", None):
        os.sched_setaffinity(0, args.cpu)
    # imported here so that `--help` and `probes` work without bcc
    from ..kernel.session import check_privileges

    check_privileges()
    exporter = server = None
    # The plugin tier's reads (every view's) and --prometheus's residency
    # histograms come from its events, which only the index stream
    # carries: their ids alone, or everything with -o (the tap then drops
    # the rest after the Recorder took it)
    residency = lifecycle.LiveResidency(lifecycle.StreamTap(keep_all=bool(args.output)),
                                        with_histograms=bool(args.prometheus_at))
    if args.prometheus_at:
        residency.misses = misses.LiveMisses()
        # bound before any BPF is loaded: a busy port fails in a second
        exporter = prometheus.Exporter(_model_name(args), residency)
        server = prometheus.start_server(*args.prometheus_at, exporter)
    follower = None
    if args.pid:
        target_mod.check_pid(args.pid)
        follower = follow.Follower(args.pid, calls_only=args.calls_only)
        # fail fast, before seconds of compiling; this also starts finding
        # the tensor layout of a stock vLLM, in parallel with the compile
        _require_probes(follower)
    else:
        target_mod.resolve_command(args.command)

    stop = {"reason": None, "signal": None}

    def on_signal(signum, frame):
        stop["reason"] = stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args, t_start, stop, exporter, server, residency, follower)
    finally:
        # last: the endpoint stays up through the summary and the linger
        if server is not None:
            prometheus.stop_server(server)
        for s, h in old.items():
            signal.signal(s, h)


def _run(args, t_start, stop, exporter, server, residency, follower) -> int:
    from ..kernel.session import Tracer

    tracer = target = recorder = None
    traced = False  # the loop ended without an exception
    try:
        tracer = Tracer(**program_options(args),
                        collector=residency.tap if residency else None,
                        verify_rows=args.verify_rows)
        # the views' and the endpoint's reads of groups the kernel does not
        # count (step_rows without block_table), fed by the residency's tick
        tracer.live_rows = residency.rows
        target, follower = _start(args, tracer, follower)
        recorder = _open_recorder(args, tracer, target)
        if server is not None:
            _say(f"metrics on http://{_where(args.prometheus_at)}/metrics" +
                 ("" if prometheus.is_loopback(args.prometheus_at[0]) else
                  " (not loopback: whoever reaches it sees the traffic's shape)"))
        _announce(args, tracer, target, follower, t_start)

        def on_poll():
            if recorder:
                recorder.tick()  # first: with -o, its take feeds the residency's tap
            residency.tick()

        _trace_loop(args, tracer, target, follower, stop, on_poll=on_poll, recorder=recorder,
                    on_refresh=exporter.publish if exporter else None)
        traced = True
    except BaseException:
        if tracer is not None:
            tracer.close()
        raise
    finally:
        if tracer is not None:
            tracer.detach()  # first thing: the semaphores drop now
        if follower is not None:
            follower.close()
        if target is not None:
            target.end_child()
            target.close()
        _drop_if_empty(args)
        if traced:
            _take_the_rest(tracer, residency, recorder)
            if server is not None:
                exporter.publish_final(_aggregate(tracer))
    try:
        rc = _finish(args, tracer, target, stop["reason"] or "?", recorder)
    finally:
        tracer.close()
    if getattr(args, "cmd_output_path", None):
        _say(f"{os.path.basename(args.command[0])}'s output is in {args.cmd_output_path}")
    elif getattr(args, "cmd_output_dropped", False):
        _say(f"{os.path.basename(args.command[0])} wrote no output")
    if server is not None:
        _linger(args, exporter, stop)
    return rc


def _take_the_rest(tracer, residency, recorder):
    """After detach: the events the live path still held back (HOLD_S; none
    can come after the drain) taken in, so that the summary, --json and
    --prometheus's final figures hold the derived reads and residency
    samples of the whole run, not all but its last second."""
    tracer.drain()
    if recorder is not None:
        recorder.tick(force=True)  # first: with -o, its take feeds the residency's tap
    residency.tick(force=True, now_ns=time.monotonic_ns() +
                   int(lifecycle.LiveResidency.HOLD_S * 1e9) + 1)


def _linger(args, exporter, stop):
    """When the target exited, keep the final figures up until a scrape's
    response with them was sent, or --prometheus-linger seconds passed:
    a scraper that comes every N s would else miss the run's last N s.
    A signal ends the wait; a stop by signal or --duration never waits."""
    linger = args.prometheus_linger
    if linger is None:
        linger = PROMETHEUS_LINGER_S
    if not linger or stop["reason"] != "target exited" or not exporter.final.is_set():
        return
    if exporter.final_scraped.is_set():
        _say("target exited: a scrape fetched the final metrics")
        return
    _say(f"target exited: serving the final metrics until the next scrape, at most "
         f"{linger:g} s (Ctrl-C ends it)")
    end = time.monotonic() + linger
    while stop["signal"] is None and not exporter.final_scraped.is_set():
        left = end - time.monotonic()
        if left <= 0:
            break
        exporter.final_scraped.wait(min(0.1, left))
    if exporter.final_scraped.is_set():
        _say("a scrape fetched the final metrics: endpoint closed")
    elif stop["signal"] is None:
        _say(f"no scrape came within {linger:g} s: endpoint closed")


def _open_recorder(args, tracer, target):
    """-o FILE: the trace file, fed from the tracing loop (tracefile.Recorder)."""
    if not args.output:
        return None
    what = {"pid": target.pid} if args.pid else {"command": args.command, "pid": target.pid}
    return Recorder(args.output, tracer, what)


def _start(args, tracer, follower):
    """The target, with the tracer attached to the probes of its tree."""
    if args.pid:
        target = None
        try:
            target = target_mod.Target(args.pid, child=False)
            follower.step(tracer, wait=True)
        except (TargetError, OSError) as e:
            # checked before the compile, gone after it: say that, whatever
            # step of attaching noticed first
            if target is None or target.exited():
                raise TargetError(f"process {args.pid} exited during attach") from None
            if isinstance(e, OSError):
                raise TargetError(f"process {args.pid}: {e}") from None
            raise
    else:
        # chosen (a new file made) only now, once the tracer is ready to start it
        args.cmd_output_path = cmd_output_path(args, Console().is_terminal and not args.quiet)
        with _command_output(args):
            target = target_mod.launch(args.command, tracer, cpus=args.every_cpu)
        follower = follow.Follower(target.pid, calls_only=args.calls_only)
        try:
            follower.step(tracer, wait=True)
        except BaseException:
            target.end_child()  # we started it: do not leave it behind
            raise
        os.kill(target.pid, signal.SIGCONT)  # it waits at its entry point
    return target, follower


def cmd_output_path(args, live_view: bool):
    """Where -- CMD's output goes: a file (its path), or None for the
    tracer's own stdout and stderr.  With the live view on, a command that
    logs (vLLM does, every few seconds) would tear the screen, so by default
    its output goes to a new private file instead."""
    if not args.command:
        return None
    chosen = getattr(args, "cmd_output", None)
    if chosen == "-":
        return None
    if chosen:
        return chosen
    if not live_view:
        return None
    fd, path = tempfile.mkstemp(prefix="kvtrace-cmd-", suffix=".log")  # 0600
    os.close(fd)
    return path


def _drop_if_empty(args):
    """Remove the file cmd_output_path made for -- CMD's output if the
    command wrote nothing there (it exited at once, or was never started):
    an empty file left in $TMPDIR says nothing.  A file the user named stays."""
    path = getattr(args, "cmd_output_path", None)
    if not path or getattr(args, "cmd_output", None):  # none, or the user's
        return
    try:
        if os.stat(path).st_size == 0:
            os.unlink(path)
            args.cmd_output_path, args.cmd_output_dropped = None, True
    except OSError:  # gone already, or not ours to remove: leave it be
        pass


@contextlib.contextmanager
def _command_output(args):
    """The command inherits fds 1 and 2 at its fork: point them at
    args.cmd_output_path for the fork, then back at the tracer's."""
    path = getattr(args, "cmd_output_path", None)
    if path is None:
        yield
        return
    with open_private(path, binary=True) as out:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _say(line):
    print(f"kvtrace-bpf: {line}", file=sys.stderr, flush=True)


def _announce(args, tracer, target, follower, t_start):
    notices = follower.take_notices()
    root = tracer.procs.get(target.pid)
    if root is None or not root.uprobes:
        notices.insert(0, f"following pid {target.pid} ({discover.comm(target.pid)}) and "
                          "its descendants")
    if getattr(args, "cmd_output_path", None):
        notices.append(f"{os.path.basename(args.command[0])}'s output goes to "
                       f"{args.cmd_output_path}")
    if tracer.empty_prog_fd >= 0:  # a measurement of the sites alone (session.py)
        notices.append("KVTRACE_EMPTY_PROGRAM is set: the probes run an empty program "
                       "and nothing is counted")
    for line in notices:
        _say(line)
    for proc in tracer.procs.values():
        for probe, why in proc.skipped:
            _say(f"skipped {probe.qualified} in {probe.path}: {why}")
    probes = sum(len(u.offsets) for p in tracer.procs.values() for u in p.uprobes)
    _say(f"{probes} probes in {sum(1 for p in tracer.procs.values() if p.uprobes)} "
         f"processes; ready after {time.monotonic() - t_start:.1f}s (BPF program "
         f"{tracer.program_source} in {tracer.compile_seconds:.1f}s). Ctrl-C to stop.")


def _require_probes(follower):
    """-p PID must be vLLM: a process of its tree maps probe sites, or (a
    vLLM still starting its workers) its command line names vllm."""
    if follower.scan():
        return
    pid = follower.root
    if "vllm" in follow.cmdline(pid).lower():
        follower.notices.append(
            f"pid {pid} ({discover.comm(pid)}) looks like vLLM but no process of its tree "
            "maps vLLM's library yet: waiting for its workers")
        return
    raise TargetError(
        f"process {pid} ({discover.comm(pid)}) is not vLLM: neither it nor its descendants "
        f"map vLLM's library or a file with {abi.PROVIDER}:* probes "
        f"(`kvtrace-bpf probes -p {pid}` lists what it has)")


def _aggregate(tracer, raw=None) -> Aggregate:
    raw = raw if raw is not None else tracer.read_maps()
    rows = getattr(tracer, "live_rows", None)
    if rows is not None:  # the plugin tier's reads derived from its step_rows
        raw = rows.merge_into(raw)
    return Aggregate.from_maps(
        raw,
        comms={pid: p.comm for pid, p in tracer.procs.items()},
        probe_files={pid: sorted(p.probe_files) for pid, p in tracer.procs.items()},
        proc_info={pid: {"tier": p.tier, "parent": p.parent, "calls_only": p.calls_only,
                         "plugin_status": p.plugin_status,
                         "probed_ops": p.probed_ops}
                   for pid, p in tracer.procs.items()})


def _title(tracer, target) -> str:
    procs = ", ".join(f"{pid} {p.comm}" for pid, p in tracer.procs.items() if p.uprobes)
    return f"kvtrace-bpf  pid {target.pid}  traced: {procs or 'none yet'}"


def _model_name(args) -> str:
    """model_name for the metrics' labels, from the command line (ours, or
    the -p process's); '' when it does not name one."""
    return prometheus.model_name(args.command if args.command else follow.cmdline(args.pid))


def _where(at) -> str:
    host, port = at
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _FitScreen:
    """The live view cut to the terminal's height less one line.  A frame as
    tall as the screen scrolls it by the newline after its last line, and
    rich's Live then cannot move back over its top line: that line, the
    header, stayed behind on stop and showed twice above the summary."""

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console, options):
        lines = console.render_lines(self.renderable, options.update(height=None), pad=False)
        room = max(1, console.height - 1)
        if len(lines) > room:
            more = Segment(f"... {len(lines) - room + 1} more lines: a taller terminal "
                           "shows them", Style(dim=True))
            lines = lines[:room - 1] + [[more]]
        for line in lines:
            yield from line
            yield Segment.line()


def _trace_loop(args, tracer, target, follower, stop, on_poll=None, on_refresh=None,
                recorder=None):
    def recorder_failed():
        return recorder is not None and recorder.error is not None and \
            not getattr(args, "summary", True)

    console = Console(highlight=False)
    show_live = console.is_terminal and not args.quiet
    deadline = time.monotonic() + args.duration if args.duration else None
    # -q without --prometheus draws nothing before the summary: no aggregate
    # until then (reading the maps copies every counter array, about 12 ms
    # of CPU against vLLM here, just as its first batch starts)
    prev = agg = _aggregate(tracer) if show_live or on_refresh else None
    next_refresh = time.monotonic() + args.interval
    next_scan = time.monotonic() + FOLLOW_INTERVAL

    out = getattr(args, "cmd_output_path", None)
    note = f"{os.path.basename(args.command[0])}'s output: {out}" if out else ""
    # until the first op: what the target is doing meanwhile (probes/activity.py)
    doing = activity.Activity(out)

    def view():
        width = min(console.width, 120)
        what = ""
        if not panels.traced_anything(agg):
            what = doing.line(follower.tree(), discover.comm,
                              any(p.uprobes for p in tracer.procs.values()),
                              time.monotonic(), width)
        return _FitScreen(panels.render(agg, prev, title=_title(tracer, target), width=width,
                                      note="\n".join(x for x in (note, what) if x),
                                      elapsed=time.monotonic() - tracer.started,
                                      full=getattr(args, "full", False)))

    live_ctx = Live(view(), console=console, auto_refresh=False, transient=True) \
        if show_live else None
    if live_ctx:
        live_ctx.start()
    if on_refresh:
        on_refresh(agg, None)

    def during_poll(write):
        # a poll the target's records keep from returning (session.py,
        # DURING_POLL_EVERY_S): a stop (Ctrl-C, a failed write) ends it,
        # and what waits for the trace file is written when there is much
        if write and on_poll:
            on_poll()
        return stop["reason"] is not None or recorder_failed()

    tracer.during_poll = during_poll
    wakeup = _SignalWakeup()
    wake_fds = [wakeup.fd] + ([target.exit_fd] if target.exit_fd is not None else [])
    try:
        while stop["reason"] is None:
            # (a plugin-tier process may come with vLLM's workers)
            longest = IDLE_POLL_S if target.exit_fd is not None and \
                not tracer.polls_records else POLL_S
            due = min(next_scan, deadline if deadline is not None else math.inf,
                      next_refresh if live_ctx or on_refresh else math.inf)
            wait = min(max(due - time.monotonic(), 0.0), longest)
            tracer.poll(math.ceil(wait * 1000), wake_fds)
            wakeup.drain()
            if on_poll:
                on_poll()
            now = time.monotonic()
            if recorder_failed():
                # record: the trace file is its only output, so tracing on
                # would be for nothing (attach -o keeps its view and summary)
                stop["reason"] = "output failed"
            elif target.exited():
                stop["reason"] = "target exited"
            elif deadline is not None and now >= deadline:
                stop["reason"] = "duration"
            if now >= next_scan:
                # new descendants, or libraries loaded since (dlopen)
                follower.step(tracer)
                quiet = now - follower.changed_at >= FOLLOW_QUIET_AFTER
                for line in follower.take_notices():
                    _say(line)
                next_scan = now + (FOLLOW_INTERVAL_QUIET if quiet else FOLLOW_INTERVAL)
            # -q without --prometheus: only the summary needs an aggregate
            if now >= next_refresh and (live_ctx or on_refresh):
                prev, agg = agg, _aggregate(tracer)
                next_refresh = now + args.interval
                if on_refresh:
                    on_refresh(agg, prev)
                if live_ctx:
                    live_ctx.update(view(), refresh=True)
    finally:
        wakeup.close()
        tracer.during_poll = None  # the drain after detach keeps everything
        if live_ctx:
            live_ctx.stop()


class _SignalWakeup:
    """A pipe that Python's signal handling writes a byte to when a signal
    arrives (signal.set_wakeup_fd): a wait on it ends at SIGINT or SIGTERM,
    where a sleep would resume after the handler ran (PEP 475)."""

    def __init__(self):
        self.fd, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def drain(self):
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self):
        signal.set_wakeup_fd(self._old)
        os.close(self.fd)
        os.close(self._w)


def _finish(args, tracer, target, reason, recorder=None) -> int:
    """The summary, the trace file's end, --json and --folded: each written
    on its own, so that one that fails (a full disk) loses only itself; the
    failures are one line and exit 5 at the end (files.Outputs)."""
    tracer.drain()
    raw = tracer.read_maps()
    agg = _aggregate(tracer, raw)
    elapsed = time.monotonic() - tracer.started
    console = panels.output_console()
    out = Outputs()
    if getattr(args, "summary", True):
        out.write("the summary to stdout", lambda: console.print(
            panels.render(agg, None, title=f"kvtrace-bpf summary ({reason})",
                        width=min(console.width, 120), elapsed=elapsed)), stdout=True)
    doc = agg.to_json(duration_s=round(elapsed, 3), stop_reason=reason,
                      target_exit_status=target.status if target.child else None,
                      max_blocks=tracer.max_blocks, max_layers=tracer.max_caches)
    if recorder:
        _finish_recording(recorder, tracer, raw, doc)
        if recorder.error:
            out.fail(recorder.error)
    if args.json:
        out.write(args.json, lambda: write_file(args.json, json.dumps(doc, indent=1) + "\n"))
    if args.folded:
        layer_of = {(l.pid, l.index): l.layer for p in agg.processes.values() for l in p.layers}
        # weighted by slots written and pairs moved (as export's default):
        # the read probe's stacks weigh reads, export --weight reads has them;
        # the plugin's scheduler events (tokens, block ids) weigh neither
        lines = folded_lines(
            [st for st in raw["stacks"] if st[2] not in abi.READ_OPS | abi.PLUGIN_OPS],
            tracer.stack_frames,
            lambda pid: tracer.procs[pid].comm if pid in tracer.procs else str(pid),
            lambda pid, idx: layer_of.get((pid, idx)))
        out.write(args.folded,
                  lambda: write_file(args.folded, "".join(line + "\n" for line in lines)))
    return out.finish()


def _finish_recording(recorder, tracer, raw, doc):
    """The trace file's END: the exact counters and the symbolized stacks."""
    stacks = {f"{pid}:{sid}": tracer.stack_frames(sid, pid)
              for pid, sid in {(pid, sid) for pid, sid, _, _, _ in raw["stacks"]}}
    recorder.finish(doc, stacks)
    if recorder.error:
        return
    c = tracer.stream
    lost = raw["globals"]["records_lost"] + raw["globals"]["chunks_lost"]
    print(f"kvtrace-bpf: recorded {c.op_records:,} ops and {c.chunk_records:,} slot chunks "
          f"(records of their raw slot numbers or block pairs, up to {abi.RECORD_VALUES} each) "
          f"to {recorder.writer.path} ({recorder.writer.bytes / 2**20:.1f} MiB)"
          + (f"; {lost:,} records lost (raise --perf-pages)" if lost else ""),
          file=sys.stderr)
