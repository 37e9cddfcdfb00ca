"""`kvtrace-bpf agent`: trace every vLLM engine on the node, for as long as
it runs, and serve one /metrics for all of them (docs/agent.md)."""

import argparse
import json
import math
import os
import shlex
import signal
import sys
import time

from .. import abi
from ..analysis import lifecycle
from ..errors import EnvironmentProblem, TargetError, UsageError
from ..exporters import prometheus
from ..files import check_writable, write_file
from ..kernel.session import DEFAULT_TRANSPORT
from ..probes import discover, node, target as target_mod
from .args import cpu_list, non_negative_float, positive_float, positive_int

EXAMPLES = """\
examples:
  sudo kvtrace-bpf agent                           # /metrics on 127.0.0.1:9472
  sudo kvtrace-bpf agent --prometheus 0.0.0.0:9472 --grace 300
  sudo kvtrace-bpf agent --include 'Llama-3' --exclude 'bench'
  sudo kvtrace-bpf agent --config /etc/kvtrace-bpf/agent.conf   # SIGHUP re-reads it
  sudo kvtrace-bpf agent --state /run/kvtrace-bpf/agent.json --cpu 0
  kill -HUP $(pidof -s kvtrace-bpf)                # reload: config, and every process again
  deploy/: a systemd unit, a Kubernetes DaemonSet, Prometheus scrape configs
"""

# How the loop waits: op records (the plugin tier's block ids) are read at
# least every POLL_S, and so are the exec and fork events: a new engine is
# scanned within POLL_S of its exec.  Candidates are scanned again every
# SCAN_S while the node's processes change, SCAN_QUIET_S once quiet.
POLL_S = 0.1
SCAN_S = 0.25
SCAN_QUIET_S = 1.0
QUIET_AFTER_S = 10.0
GRACE_S = 60.0  # Prometheus's default scrape interval: one scrape sees the end

STATES = ("traced", "waiting", "excluded", "refused", "exited")
OVER_MAX_PROCS = "over --max-procs"


def add_parser(sub):
    p = sub.add_parser(
        "agent", help="trace every vLLM engine on the node; one /metrics for all",
        description="Run until SIGTERM or Ctrl-C: find every vLLM process on the node\n"
                    "that kvtrace-bpf can trace (the plugin's probes, a kvtrace build's,\n"
                    "stock vLLM's functions), attach to each one as it starts (exec and\n"
                    "fork tracepoints), let go of each one that exits, and serve every\n"
                    "engine's figures on one Prometheus endpoint, labelled by pid, role,\n"
                    "model_name, engine (vLLM's data-parallel index) and port. An\n"
                    "engine that cannot be traced is one log line and counts in\n"
                    "kvtrace_targets{state=\"refused\"}; the agent goes on. The series of\n"
                    "an engine that exited stay --grace seconds. SIGHUP reloads\n"
                    "--config and lists every process again; SIGTERM detaches everything\n"
                    "and exits 0. Needs root. docs/agent.md; deployment files in deploy/.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", metavar="[ADDR:]PORT",
                   default=f"{prometheus.DEFAULT_ADDR}:{prometheus.DEFAULT_PORT}",
                   help="serve /metrics on ADDR:PORT (default "
                   f"{prometheus.DEFAULT_ADDR}:{prometheus.DEFAULT_PORT}; ADDR defaults "
                   f"to {prometheus.DEFAULT_ADDR}: another address shows the node's "
                   "traffic shape to whoever reaches it)")
    p.add_argument("-i", "--interval", type=positive_float, default=1.0, metavar="S",
                   help="refresh the metrics every S seconds (default 1)")
    p.add_argument("--grace", type=non_negative_float, default=None, metavar="S",
                   help="keep an exited engine's series S seconds (default "
                   f"{GRACE_S:g}: one scrape at Prometheus's default interval)")
    p.add_argument("--include", action="append", default=None, metavar="REGEX",
                   help="trace only processes whose model name or command line (or an "
                   "ancestor's) matches REGEX (repeatable: any of them)")
    p.add_argument("--exclude", action="append", default=None, metavar="REGEX",
                   help="never trace processes whose model name or command line (or an "
                   "ancestor's) matches REGEX (repeatable)")
    p.add_argument("--config", metavar="FILE",
                   help="read --include, --exclude and --grace from FILE, one option a "
                   "line as on the command line ('#' starts a comment); SIGHUP reads it "
                   "again")
    p.add_argument("--state", metavar="FILE",
                   help="rewrite FILE (JSON, 0600) at every refresh with each process's "
                   "state: for a person or a script to look at")
    p.add_argument("--max-procs", type=positive_int, default=abi.DEFAULT_MAX_PROCS,
                   metavar="N", help="processes traced at once, every engine's together "
                   f"(default {abi.DEFAULT_MAX_PROCS}: the per-block arrays take memory "
                   "per process, docs/agent.md)")
    p.add_argument("--max-layers", type=positive_int, default=abi.DEFAULT_MAX_CACHES,
                   metavar="N", help="layers (caches) counted per block at once, every "
                   f"engine's together (default {abi.DEFAULT_MAX_CACHES})")
    p.add_argument("--max-blocks", type=positive_int, default=abi.DEFAULT_MAX_BLOCKS,
                   metavar="N", help="blocks per layer counted exactly "
                   f"(default {abi.DEFAULT_MAX_BLOCKS})")
    p.add_argument("--calls-only", action="store_true",
                   help="stock vLLM: count ops without reading their tensors")
    p.add_argument("--cpu", type=cpu_list, metavar="LIST",
                   help="run the agent on these CPUs only (1, 0,2 or 2-3)")
    p.set_defaults(run=run)
    return p


def validate(args):
    args.prometheus_at = prometheus.parse_endpoint(args.prometheus)
    if args.max_blocks > 1 << 18:
        raise UsageError("--max-blocks must be at most 262144")
    if args.max_procs > 64:
        raise UsageError("--max-procs must be at most 64")
    if args.max_layers * args.max_blocks > 1 << 28:
        raise UsageError(f"--max-layers x --max-blocks must be at most {1 << 28} "
                         f"(2 GiB of counters); {args.max_layers} x {args.max_blocks} is more")
    if args.state:
        check_writable(args.state)
    _settings(args)


def program_options(args) -> dict:
    """The Tracer options that pick the agent's BPF program (its cache
    entry: scripts/compile-bpf.py compiles it at setup)."""
    return dict(max_blocks=args.max_blocks, max_caches=args.max_layers,
                max_procs=args.max_procs, perf_pages=64, index_stream="block_ids",
                transport=DEFAULT_TRANSPORT, gen_fill=True, reuse_rows=True)


def _settings(args):
    """The reloadable settings: the command line's, then --config's on top.
    Raises UsageError for a bad file or pattern."""
    include, exclude, grace = list(args.include or []), list(args.exclude or []), args.grace
    if args.config:
        try:
            with open(args.config) as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"--config {args.config}: {e.strerror or e}") from None
        words = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                words.extend(shlex.split(line if line.startswith("-") else "--" + line))
            except ValueError as e:
                raise UsageError(f"--config {args.config}:{n}: {e}") from None
        conf = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
        conf.add_argument("--include", action="append", default=[])
        conf.add_argument("--exclude", action="append", default=[])
        conf.add_argument("--grace", type=non_negative_float)
        try:
            got, extra = conf.parse_known_args(words)
        except (argparse.ArgumentError, ValueError) as e:
            raise UsageError(f"--config {args.config}: {e}") from None
        if extra:
            raise UsageError(f"--config {args.config}: unknown setting {extra[0]!r} "
                             "(include, exclude and grace are)")
        include += got.include
        exclude += got.exclude
        grace = got.grace if got.grace is not None else grace
    try:
        selection = node.Selection(include, exclude)
    except Exception as e:  # re.error
        raise UsageError(f"--include/--exclude: not a regular expression: {e}") from None
    return selection, GRACE_S if grace is None else grace


def _say(line):
    print(f"kvtrace-bpf: {line}", file=sys.stderr, flush=True)


class AgentExporter(prometheus.Exporter):
    """Every engine's series, labelled by what the node follower says of
    each process, and the agent's own: kvtrace_targets{state}."""

    def __init__(self, follower, residency):
        super().__init__("", residency)
        self.follower = follower
        self.states = dict.fromkeys(STATES, 0)  # replaced whole by the loop

    def label_names(self):
        return ["model_name", "engine", "port"]

    def label_values(self, pid):
        return list(self.follower.labels(pid))

    def forget(self, pid):
        self._roles.pop(pid, None)
        for key in [k for k in self._last_window if k[0] == pid]:
            del self._last_window[key]

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield from super().collect()
        g = GaugeMetricFamily("kvtrace_targets", "processes the agent knows of, by state: "
                              "traced, waiting (a candidate without probes yet), excluded "
                              "(--include/--exclude), refused (could not be traced: the "
                              "log says why), exited (series kept for --grace)",
                              labels=["state"])
        for state, n in self.states.items():
            g.add_metric([state], n)
        yield g


class _Attacher:
    """The Tracer as the follower sees it: an engine whose attach fails
    (another tracer's limit, a permission error, a kernel refusal) is one
    failure of that engine, never of the agent."""

    def __init__(self, tracer):
        self._tracer = tracer
        self.failed = {}  # pid -> why, since the last take

    def __getattr__(self, name):
        return getattr(self._tracer, name)

    def attach(self, pid, files, tensor_layout=None):
        try:
            return self._tracer.attach(pid, files, tensor_layout=tensor_layout)
        except TargetError as e:
            if "at once" in str(e):
                raise  # the follower says so and refuses the process
            self.failed[pid] = str(e)
        except (EnvironmentProblem, OSError) as e:
            self.failed[pid] = str(e)
        raise TargetError(self.failed[pid])


def run(args) -> int:
    validate(args)
    _few_arenas()
    if args.cpu:
        os.sched_setaffinity(0, args.cpu)
    from ..kernel.session import check_privileges

    check_privileges()
    selection, grace = _settings(args)
    follower = node.NodeFollower(selection, prometheus.model_name, calls_only=args.calls_only)
    residency = lifecycle.LiveResidency(lifecycle.StreamTap())
    exporter = AgentExporter(follower, residency)
    # bound before any BPF is loaded: a busy port fails in a second
    server = prometheus.start_server(*args.prometheus_at, exporter)
    stop = {"signal": None, "reload": False}

    def on_signal(signum, frame):
        if signum == signal.SIGHUP:
            stop["reload"] = True
        else:
            stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return Agent(args, follower, residency, exporter, selection, grace).run(stop)
    finally:
        prometheus.stop_server(server)
        for s, h in old.items():
            signal.signal(s, h)


class Agent:
    def __init__(self, args, follower, residency, exporter, selection, grace):
        self.args, self.follower, self.residency = args, follower, residency
        self.exporter, self.grace = exporter, grace
        self.follower.selection = selection
        self.targets = {}  # pid -> target.Target (its pidfd: the exit)
        self.exited = {}  # pid -> when it exited (series kept until + grace)
        self.refused = {}  # pid -> why
        self.sweep_until = 0.0  # forgotten engines' late events: _forget_residency until then
        self.tracer = None

    def run(self, stop) -> int:
        from ..kernel import process_events
        from ..kernel.session import Tracer
        from . import attach

        args = self.args
        t0 = time.monotonic()
        self.tracer = Tracer(**program_options(args), collector=self.residency.tap)
        # the reads of plugin-tier engines without block_table (step_rows,
        # the default), derived from their events as attach derives them;
        # a forgotten engine's late events are swept (_forget_residency)
        self.tracer.live_rows = self.residency.rows
        events = None
        try:
            events = process_events.ProcessEvents()
            self.attacher = _Attacher(self.tracer)
            self.follower.list_all()
            self._scan()
            where = attach._where(args.prometheus_at)
            _say(f"metrics on http://{where}/metrics" +
                 ("" if prometheus.is_loopback(args.prometheus_at[0]) else
                  " (not loopback: whoever reaches it sees the traffic's shape)"))
            _say(f"agent ready after {time.monotonic() - t0:.1f}s (BPF program "
                 f"{self.tracer.program_source}): {len(self.targets)} processes traced")
            self._loop(stop, events)
            _say(f"{stop['signal']}: detaching from {len(self.targets)} processes")
        finally:
            self.tracer.detach()  # first thing: every semaphore drops now
            if events is not None:
                events.close()
            self.follower.close()
            for t in self.targets.values():
                t.close()
            self.tracer.close()
        return 0

    def _loop(self, stop, events):
        prev = agg = self._aggregate()
        self.exporter.publish(agg)
        self._publish_states()
        now = time.monotonic()
        next_refresh, next_scan = now + self.args.interval, now + SCAN_S
        lost = 0
        while stop["signal"] is None:
            due = min(next_scan, next_refresh)
            self.tracer.poll(math.ceil(max(0.0, min(due - time.monotonic(), POLL_S)) * 1000))
            self.residency.tick()
            if self.sweep_until and time.monotonic() <= self.sweep_until:
                _forget_residency(self.residency, self.tracer.procs)
            if stop["reload"]:
                stop["reload"] = False
                self._reload()
                next_scan = 0.0
            if self.follower.on_events(events.take()):
                next_scan = 0.0  # a new candidate: scan it now
            if events.lost != lost:
                # a fork storm filled the buffers: what was lost is found
                # by listing /proc, once
                lost = events.lost
                _say(f"{lost} exec/fork events lost so far: listing every process again")
                self.follower.list_all()
                next_scan = 0.0
            now = time.monotonic()
            self._reap(now)
            if now >= next_scan:
                self._scan()
                quiet = now - self.follower.changed_at >= QUIET_AFTER_S
                next_scan = now + (SCAN_QUIET_S if quiet else SCAN_S)
            if now >= next_refresh:
                prev, agg = agg, self._aggregate()
                self.exporter.publish(agg, prev)
                self._publish_states()
                next_refresh = now + self.args.interval

    def _aggregate(self):
        from . import attach

        # only what the Aggregate keeps of each per-block row is copied
        # (Tracer.read_maps): the engines' pools, not the maps' sizes
        return attach._aggregate(self.tracer, self.tracer.read_maps(used_only=True))

    def _scan(self):
        f = self.follower
        f.prune()
        f.step(self.attacher)
        for line in f.take_notices():
            _say(line)
        for pid, why in self.attacher.failed.items():
            if pid not in self.refused:
                self.refused[pid] = why
                _say(f"pid {pid} ({discover.comm(pid)}): not traced: {why}")
            f.refused.add(pid)
            self._let_go(pid)  # what did attach stays closed
        self.attacher.failed.clear()
        for pid in list(f.refused):
            if pid not in self.refused:
                self.refused[pid] = OVER_MAX_PROCS
                self._let_go(pid)
        for pid, proc in self.tracer.procs.items():
            if pid in self.targets or pid in self.exited or not proc.uprobes:
                continue
            try:
                self.targets[pid] = target_mod.Target(pid, child=False)
            except TargetError:
                self.exited[pid] = time.monotonic()  # gone already

    def _let_go(self, pid):
        from ..kernel import release

        if pid in self.tracer.procs:
            release.forget(self.tracer, pid)

    def _reap(self, now):
        """Exited engines: uprobes closed at once, rows and series kept for
        --grace, then given back; refused and left-out processes that
        exited are forgotten."""
        from ..kernel import release

        for pid, t in list(self.targets.items()):
            if t.exited():
                t.close()
                del self.targets[pid]
                self.exited[pid] = now
                proc = self.tracer.procs.get(pid)
                if proc is not None:
                    for up in proc.uprobes:
                        up.close()
                    proc.uprobes.clear()
                    proc.attached.clear()
                self.follower.candidates.discard(pid)
                _say(f"pid {pid} exited: its series go in {self.grace:g}s")
        forgot = False
        for pid, when in list(self.exited.items()):
            if now - when >= self.grace:
                forgot = True
                del self.exited[pid]
                self.tracer.drain()  # records of its last ops, before its rows go
                self.residency.tick(force=True)
                release.forget(self.tracer, pid)
                self.follower.forget(pid)
                self.exporter.forget(pid)
                _forget_residency(self.residency, self.tracer.procs)
                # its block events still held back come in after it, and
                # would make its state again: swept until they are all in
                self.sweep_until = now + 2 * lifecycle.LiveResidency.HOLD_S
                # its place is free: engines refused for want of one are tried again
                for p in [p for p, why in self.refused.items() if why == OVER_MAX_PROCS]:
                    del self.refused[p]
                    self.follower.refused.discard(p)
        for pid in [p for p in self.refused if not os.path.exists(f"/proc/{p}")]:
            del self.refused[pid]
            self.follower.forget(pid)
        if forgot:
            _trim()

    def _reload(self):
        try:
            selection, grace = _settings(self.args)
        except UsageError as e:
            _say(f"SIGHUP: kept the settings before: {e}")
            return
        self.follower.selection, self.grace = selection, grace
        self.follower.passed.clear()  # decided again under the new patterns
        # a traced engine the new patterns leave out is let go
        for pid in list(self.targets):
            if not selection.wants(self.follower.texts(pid)):
                self.targets.pop(pid).close()
                self._let_go(pid)
                self.follower.passed.add(pid)
                _say(f"pid {pid}: left out by --include/--exclude: detached")
        self.follower.list_all()
        _say("SIGHUP: settings and processes read again")

    def _publish_states(self):
        f = self.follower
        traced = sum(1 for p in self.tracer.procs.values() if p.uprobes)
        states = dict(traced=traced, exited=len(self.exited), refused=len(self.refused),
                      excluded=len(f.passed),
                      waiting=sum(1 for p in f.candidates
                                  if p not in self.tracer.procs and p not in f.passed
                                  and p not in self.refused))
        self.exporter.states = states
        if self.args.state:
            from ..kernel import release

            doc = dict(time=time.time(), states=states, maps=release.hash_entries(self.tracer),
                       python_blocks=sys.getallocatedblocks(),
                       processes=[dict(pid=pid, comm=p.comm, tier=p.tier,
                                       state="exited" if pid in self.exited else "traced",
                                       model_name=f.labels(pid)[0])
                                  for pid, p in sorted(self.tracer.procs.items())],
                       refused=[dict(pid=pid, why=why) for pid, why in self.refused.items()])
            try:
                write_file(self.args.state, json.dumps(doc, indent=1) + "\n")
            except Exception as e:  # a full disk: said, and the agent goes on
                _say(f"--state {self.args.state}: {e}")


def _few_arenas():
    """At most two malloc arenas (glibc's M_ARENA_MAX), before any thread
    starts: each scrape is served by a thread of its own, and glibc gives
    threads arenas of their own (up to 8 per CPU), whose free pages stay
    in the agent's RSS for as long as it runs."""
    if _LIBC:
        _LIBC.mallopt(-8, 2)  # M_ARENA_MAX


def _trim():
    """After an engine is forgotten: collect the cyclic garbage, then give
    the heap's free pages back (glibc's malloc_trim).  The collection frees
    what the refreshes since the last one left in cycles (each --state
    write's indented JSON encoder is a few closures that refer to each
    other), before the trim and before the next --state counts Python's
    blocks.  The trim: the per-block arrays each refresh copies are too
    big for Python's allocator and small enough for malloc's heap, whose
    free space an engine's exit leaves in the middle, where it would stay
    counted in the agent's RSS."""
    import gc

    gc.collect()
    if _LIBC:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


_LIBC = _libc()


def _forget_residency(residency, traced):
    """Drop the residency state of every process not in `traced`: the one
    let go now, and the block events of one let go before that arrived
    after it was (they are held back LiveResidency.HOLD_S)."""
    for pid in [p for p in residency._counts if p not in traced]:
        del residency._counts[pid]
    r = residency.residency
    for pid in [p for p in r.samples if p not in traced]:
        del r.samples[pid]
    for key in [k for k in r._blocks if k[0] not in traced]:
        del r._blocks[key]
    # the step_rows it fed to the derived reads (derived_rows.LiveRows)
    rows = residency.rows.groups
    for key in [k for k in rows if k[0] not in traced]:
        del rows[key]
