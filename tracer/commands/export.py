"""`kvtrace-bpf export --folded FILE`: folded stacks from a recorded trace.

Two hierarchies in flamegraph.pl's line grammar (`frame;frame;... COUNT`),
root first (tracer/export.py):

  --by stack   comm-PID;user stack...;op;layer_NN
               which code paths of the target issue the cache ops, and how
               much each moves (short where the target's libraries were built
               without frame pointers, as torch's and vLLM's wheels are)
  --by block   comm-PID;op;layer_NN;blocks_LO-HI;block_N
               where in the cache the writes land: per process, op and layer,
               which ranges of --group blocks, and which blocks in them, took
               the most slots (copies: the destination; swaps: the device
               block).  Numbers are zero-padded, so the graph's order is
               the cache's order.

Weights (--weight): `slots` (default) counts slots written by write ops and
block pairs (or batch entries) moved by copies and swaps; `bytes` counts the
bytes copies and swaps moved, and leaves write ops out (their probes carry no
byte count); `reads` counts block reads (docs/access.md: (request, block)
pairs at a step, once per step per KV-cache group), with group_NN in place
of layer_NN: which code reads (by stack) and which blocks are hot (by
block).  Input to `flamegraph.pl --colors=mem --countname=bytes` (or
`--countname=slots`) and to speedscope, unchanged.
"""

import argparse
import sys

import numpy as np

from .. import abi
from ..analysis import access_stream
from ..errors import UsageError
from ..exporters.folded import block_lines, folded_lines, process_frame
from ..files import Outputs, check_writable, write_file
from ..trace import stream, tracefile

EXAMPLES = """\
examples:
  kvtrace-bpf export --folded run.kvt > stacks.folded
  kvtrace-bpf export --folded run.kvt --by block | flamegraph.pl --countname=slots > blocks.svg
  kvtrace-bpf export --folded run.kvt --by block --weight bytes | \\
      flamegraph.pl --colors=mem --countname=bytes > moves.svg
  kvtrace-bpf export --folded run.kvt --by block --weight reads > reads.folded
"""

_MOVE_OPS = ("copy_blocks", "swap_blocks", "swap_blocks_batch")


def add_parser(sub):
    p = sub.add_parser(
        "export", help="export a recorded trace as folded stacks",
        description="Folded stacks from a trace file (`record`, `attach -o`), for\n"
                    "flamegraph.pl and speedscope.\n"
                    "  --by stack  process;user stack;op;layer: which code paths issue\n"
                    "              the cache ops, and how much each moves\n"
                    "  --by block  process;op;layer;block range;block: where in the\n"
                    "              cache the writes land (zero-padded: cache order)",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folded", action="store_true", required=True,
                   help="folded-stack output (the one format so far)")
    p.add_argument("file", help="trace file")
    p.add_argument("--by", choices=("stack", "block"), default="stack")
    p.add_argument("--weight", choices=("slots", "bytes", "reads"), default="slots",
                   help="slots written and pairs moved (default), bytes moved by "
                        "copies and swaps, or block reads (once per step per KV-cache "
                        "group: docs/access.md)")
    p.add_argument("--group", type=int, default=64, metavar="N",
                   help="--by block: blocks per blocks_LO-HI frame (default 64)")
    p.add_argument("--pid", type=int, help="only this process")
    p.add_argument("-o", "--output", metavar="OUT", help="write here (0600), not stdout")
    p.add_argument("--partial", action="store_true",
                   help="read a damaged or cut-short trace up to the damage")
    p.set_defaults(run=run)
    return p


# the plugin tier's ops: scheduler events, not cache ops (a request's items
# are tokens, a block event's bytes the pool's size, its cache_index a group)
PLUGIN_OP_IDS = sorted(abi.OPS[op] for op in abi.PLUGIN_OPS)


def _op_weights(o: np.ndarray, weight: str) -> np.ndarray:
    """Per op record: its weight in the chosen unit (0: left out)."""
    is_table = o["op"] == stream.TABLE_OP_ID
    if weight == "reads":
        return np.where(is_table, o["items"], 0).astype(np.int64)
    is_write = np.isin(o["op"], list(stream.WRITE_OP_IDS))
    # reads weigh only with --weight reads (a block_table op's bytes are
    # tokens, its items reads: neither is bytes moved or slots written);
    # the plugin's events weigh neither slots, pairs nor bytes
    skip = is_table | np.isin(o["op"], PLUGIN_OP_IDS)
    if weight == "bytes":
        return np.where(is_write | skip, 0, o["bytes"]).astype(np.int64)
    return np.where(is_write, o["slots"], np.where(skip, 0, o["items"])).astype(np.int64)


def by_stack(trace: tracefile.Trace, ops: stream.OpStream, weight: str) -> list:
    o = ops.ops
    w = _op_weights(o, weight)
    keys = np.stack([o["pid"].astype(np.int64), o["stack_id"].astype(np.int64),
                     o["op"].astype(np.int64), o["cache_index"].astype(np.int64)], axis=1)
    keep = w > 0
    uniq, inv = np.unique(keys[keep], axis=0, return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=w[keep], minlength=len(uniq)).astype(np.int64)
    stacks = [(pid, sid, abi.OP_NAMES.get(op, str(op)), idx, int(s))
              for (pid, sid, op, idx), s in zip(uniq.tolist(), sums.tolist())]
    frames = (trace.end or {}).get("stacks", {})
    procs = trace.processes
    layer_by_index = {(c["pid"], c["index"]): n for (c, n) in
                      ((c, trace.layers()[(c["pid"], c["cache_id"])]) for c in trace.caches)}
    if weight == "reads":  # a block_table op's cache_index is its group's
        group_by_index = {(g["pid"], g["index"]): n for n, g in enumerate(trace.groups)}
        return folded_lines(
            stacks, lambda sid, pid: frames.get(f"{pid}:{sid}", []),
            lambda pid: procs.get(pid, {}).get("comm", str(pid)),
            lambda pid, idx: group_by_index.get((pid, idx)), level="group")
    return folded_lines(
        stacks, lambda sid, pid: frames.get(f"{pid}:{sid}", []),
        lambda pid: procs.get(pid, {}).get("comm", str(pid)),
        lambda pid, idx: layer_by_index.get((pid, idx)))


def reads_by_block(trace: tracefile.Trace, ops: stream.OpStream, group: int):
    """One line per (process, group, block) read, weighted by its reads
    (the complete steps' live sets)."""
    procs = trace.processes
    rows, left_out = [], 0
    groups = [g for g in trace.groups if np.any(ops.ops["pid"] == g["pid"])]
    for n, (g, st) in enumerate(zip(groups, access_stream.steps_of(ops, groups))):
        scan = access_stream.rows_of(ops, st).scan()
        left_out += scan.out_of_range
        counts = scan.reads_per_block
        name = process_frame(procs.get(g["pid"], {}).get("comm", str(g["pid"])), g["pid"])
        rows += [(name, "block_table", n, int(b), int(counts[b]))
                 for b in np.flatnonzero(counts)]
    return block_lines(rows, group, level="group"), left_out


def by_block(trace: tracefile.Trace, ops: stream.OpStream, weight: str, group: int):
    """One line per (op, layer, block) that was written (write ops: the
    slot's block) or moved into (copy: destination; swap: the device block).
    Returns (lines, how many values were left out for a block number from
    tracefile.MAX_BLOCKS up)."""
    if weight == "reads":
        return reads_by_block(trace, ops, group)
    o = ops.ops
    layer = stream.per_cache(o, trace.layers(), -1)
    bsize = stream.per_cache(o, trace.block_sizes(), 0)
    is_write = np.isin(o["op"], list(stream.WRITE_OP_IDS))
    is_pair = np.isin(o["op"], list(stream.PAIR_OP_IDS))
    use = o["complete"] & (layer >= 0) & ((is_write & (bsize > 0)) | is_pair)
    if weight == "bytes":
        use &= ~is_write
    idx = np.flatnonzero(use)
    n = o["stop"][idx] - o["start"][idx]
    at = stream.ranges(o["start"][idx], n)
    vals = ops.values[at]
    op_of = np.repeat(idx, n)
    pos = at - o["start"][op_of]  # the value's place in its op
    # write ops: every valid slot; pairs: the destination, or the device
    # block of a swap (the source of a device -> host swap)
    writes = is_write[op_of]
    out_swap = (o["flags"][op_of] & abi.EV_SWAP_OUT) != 0
    pick = np.where(writes, vals >= 0, (pos % 2 == np.where(out_swap, 0, 1)) & (vals >= 0))
    op_of, vals = op_of[pick], vals[pick]
    block = np.where(is_write[op_of], vals // np.maximum(bsize[op_of], 1), vals)
    # as report does: blocks from MAX_BLOCKS up are left out (and said),
    # which also keeps them inside the key's 47 bits
    inside = block < tracefile.MAX_BLOCKS
    left_out = int(np.count_nonzero(~inside))
    op_of, block = op_of[inside], block[inside]
    if weight == "bytes":
        w = (o["bytes"][op_of] // np.maximum(o["items"][op_of], 1)).astype(np.int64)
    else:
        w = np.ones(len(block), np.int64)
    # one int64 key per (process, op, layer, block): 7 + 16 + 16 + 24 bits
    # (blocks are below MAX_BLOCKS = 2**24; processes are numbered here)
    # numbered per op record, then spread to its values: a sort of the ops,
    # not of the (maybe 10 million) values
    pids, pidx = np.unique(o["pid"], return_inverse=True)
    pidx = pidx.reshape(-1).astype(np.int64)
    key = (o["op"][op_of].astype(np.int64) << 56) | (pidx[op_of] << 40) \
        | (layer[op_of].astype(np.int64) << 24) | block
    uniq, inv = np.unique(key, return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=w, minlength=len(uniq)).astype(np.int64)
    procs = trace.processes
    names = [process_frame(procs.get(int(p), {}).get("comm", str(p)), int(p)) for p in pids]
    rows = [(names[(k >> 40) & 0xFFFF], abi.OP_NAMES.get(k >> 56, str(k >> 56)),
             (k >> 24) & 0xFFFF, k & 0xFFFFFF, s)
            for k, s in zip(uniq.tolist(), sums.tolist())]
    return block_lines(rows, group), left_out


def run(args) -> int:
    if args.group <= 0:
        raise UsageError("--group must be > 0")
    if args.output:
        check_writable(args.output)  # before reading: a trace may take seconds
    trace = tracefile.load(args.file, partial=args.partial,
                           warn=lambda m: print(f"kvtrace-bpf: {m}", file=sys.stderr))
    ops = trace.ops
    if args.pid is not None:
        # as report does: a pid the trace has no ops of is a usage error,
        # not an empty output that reads as "nothing happened"
        if not np.any(ops.ops["pid"] == args.pid):
            raise UsageError(f"no ops of pid {args.pid} in {trace.path}")
        ops = ops.select(ops.ops["pid"] == args.pid)
    lost = ((trace.end or {}).get("aggregate") or {}).get("lost_records", 0)
    incomplete = int(np.count_nonzero(~ops.ops["complete"]))
    if lost or (args.by == "block" and incomplete):
        print(f"kvtrace-bpf: {lost} op records lost, {incomplete} ops without their values: "
              "weights fall short of the totals", file=sys.stderr)
    if args.by == "stack":
        lines = by_stack(trace, ops, args.weight)
    else:
        lines, left_out = by_block(trace, ops, args.weight, args.group)
        if left_out:
            print(f"kvtrace-bpf: {left_out} block numbers from {tracefile.MAX_BLOCKS} up "
                  "left out", file=sys.stderr)
    text = "".join(line + "\n" for line in lines)
    out = Outputs()
    if args.output:
        out.write(args.output, lambda: write_file(args.output, text))
    else:
        out.write("the folded stacks to stdout", lambda: sys.stdout.write(text), stdout=True)
    return out.finish()
