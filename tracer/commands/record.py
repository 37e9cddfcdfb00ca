"""`kvtrace-bpf record`: trace a process into a trace file, no live view.

Recording is `attach -o FILE -q` without the summary screen: one tracing
loop (attach.py), one writer (tracefile.Recorder).
"""

import argparse

from .. import abi
from ..kernel.session import DEFAULT_MAX_PROCS, DEFAULT_TRANSPORT
from . import attach
from .args import add_stack_storage_size, add_verify_rows, positive_float, positive_int

EXAMPLES = """\
examples:
  sudo kvtrace-bpf record -p 1234 -o run.kvt -d 60
  sudo kvtrace-bpf record -o run.kvt -- tests/target/kvsim --workload swap
  kvtrace-bpf report run.kvt
  kvtrace-bpf export --folded run.kvt --by block > run.folded
"""


def add_parser(sub):
    p = sub.add_parser(
        "record", help="record a trace file for report and export",
        description="Trace a running process (-p) or a command (-- CMD) and write every\n"
                    "op, with its raw slot numbers or block pairs, to a trace file\n"
                    "(docs/trace-format.md), created 0600. Ends on Ctrl-C, SIGTERM,\n"
                    "--duration or the target's exit. Needs root.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", type=positive_int, help="trace this running process")
    p.add_argument("-o", "--output", metavar="FILE", required=True,
                   help="the trace file to write")
    p.add_argument("-d", "--duration", type=positive_float, metavar="S",
                   help="stop after S seconds")
    p.add_argument("--perf-pages", type=positive_int, metavar="N",
                   help="perf buffer pages per CPU (default 4096, 16 MiB, up to 256 MiB "
                        "over all CPUs)")
    p.add_argument("--max-blocks", type=positive_int, default=abi.DEFAULT_MAX_BLOCKS,
                   metavar="N", help="blocks per layer counted exactly in the maps "
                   f"(default {abi.DEFAULT_MAX_BLOCKS}); the stream is not limited")
    p.add_argument("--max-layers", type=positive_int, default=abi.DEFAULT_MAX_CACHES,
                   metavar="N", help=f"layers counted in the maps (default "
                   f"{abi.DEFAULT_MAX_CACHES})")
    add_stack_storage_size(p)
    add_verify_rows(p)
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- CMD [ARG...]: start CMD and record it")
    p.set_defaults(run=run, quiet=True, summary=False, json=None, folded=None, interval=1.0,
                   calls_only=False, max_procs=DEFAULT_MAX_PROCS,
                   transport=DEFAULT_TRANSPORT)
    return p


def run(args) -> int:
    return attach.run(args)
