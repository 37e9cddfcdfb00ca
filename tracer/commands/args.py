"""Argument types and arguments that several subcommands share."""

import argparse
import math
import os

from .. import abi


def _number(text) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive_float(text):
    v = _number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def cpu_list(text):
    """'1', '0,2', '2-3' -> a set of CPU numbers this process may use."""
    cpus = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            lo, hi = int(lo), int(hi) if sep else int(lo)
            if lo < 0 or hi < lo:
                raise ValueError
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list (1, 0,2 or 2-3): {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise argparse.ArgumentTypeError(
            f"CPU {min(cpus - allowed)} is not one this process may use "
            f"({_ranges(sorted(allowed))}): {text!r}")
    return cpus


def _ranges(cpus):
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)


def non_negative_float(text):
    v = _number(text)
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite: {text!r}")
    return v


def positive_int(text):
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


MAX_STACK_BUCKETS = 1 << 18  # ~1 KiB of kernel memory a stack: 256 MiB


def add_stack_storage_size(p):
    p.add_argument("--stack-storage-size", type=positive_int,
                   metavar="N", help="user stacks, taken for folded stacks and trace files: "
                   "the distinct stacks the kernel's stack map holds (at most "
                   f"{MAX_STACK_BUCKETS}; default {abi.STACK_BUCKETS}, about "
                   f"{abi.STACK_BUCKETS >> 10} MiB of kernel memory); a stack it has no "
                   "room for, or whose hash bucket another holds, is kept in a second "
                   f"map of up to {abi.COLLIDED_STACKS}")


def add_verify_rows(p):
    """--verify-rows, on attach and record."""
    p.add_argument("--verify-rows", action="store_true",
                   help="plugin targets: also attach block_table and step_reqs, so that "
                   "the plugin sends each step's whole tables beside their deltas "
                   "(step_rows). It costs the scheduler 13-21 ns per table entry a step "
                   "(a millisecond or more at 100k entries) and exists to check the rows "
                   "kept from the deltas against the tables vLLM held (docs/design.md)")
