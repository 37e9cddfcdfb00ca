"""`kvtrace-bpf audit-kv-events`: does vLLM's own KV event stream tell the
truth?  Subscribes to vLLM's ZMQ KV events while recording the plugin tier
(record's tracing loop), then compares the two event by event
(analysis/kv_audit.py, docs/kv-events.md).  Or, offline, a recording
(`--trace`) against a capture of the stream (`--kv-events-file`).
"""

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from urllib.parse import urlsplit

import numpy as np

from .. import abi
from ..analysis import kv_audit, lifecycle
from ..errors import TargetError, UsageError
from ..files import check_writable, write_file
from ..trace import kv_events, tracefile
from .args import positive_float, positive_int

EXAMPLES = """\
examples:
  # vLLM with the kvtrace plugin, prefix caching and its KV events on port
  # 5557:
  vllm serve MODEL --enable-prefix-caching \\
      --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                           "endpoint": "tcp://*:5557"}' &
  sudo kvtrace-bpf audit-kv-events -p $(pgrep -of 'vllm serve|vllm.entrypoints') \\
      --kv-events tcp://127.0.0.1:5557 -d 60 --json audit.json

vLLM started under the auditor, its recording kept for report or a later audit:
  sudo kvtrace-bpf audit-kv-events --kv-events tcp://127.0.0.1:5557 -o run.kvt -- vllm serve ...
offline, a recording against a capture of the stream's messages:
  kvtrace-bpf audit-kv-events --trace run.kvt --kv-events-file events.frames

exit codes: 0 the audit ran (its findings are in the summary), 1 usage,
2 environment, 3 target (not vLLM, no kvtrace plugin in the recording, the
endpoint unreachable or no KV events from it), 4 data (a trace or capture
that cannot be read), 5 output
"""


def add_parser(sub):
    p = sub.add_parser(
        "audit-kv-events", help="check vLLM's KV event stream against its scheduler",
        description="Subscribe to vLLM's KV event stream (ZMQ) while tracing its scheduler\n"
                    "with the kvtrace plugin, and compare them event by event: events\n"
                    "missing or extra, removals while another copy of the hash is resident,\n"
                    "reused blocks announced as new, and the drift of an indexer built from\n"
                    "the stream (docs/kv-events.md). Token ids are never decoded. Needs\n"
                    "root, except offline (--trace with --kv-events-file).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", type=positive_int, help="trace this running vLLM")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="vLLM's publisher to subscribe to: tcp://HOST:PORT (or ipc://PATH)")
    p.add_argument("--topic", default="", help="the publisher's topic (default: all)")
    p.add_argument("-d", "--duration", type=positive_float, metavar="S",
                   help="stop after S seconds")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="keep the recording of the plugin tier (for report, or --trace)")
    p.add_argument("--trace", metavar="FILE", help="offline: a recording (record -o)")
    p.add_argument("--kv-events-file", metavar="FILE",
                   help="offline: the stream's messages, each frame (topic, seq, payload) "
                   "prefixed by its length, 4 bytes big-endian")
    p.add_argument("--json", metavar="FILE", help="write the audit as JSON ('-': stdout)")
    p.add_argument("--limit", type=positive_int, default=kv_audit.LIMIT, metavar="N",
                   help=f"findings listed per kind (default {kv_audit.LIMIT}; all counted)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- CMD [ARG...]: start CMD (vLLM) and audit it")
    p.set_defaults(run=run)
    return p


def _endpoint(text: str):
    u = urlsplit(text)
    if u.scheme == "ipc" and text[len("ipc://"):]:
        return None
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or not port:
        raise UsageError(f"--kv-events must be tcp://HOST:PORT or ipc://PATH: {text!r}")
    return u.hostname, port


def validate(args):
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    live = bool(args.pid or args.command or args.kv_events)
    offline = bool(args.trace or args.kv_events_file)
    if live and offline:
        raise UsageError("give -p/-- CMD with --kv-events, or --trace with --kv-events-file")
    if offline:
        if not (args.trace and args.kv_events_file):
            raise UsageError("--trace and --kv-events-file go together")
        if args.output or args.duration:
            raise UsageError("-o and -d go with a live audit (-p or -- CMD)")
    else:
        if bool(args.pid) == bool(args.command):
            raise UsageError("give exactly one of -p PID or -- CMD [ARG...]")
        if not args.kv_events:
            raise UsageError("give --kv-events ENDPOINT: vLLM's KV event publisher")
        args.kv_at = _endpoint(args.kv_events)
    for path in (args.output, args.json if args.json != "-" else None):
        if path:
            check_writable(path)


def run(args) -> int:
    validate(args)
    if args.trace:
        return _report(args, args.trace, kv_events.read_capture(args.kv_events_file),
                       f"{args.kv_events_file}")
    if args.pid and args.kv_at:
        # unreachable is told now, not after a whole run without events
        try:
            socket.create_connection(args.kv_at, timeout=3).close()
        except OSError as e:
            raise TargetError(f"cannot connect to {args.kv_events}: {e.strerror or e} (is "
                              "vLLM run with --kv-events-config and the zmq publisher?)"
                              ) from None
    tmp = None
    path = args.output
    if not path:
        tmp = tempfile.mkdtemp(prefix="kvtrace-audit-")
        path = os.path.join(tmp, "run.kvt")
    try:
        sub = kv_events.Subscriber(args.kv_events, args.topic)
        try:
            rc = _record(args, path)
        finally:
            time.sleep(0.5)  # the last step's batch, published after its step
            batches = sub.close()
        if rc != 0:
            return rc
        if not batches:
            raise TargetError(f"no KV events came from {args.kv_events}: is vLLM run with "
                              "--kv-events-config (enable_kv_cache_events, the zmq "
                              "publisher, this endpoint) and prefix caching?")
        return _report(args, path, batches, args.kv_events)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _record(args, path) -> int:
    """record's tracing loop, its arguments from record's own parser."""
    from . import attach, record

    parser = argparse.ArgumentParser(prog="kvtrace-bpf")
    record.add_parser(parser.add_subparsers())
    argv = ["record", "-o", path]
    if args.duration:
        argv += ["-d", str(args.duration)]
    argv += ["-p", str(args.pid)] if args.pid else ["--", *args.command]
    return attach.run(parser.parse_args(argv))


def truth_of(trace) -> list:
    """The scheduler's cache and evict events (the plugin tier's block_cache
    and block_evict), one Truth per block, in the order it took them."""
    ev = lifecycle.events(trace.ops)
    cache, evict = abi.LIFE.index("cache"), abi.LIFE.index("evict")
    # vLLM publishes events only with prefix caching on, and then its
    # scheduler caches blocks: a recording without block_cache, block_hit
    # or block_evict has no plugin tier (stock vLLM's uprobes alone)
    life = [abi.OPS[f"block_{k}"] for k in ("cache", "hit", "evict")]
    if not np.isin(trace.ops.ops["op"], life).any():
        raise TargetError(f"{trace.path}: no block_cache, block_hit or block_evict of the "
                          "kvtrace plugin: install it where vLLM runs (docs/plugin.md), "
                          "with prefix caching on")
    pick = np.flatnonzero(np.isin(ev.kind, [cache, evict]))
    pick = pick[np.argsort(ev.ts_ns[pick], kind="stable")]
    return [kv_audit.Truth(kv_audit.STORED if ev.kind[i] == cache else kv_audit.REMOVED,
                           int(ev.group[i]), int(ev.hash[i]), int(ev.block[i]), int(ev.req[i]),
                           int(ev.ts_ns[i]))
            for i in pick]


def _report(args, path, batches, source) -> int:
    trace = tracefile.load(path)
    truth = truth_of(trace)
    said, facts = kv_audit.stream_items(batches)
    ts = trace.ops.ops["ts_ns"]
    doc = kv_audit.audit(truth, said, facts, limit=args.limit,
                         trace_end_ns=int(ts.max()) if len(ts) else None)
    doc["source"] = source
    if args.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    sys.stdout.write(text(doc))  # first: a --json that cannot be written loses only itself
    sys.stdout.flush()
    if args.json:
        write_file(args.json, json.dumps(doc, indent=1) + "\n")
    return 0


def text(doc: dict) -> str:
    c, s, m, d = doc["counts"], doc["stream"], doc["matched"], doc["drift"]
    lines = [
        f"KV events from {doc.get('source')}: {s.get('batches', 0)} batches, "
        f"{s.get('stored', 0)} hashes stored, {s.get('removed', 0)} removed, "
        f"{s.get('cleared', 0)} cleared"
        + (f", {s['other_medium']} of other media (not audited)" if s.get("other_medium")
           else ""),
        f"the scheduler: {doc['truth']['cached']} blocks cached, "
        f"{doc['truth']['evicted']} evicted",
        f"matched: {m['stored']} stored, {m['removed']} removed"
        + (f" ({doc['reordered']} reordered)" if doc["reordered"] else ""),
        f"verdict: {'no discrepancy' if doc['clean'] else 'DISCREPANCIES'}",
    ]
    if s.get("seq_gaps"):
        lines.append(f"  messages lost (seq): {s['seq_gaps']}")
    for kind, what in (("missing", "happened, not announced"),
                       ("extra", "announced, did not happen"),
                       ("removed_while_resident", "removed while another copy is resident"),
                       ("reuse_as_new", "reused blocks announced as stored"),
                       ("stored_again", "a second copy stored (true, but unmarked)")):
        lines.append(f"  {kind}: {c[kind]}  ({what})")
        for x in doc[kind][:5]:
            lines.append("    " + " ".join(f"{k}={v}" for k, v in x.items()))
    lines.append(f"indexer drift: max {d['ghost']} believed but gone (seq {d['ghost_at_seq']}),"
                 f" {d['unseen']} resident but unknown (seq {d['unseen_at_seq']}); final "
                 f"{d['final_ghost']} and {d['final_unseen']}")
    if doc["edge"]["truth"] or doc["edge"]["stream"]:
        lines.append(f"not judged (before the first or after the last match): "
                     f"{doc['edge']['truth']} scheduler, {doc['edge']['stream']} stream events")
    return "\n".join(lines) + "\n"
