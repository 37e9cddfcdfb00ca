"""`attach --prometheus [ADDR:]PORT`: the live aggregate as Prometheus metrics.

The tracing loop already reads the BPF maps once per refresh and turns them
into an Aggregate.  It hands each one to Exporter.publish(), which works out
the figures of the last interval (working set, true utilization, the access
histograms) and swaps in one immutable snapshot.  A scrape runs in
prometheus_client's HTTP thread and only formats that snapshot: it never
reads a map, never takes a lock the loop holds, and never waits for the loop.
The plugin tier's residency histograms are fed by the loop too, after each
poll (lifecycle.LiveResidency), and copied into the snapshot at publish().
docs/metrics.md lists every metric and how it is computed.
"""

import errno
import ipaddress
import math
import shlex
import socket
import threading
import time

import numpy as np

from .. import abi
from ..analysis.aggregate import BYTES_OPS
from ..errors import EnvironmentProblem, UsageError
from ..probes import discover

# Not vLLM's 8000, Dynamo's 8000/8081, ebpf_exporter's 9435, Prometheus's own
# 9090-9093 or node_exporter's 9100 (docs/metrics.md).
DEFAULT_PORT = 9472
DEFAULT_ADDR = "127.0.0.1"  # the endpoint reveals traffic shape: local unless asked

# Reads of one block in one window: powers of two.  A decode step reads a
# request's every block once, so a window of a few hundred steps reaches
# the hundreds; beyond 4096 only +Inf says more.
READ_BUCKETS = tuple(float(1 << i) for i in range(13))
# Tokens written into one block in one window: up to a few block sizes.
WRITE_BUCKETS = tuple(float(1 << i) for i in range(11))
# A block generation's fill at its end, as a fraction of the block: in
# sixteenths, one token each at vLLM's usual block size of 16.
FILL_BUCKETS = tuple(i / 16 for i in range(1, 17))

def parse_endpoint(text):
    """'PORT', 'ADDR:PORT', '[V6ADDR]:PORT' or None (the flag alone) ->
    (host, port).  Raises UsageError for anything else."""
    if text is None:
        return DEFAULT_ADDR, DEFAULT_PORT
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = DEFAULT_ADDR, text
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise UsageError(f"--prometheus {text!r}: write an IPv6 address in brackets, "
                         "[ADDR]:PORT")
    if not host:
        host = DEFAULT_ADDR
    if not port_text.isdigit():
        raise UsageError(f"--prometheus {text!r}: not [ADDR:]PORT (PORT is 1..65535)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise UsageError(f"--prometheus {text!r}: port {port} is not in 1..65535")
    return host, port


def start_server(host, port, exporter):
    """Bind and serve /metrics; returns the server (shut it down with
    stop_server).  Called before any BPF is loaded, so that a busy port or
    an address this host does not have is one line, not a traced target
    left without its endpoint."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise EnvironmentProblem("--prometheus needs the prometheus-client package "
                                 "(make setup, or pip install prometheus-client)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except socket.gaierror:
        raise UsageError(f"--prometheus {where}: no such address") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise EnvironmentProblem(f"--prometheus {where}: port {port} is in use "
                                     "(another exporter? pick another port)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--prometheus {where}: {host} is not an address of "
                             "this host") from None
        if e.errno == errno.EACCES:
            raise EnvironmentProblem(f"--prometheus {where}: not allowed to bind "
                                     f"port {port}") from None
        raise EnvironmentProblem(f"--prometheus {where}: {e.strerror or e}") from None
    server.set_app(_counting(server.get_app(), exporter))
    return server


class _Sent:
    """A response body that tells the exporter once it was sent: wsgiref
    writes each chunk to the socket before it asks for the next, and calls
    close() at the end, also when the client went away midway (not sent)."""

    def __init__(self, body, on_sent):
        self.body, self.on_sent, self.done = body, on_sent, False

    def __iter__(self):
        yield from self.body
        self.done = True

    def close(self):
        if self.done:
            self.on_sent()


def _counting(app, exporter):
    """The metrics app, telling the exporter about each scrape whose
    response held the final snapshot (Exporter.final_scraped)."""

    def counted(environ, start_response):
        # read before the app runs: publish_final() swaps the snapshot in
        # before it sets `final`, so this scrape formats the final one
        final = exporter.final.is_set()
        body = app(environ, start_response)
        if not final or environ.get("REQUEST_METHOD") != "GET" or \
                environ.get("PATH_INFO") == "/favicon.ico":
            return body
        return _Sent(body, exporter.final_scraped.set)

    return counted


def stop_server(server):
    server.shutdown()
    server.server_close()


def is_loopback(host) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def role(comm: str) -> str:
    """vLLM's process names: EngineCore_DP0 / VLLM::EngineCore (the engine,
    which also runs the model at world size 1), VllmWorker-N /
    VLLM::Worker_TPn (tensor-parallel workers).  A comm is cut at 15
    characters: 'VLLM::EngineCor'."""
    c = comm.lower()
    if "enginecor" in c or "engine_cor" in c:
        return "engine_core"
    if "worker" in c:
        return "worker"
    return "other"


def model_name(argv) -> str:
    """The model the target serves, as vLLM labels its own series
    (model_name = --served-model-name, else --model, else `vllm serve
    MODEL`), or '' when the command line does not say.  argv: a list, or a
    /proc cmdline joined with spaces."""
    if isinstance(argv, str):
        try:
            argv = shlex.split(argv)
        except ValueError:
            argv = argv.split()
    found = {}
    for i, a in enumerate(argv):
        for flag in ("--served-model-name", "--model"):
            if a == flag and i + 1 < len(argv):
                found.setdefault(flag, argv[i + 1])
            elif a.startswith(flag + "="):
                found.setdefault(flag, a.split("=", 1)[1])
    for flag in ("--served-model-name", "--model"):
        if found.get(flag):
            return found[flag]
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        if a == "serve" and i > 0 and "vllm" in argv[i - 1] and not nxt.startswith("-"):
            return nxt
    return ""


def _delta(now, before):
    """now - before per block, an old array shorter or missing as zeros."""
    out = now.astype(np.int64)
    if before is not None and len(before):
        n = min(len(out), len(before))
        out[:n] -= before[:n].astype(np.int64)
    return np.maximum(out, 0)


def _buckets(values, bounds):
    """Cumulative (le, count) pairs of positive values, and their sum."""
    from prometheus_client.utils import floatToGoString

    values = values[values > 0]
    counts = [int(np.count_nonzero(values <= b)) for b in bounds]
    pairs = [(floatToGoString(b), c) for b, c in zip(bounds, counts)]
    pairs.append(("+Inf", int(len(values))))
    return pairs, float(values.sum())


def _generation_fill(p):
    """The fill of the block generations that ended, from the process's
    first layer (every layer of a step writes the same slots): cumulative
    (le, count) over FILL_BUCKETS, the sum of the fractions, and the
    generations left out (start unseen); None without the counts."""
    from prometheus_client.utils import floatToGoString

    layer = next((l for l in p.layers if l.fill_ended is not None and l.block_size), None)
    if layer is None:
        return None
    ended = layer.fill_ended.astype(np.int64)
    tokens = np.arange(len(ended))
    bs = layer.block_size
    # tokens / bs <= i / 16  <=>  16 tokens <= i bs: exact in integers
    counts = [int(ended[16 * tokens <= i * bs].sum()) for i in range(1, 17)]
    pairs = [(floatToGoString(b), c) for b, c in zip(FILL_BUCKETS, counts)]
    pairs.append(("+Inf", int(ended.sum())))
    return dict(buckets=pairs, sum=float((ended * tokens).sum()) / bs,
                unseen=layer.fill_unseen)


def _residency(hists):
    """lifecycle.LiveResidency's histograms of one process, le written as
    Prometheus writes it."""
    from prometheus_client.utils import floatToGoString

    return {n: ([(le if le == "+Inf" else floatToGoString(le), c) for le, c in buckets], total)
            for n, (buckets, total) in hists.items()}


def _life(p):
    """The plugin tier's figures for one process, or None without it: blocks
    per lifecycle event, and the blocks held now (a block is held while the
    references requests took, by allocation or prefix hit, outnumber those
    they dropped; since the tracer attached)."""
    if not p.life:
        return None
    n = max(len(v) for v in p.life.values())

    def full(kind):
        a = np.zeros(n, dtype=np.int64)
        v = p.life.get(kind)
        if v is not None:
            a[:len(v)] = v
        return a

    taken = full("alloc") + full("hit")
    ops = p.ops
    return dict(events={k: int(v.sum()) for k, v in p.life.items()},
                held=int(np.count_nonzero(taken > full("free"))),
                requests=ops.get("request", {}).get("calls", 0),
                finished=ops.get("req_finish", {}).get("calls", 0),
                preemptions=ops.get("req_preempt", {}).get("calls", 0),
                recomputed=ops.get("req_preempt", {}).get("items", 0))


class Exporter:
    """A prometheus_client collector over the snapshot the loop publishes."""

    def __init__(self, model: str = "", residency=None):
        self.model = model
        # lifecycle.LiveResidency when the index stream is on: the plugin
        # tier's block lifetime, idle and reuse-gap histograms
        self.residency = residency
        self._snap = None  # replaced whole, never changed: a scrape reads one
        self._last_window = {}  # (pid, group) -> (working set, tokens held, utilization)
        self._roles = {}  # pid -> role, once it is not 'other'
        self._last_agg = None  # the last published Aggregate: the final window's start
        # set once the whole run's snapshot is served (publish_final), and
        # once a scrape's response with it was sent: attach keeps the
        # endpoint up until then, or --prometheus-linger seconds
        self.final = threading.Event()
        self.final_scraped = threading.Event()

    # -- the loop's side -------------------------------------------------

    def publish(self, agg, prev=None):
        """Called by the tracing loop with each refresh's Aggregate and the
        one before it (the window).  Cheap: sums and one numpy pass per
        group and layer, no map reads."""
        self._last_agg = agg
        before = prev.processes if prev is not None else {}
        procs = []
        for p in sorted(agg.processes.values(), key=lambda p: p.pid):
            q = before.get(p.pid)
            old_groups = {g.group_id: g for g in q.groups} if q else {}
            groups = []
            for g in p.groups:
                o = old_groups.get(g.group_id)
                d_steps = g.steps - (o.steps if o else 0)
                d_distinct = g.distinct - (o.distinct if o else 0)
                d_held = g.held_tokens - (o.held_tokens if o else 0)
                key = (p.pid, g.group_id)
                if d_steps > 0:
                    ws, tokens_held = d_distinct / d_steps, d_held / d_steps
                    util = (d_held / (d_distinct * g.block_size)
                            if d_distinct and g.block_size else math.nan)
                    self._last_window[key] = (ws, tokens_held, util)
                else:
                    # no step in this window: the figures of the last window
                    # that had one, so that a pause is not a drop to zero
                    ws, tokens_held, util = self._last_window.get(key, (0.0, 0.0, math.nan))
                freq = _delta(g.reads_per_block, o.reads_per_block if o else None)
                groups.append(dict(group=g.group, reads=g.reads, steps=g.steps,
                                   requests=g.requests, tokens=g.tokens,
                                   distinct=g.distinct, held_tokens=g.held_tokens,
                                   layers=g.layers, block_size=g.block_size,
                                   num_blocks=g.num_blocks, working_set=ws,
                                   tokens_held=tokens_held, utilization=util,
                                   freq=_buckets(freq, READ_BUCKETS)))
            old_tokens = q.tokens if q else None
            written = _delta(p.tokens, old_tokens)
            # block_table's "slots" are blocks read, and moves have none
            write_ops = {op: st for op, st in p.ops.items() if op in abi.WRITE_OPS}
            procs.append(dict(
                pid=str(p.pid), role=self._role(p), labels=self.label_values(p.pid),
                ops={op: dict(st) for op, st in p.ops.items()},
                slots=sum(st["slots"] for st in write_ops.values()),
                layers=[(l.layer, l.slots) for l in p.layers],
                num_layers=len(p.layers),
                num_blocks=p.num_blocks,
                block_size=max([l.block_size for l in p.layers] +
                               [g.block_size for g in p.groups] + [0]),
                moves={k: int(v.sum()) for k, v in p.moves.items()},
                life=_life(p),
                # with the plugin tier only; zero counts until its first sample
                residency=_residency(self.residency.histograms(p.pid))
                if p.life and self.residency else None,
                misses=self.residency.misses.totals(p.pid)
                if p.life and self.residency and self.residency.misses else None,
                groups=groups,
                generation_fill=_generation_fill(p),
                written=_buckets(written, WRITE_BUCKETS)))
        # the time the maps were read, not now: a scraper that waits for a
        # snapshot after some moment must get counts read after it
        taken = time.time() - max(0.0, time.monotonic() - agg.time)
        self._snap = dict(
            time=taken, procs=procs, exact=not agg.inexact_reasons(),
            lost=int(agg.lost), records=int(agg.records),
            missed=int(agg.globals.get("missed_hits", 0)),
            foreign=int(agg.globals.get("foreign", 0)),
            chunks_lost=int(agg.globals.get("chunks_lost", 0)),
            left_out=self.residency.incomplete if self.residency else 0)

    def publish_final(self, agg):
        """After detach and drain: the whole run's counts, its last window
        since the last refresh."""
        self.publish(agg, self._last_agg)
        self.final.set()

    def label_names(self) -> list:
        """The labels every process's series have after pid and role
        (the agent's Exporter has more: commands/agent.py)."""
        return ["model_name"] if self.model else []

    def label_values(self, pid: int) -> list:
        return [self.model] if self.model else []

    def _role(self, p):
        """The role by the process's comm now: vLLM renames its engine and
        workers after they start, so the comm the tracer found them with
        can be the interpreter's.  One /proc read per refresh, until known."""
        if p.pid not in self._roles:
            r = role(p.comm)
            if r == "other":
                r = role(discover.comm(p.pid))
            if r != "other":
                self._roles[p.pid] = r
            return r
        return self._roles[p.pid]

    # -- the scrape's side -------------------------------------------------

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily,
                                            GaugeMetricFamily, HistogramMetricFamily)

        snap = self._snap  # one reference read: the loop may swap it meanwhile
        base = ["pid", "role", *self.label_names()]

        def fam(kind, name, doc, labels=()):
            return kind(name, doc, labels=[*base, *labels])

        up = GaugeMetricFamily("kvtrace_snapshot_timestamp_seconds",
                               "Unix time of the aggregate this scrape shows (the "
                               "tracer refreshes it every --interval)")
        if snap is None:
            yield up
            return
        up.add_metric([], snap["time"])
        yield up
        exact = GaugeMetricFamily("kvtrace_exact", "1 when every count is exact "
                                  "(docs/json-schema.md inexact_reasons), else 0")
        exact.add_metric([], 1.0 if snap["exact"] else 0.0)
        yield exact
        for name, doc, value in (
                ("kvtrace_records_total", "per-op perf records delivered", snap["records"]),
                ("kvtrace_records_lost_total", "per-op perf records lost (the counts never "
                 "come from them)", snap["lost"]),
                ("kvtrace_slot_chunks_lost_total", "index-stream chunks lost (-o, "
                 "--prometheus)", snap["chunks_lost"]),
                ("kvtrace_block_events_left_out_total", "block events (plugin tier) left "
                 "out of the residency histograms: some of their ids were lost (an event "
                 "whose op record was lost counts in records_lost)",
                 snap["left_out"]),
                ("kvtrace_probe_misses_total", "probe hits the kernel skipped (another BPF "
                 "program was running on that CPU)", snap["missed"]),
                ("kvtrace_foreign_hits_total", "probe hits of processes not traced, dropped",
                 snap["foreign"])):
            c = CounterMetricFamily(name[:-len("_total")], doc)
            c.add_metric([], value)
            yield c

        ops = fam(CounterMetricFamily, "kvtrace_ops", "op calls", ["op"])
        items = fam(CounterMetricFamily, "kvtrace_op_items", "items per op: slots for "
                    "writes, block pairs for copies and swaps, blocks for block_table",
                    ["op"])
        padding = fam(CounterMetricFamily, "kvtrace_op_padding_slots",
                      "padding slots (-1) skipped", ["op"])
        nbytes = fam(CounterMetricFamily, "kvtrace_op_bytes", "bytes moved by copies "
                     "and swaps", ["op"])
        slots = fam(CounterMetricFamily, "kvtrace_slots_written",
                    "valid slots written, all layers together")
        layer_slots = fam(CounterMetricFamily, "kvtrace_layer_slots_written",
                          "valid slots written into one layer's KV cache", ["layer"])
        copied = fam(CounterMetricFamily, "kvtrace_blocks_copied",
                     "blocks copied (copy_blocks pairs)")
        swapped = fam(CounterMetricFamily, "kvtrace_blocks_swapped",
                      "blocks swapped out of and into the device", ["direction"])
        reads = fam(CounterMetricFamily, "kvtrace_block_reads", "(request, block) "
                    "reads by attention, counted once per step per group", ["group"])
        steps = fam(CounterMetricFamily, "kvtrace_steps", "forward steps that read "
                    "the group's block table", ["group"])
        rows = fam(CounterMetricFamily, "kvtrace_batch_requests", "request rows of the "
                   "block table, summed over steps", ["group"])
        live = fam(CounterMetricFamily, "kvtrace_live_blocks", "distinct blocks read "
                   "per step, summed over steps", ["group"])
        held = fam(CounterMetricFamily, "kvtrace_live_tokens", "tokens held in each "
                   "step's distinct blocks, summed over steps", ["group"])
        layers = fam(GaugeMetricFamily, "kvtrace_layers", "KV caches (layers) seen")
        group_layers = fam(GaugeMetricFamily, "kvtrace_group_layers",
                           "layers reading the group's table per step", ["group"])
        blocks = fam(GaugeMetricFamily, "kvtrace_cache_blocks",
                     "blocks per KV cache, as the probes report")
        bsize = fam(GaugeMetricFamily, "kvtrace_block_size_tokens", "tokens per block")
        ws = fam(GaugeMetricFamily, "kvtrace_working_set_blocks", "distinct blocks read "
                 "per step over the last interval (delta live blocks / delta steps)",
                 ["group"])
        tokens_held = fam(GaugeMetricFamily, "kvtrace_tokens_held", "tokens in the "
                          "blocks one step reads, over the last interval (delta live "
                          "tokens / delta steps)", ["group"])
        util = fam(GaugeMetricFamily, "kvtrace_true_utilization_ratio", "tokens held / "
                   "(distinct blocks read x block size) over the last interval", ["group"])
        frag = fam(GaugeMetricFamily, "kvtrace_internal_fragmentation_ratio", "1 - true "
                   "utilization: the share of the live blocks' slots holding no token, "
                   "over the last interval", ["group"])
        events = fam(CounterMetricFamily, "kvtrace_block_events", "blocks per lifecycle "
                     "event the scheduler decided (plugin tier)", ["event"])
        held_blocks = fam(GaugeMetricFamily, "kvtrace_blocks_held", "blocks some request "
                          "holds now (plugin tier, since attach)")
        req_seen = fam(CounterMetricFamily, "kvtrace_requests", "requests the scheduler "
                       "took in (plugin tier)")
        req_done = fam(CounterMetricFamily, "kvtrace_requests_finished", "requests that "
                       "finished (plugin tier)")
        preempt = fam(CounterMetricFamily, "kvtrace_preemptions", "requests preempted "
                      "(plugin tier)")
        recomp = fam(CounterMetricFamily, "kvtrace_recomputed_tokens", "computed tokens "
                     "preempted requests lost (plugin tier)")
        freq = fam(GaugeHistogramMetricFamily, "kvtrace_block_access_frequency",
                   "blocks by reads in the last interval (blocks read at least once)",
                   ["group"])
        # vLLM's vllm:kv_block_*_seconds, same buckets (lifecycle.RESIDENCY_BUCKETS)
        residency = {
            "lifetime": fam(HistogramMetricFamily, "kvtrace_block_lifetime_seconds",
                            "block lifetime, from its allocation to its next one (vLLM's "
                            "eviction), every block (plugin tier, since attach)"),
            "idle_before_evict": fam(HistogramMetricFamily,
                                     "kvtrace_block_idle_before_evict_seconds",
                                     "block idle time, from its last access (allocation or "
                                     "prefix hit) to its next allocation (plugin tier)"),
            "reuse_gap": fam(HistogramMetricFamily, "kvtrace_block_reuse_gap_seconds",
                             "time between consecutive prefix hits of one block life "
                             "(plugin tier)")}
        miss = fam(CounterMetricFamily, "kvtrace_prefix_misses", "prompt blocks requests "
                   "computed at their first admission, by why the prefix cache missed "
                   "them (docs/misses.md; plugin tier, since attach)", ["cause"])
        miss_tokens = fam(CounterMetricFamily, "kvtrace_prefix_miss_tokens", "tokens "
                          "recomputed because of each cause (below_block: the shareable "
                          "ones)", ["cause"])
        gen_fill = fam(HistogramMetricFamily, "kvtrace_block_generation_fill_ratio",
                       "block generations that ended (a write at offset 0, a copy or a "
                       "swap-in started the next), by the share of the block they held "
                       "at the end; the process's first layer, since attach")
        gen_unseen = fam(CounterMetricFamily, "kvtrace_block_generations_unseen",
                         "block generations that ended whose start the tracer did not see "
                         "(begun before attach): not in the fill histogram")
        wfill = fam(GaugeHistogramMetricFamily, "kvtrace_block_tokens_written",
                    "blocks by tokens written in the last interval (blocks written "
                    "at least once)")

        for p in snap["procs"]:
            lv = [p["pid"], p["role"], *p["labels"]]
            for op, st in p["ops"].items():
                ops.add_metric([*lv, op], st["calls"])
                items.add_metric([*lv, op], st["items"])
                padding.add_metric([*lv, op], st["padding"])
                if op in BYTES_OPS:  # elsewhere bytes are not measured: no series
                    nbytes.add_metric([*lv, op], st["bytes"])
            slots.add_metric(lv, p["slots"])
            for layer, n in p["layers"]:
                layer_slots.add_metric([*lv, str(layer)], n)
            copied.add_metric(lv, p["moves"].get("copy_src", 0))
            swapped.add_metric([*lv, "out"], p["moves"].get("swap_out", 0))
            swapped.add_metric([*lv, "in"], p["moves"].get("swap_in", 0))
            layers.add_metric(lv, p["num_layers"])
            blocks.add_metric(lv, p["num_blocks"])
            bsize.add_metric(lv, p["block_size"])
            buckets, total = p["written"]
            wfill.add_metric(lv, buckets, total)
            gf = p.get("generation_fill")
            if gf:
                gen_fill.add_metric(lv, gf["buckets"], gf["sum"])
                gen_unseen.add_metric(lv, gf["unseen"])
            life = p.get("life")
            if life:
                for kind, n in life["events"].items():
                    events.add_metric([*lv, kind], n)
                held_blocks.add_metric(lv, life["held"])
                req_seen.add_metric(lv, life["requests"])
                req_done.add_metric(lv, life["finished"])
                preempt.add_metric(lv, life["preemptions"])
                recomp.add_metric(lv, life["recomputed"])
            for name, (buckets, total) in (p.get("residency") or {}).items():
                residency[name].add_metric(lv, buckets, total)
            for cause, t in (p.get("misses") or {}).items():
                miss.add_metric([*lv, cause], t["blocks"])
                miss_tokens.add_metric([*lv, cause], t["tokens"])
            for g in p["groups"]:
                gl = [*lv, str(g["group"])]
                reads.add_metric(gl, g["reads"])
                steps.add_metric(gl, g["steps"])
                rows.add_metric(gl, g["requests"])
                live.add_metric(gl, g["distinct"])
                held.add_metric(gl, g["held_tokens"])
                group_layers.add_metric(gl, g["layers"])
                ws.add_metric(gl, g["working_set"])
                tokens_held.add_metric(gl, g["tokens_held"])
                util.add_metric(gl, g["utilization"])
                frag.add_metric(gl, 1 - g["utilization"])  # NaN stays NaN
                buckets, total = g["freq"]
                freq.add_metric(gl, buckets, total)
        yield from (ops, items, padding, nbytes, slots, layer_slots, copied, swapped,
                    reads, steps, rows, live, held, layers, group_layers, blocks, bsize,
                    ws, tokens_held, util, frag, freq, wfill, gen_fill, gen_unseen, events,
                    held_blocks, req_seen,
                    req_done, preempt, recomp, *residency.values(), miss, miss_tokens)
