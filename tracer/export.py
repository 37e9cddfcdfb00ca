"""Exporters: perf-style folded stacks (flamegraph.pl, speedscope).

One line per distinct stack: `comm;outer;...;inner;op;layer_NN WEIGHT`,
weights in slots written (write ops) or pairs/entries moved (copy, swap,
swap_blocks_batch).  The weights come from an exact in-kernel map, not from
the perf buffer, so they sum to the op totals even when records were lost.
"""

import re

NO_STACK = "[no stack]"
UNKNOWN = "[unknown]"


def clean_frame(name: str) -> str:
    """A frame flamegraph.pl can parse: no ';', no line breaks, not empty."""
    name = re.sub(r"[;\r\n]", ":", name).strip()
    return name or UNKNOWN


def layer_frame(layer) -> str:
    return "all_layers" if layer is None else f"layer_{layer:02d}"


def folded_lines(stacks, frames_of, comm_of, layer_of) -> list:
    """stacks: (pid, stack_id, op, cache_index, weight) tuples.
    frames_of(stack_id, pid) -> frames outermost first ([] if none);
    comm_of(pid) -> process name; layer_of(pid, cache_index) -> int or None."""
    merged = {}
    for pid, stack_id, op, cache_index, weight in stacks:
        if not weight:
            continue
        frames = [clean_frame(f) for f in frames_of(stack_id, pid)] or [NO_STACK]
        line = ";".join([clean_frame(comm_of(pid)), *frames, op,
                         layer_frame(layer_of(pid, cache_index))])
        merged[line] = merged.get(line, 0) + int(weight)
    return [f"{line} {w}" for line, w in sorted(merged.items())]
