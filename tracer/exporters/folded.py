"""Exporters: perf-style folded stacks (flamegraph.pl, speedscope).

Two hierarchies, root first, one line per distinct path with its weight:

  by stack:  comm-PID;outer;...;inner;op;layer_NN      which code paths in the
             target issue the cache ops, and how much each moves
  by block:  comm-PID;op;layer_NN;blocks_LO-HI;block_N  where in the cache the
             writes (and copies and swaps) land, per process and layer

Weights are slots written (write ops) or pairs/entries moved (copy, swap,
swap_blocks_batch), or bytes moved (export --weight bytes), or block reads
(export --weight reads: the block_table op, per KV-cache group, group_NN in
place of layer_NN).  flamegraph.pl
sorts sibling frames by name, so numbers in frames are zero-padded to one
width per graph: block_0005 before block_0012, layer_02 before layer_10.
The process frame carries the pid: vLLM's workers share one name.
"""

import errno
import re

UNKNOWN = "[unknown]"
# Why an op has no frames, from the stack id its record holds: -1 where no
# stack is taken (ev->stack_id without stacks), else stack_id_of()'s errno
# (bpf/kvtrace.bpf.c): -EFAULT where the kernel could not walk the user
# stack, -E2BIG where the stack map refused it and collided_stacks was full.
_NO_STACK_WHY = {-1: "not taken", -errno.EFAULT: "unreadable", -errno.E2BIG: "maps full"}


def no_stack_frame(stack_id: int) -> str:
    """The frame that stands for a stack without frames, saying why: each
    reason weighs apart in the graph, so an operator sees how much of the
    work lost its code path, and to what (docs/folded.md).  An id the
    kernel gave whose frames are not known: the trace ended before its
    stacks were kept, or none of its addresses could be read back."""
    if stack_id >= 0:
        return "[no stack: frames not kept]"
    return f"[no stack: {_NO_STACK_WHY.get(stack_id, f'error {-stack_id}')}]"


def clean_frame(name: str) -> str:
    """A frame flamegraph.pl can parse: no ';', no line breaks, not empty."""
    name = re.sub(r"[;\r\n]", ":", name).strip()
    return name or UNKNOWN


def digits(largest: int, at_least: int = 1) -> int:
    """The width that zero-pads numbers up to `largest` to one length."""
    return max(at_least, len(str(max(0, int(largest)))))


def layer_frame(layer, width: int = 2, level: str = "layer") -> str:
    """layer_NN; for reads (counted per KV-cache group), group_NN."""
    return f"all_{level}s" if layer is None else f"{level}_{layer:0{width}d}"


def process_frame(comm: str, pid: int) -> str:
    return f"{clean_frame(comm)}-{pid}"


def folded_lines(stacks, frames_of, comm_of, layer_of, level: str = "layer") -> list:
    """stacks: (pid, stack_id, op, cache_index, weight) tuples.
    frames_of(stack_id, pid) -> frames outermost first ([] if none);
    comm_of(pid) -> process name; layer_of(pid, cache_index) -> int or None.
    level: what the last frame numbers (layer, or group for reads)."""
    rows = [(pid, stack_id, op, layer_of(pid, cache_index), int(weight))
            for pid, stack_id, op, cache_index, weight in stacks if weight]
    width = digits(max([r[3] for r in rows if r[3] is not None] + [0]), 2)
    merged = {}
    for pid, stack_id, op, layer, weight in rows:
        frames = [clean_frame(f) for f in frames_of(stack_id, pid)] or [no_stack_frame(stack_id)]
        line = ";".join([process_frame(comm_of(pid), pid), *frames, op,
                         layer_frame(layer, width, level)])
        merged[line] = merged.get(line, 0) + weight
    return [f"{line} {w}" for line, w in sorted(merged.items())]


def block_lines(rows, group: int, level: str = "layer") -> list:
    """rows: (process frame, op, layer, block, weight); blocks grouped in
    ranges of `group` (blocks_LO-HI), all numbers zero-padded per graph.
    Sorted as flamegraph.pl will draw them: process, op, layer, block.
    level: what the third frame numbers (layer, or group for reads)."""
    rows = [r for r in rows if r[4]]
    if not rows:
        return []
    bw = digits(max(r[3] // group * group + group - 1 for r in rows))
    lw = digits(max(r[2] for r in rows), 2)
    out = []
    for proc, op, layer, block, weight in sorted(rows, key=lambda r: r[:4]):
        lo = block // group * group
        out.append(f"{proc};{clean_frame(op)};{layer_frame(layer, lw, level)};"
                   f"blocks_{lo:0{bw}d}-{lo + group - 1:0{bw}d};block_{block:0{bw}d} {weight}")
    return out
