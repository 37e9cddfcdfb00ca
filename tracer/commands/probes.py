"""`kvtrace-bpf probes`: list the vllm:* probe sites of a file or a process,
like bcc's tplist -v."""

import argparse
import os

from .. import abi
from ..errors import TargetError, UsageError
from ..probes import catalog, discover, sdt
from .args import positive_int

EXAMPLES = """\
examples:
  kvtrace-bpf probes tests/target/libkvsim_ops.so
  kvtrace-bpf probes .../site-packages/vllm/_C_stable_libtorch.abi3.so   # the fork
  kvtrace-bpf probes -p 1234        # every mapped file, with semaphore values
"""


def add_parser(sub):
    p = sub.add_parser(
        "probes", help="list the probe sites of a binary or a process",
        description=f"List the {abi.PROVIDER}:* USDT probes (location, semaphore, "
                    "argument spec) of an ELF file, or of every file a process maps.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", type=positive_int,
                   help="list the probes of a running process")
    p.add_argument("path", nargs="?", help="an ELF file (executable or shared library)")
    p.set_defaults(run=run)
    return p


def _print_file(path, probes, pid=None, maps=None):
    print(path)
    width = max(len(p.qualified) for p in probes)
    for p in probes:
        sem = f"sem {p.sem_offset:#x}" if p.sem_vaddr else "no semaphore"
        if p.stock:
            sem = f"stock uprobe on {p.symbol[:40]}{'...' if len(p.symbol) > 40 else ''}"
            if p.skip:  # past a prologue instruction the kernel would single-step
                sem += f"+{p.skip:#x}"
        if pid is not None and p.sem_vaddr:
            value = discover.read_semaphore(pid, maps, p)
            sem += f" = {value if value is not None else '?'}"
        note = f"  [cannot decode: {p.arg_error}]" if p.arg_error else ""
        print(f"  {p.qualified:<{width}}  {p.offset:#x}  {sem}  {p.args}{note}")


def run(args) -> int:
    if bool(args.pid) == bool(args.path):
        raise UsageError("give exactly one of PATH or -p PID")
    if args.path:
        # a kvtrace build's USDT probes, or else stock vLLM's known functions
        probes = sdt.read_probes(args.path) or catalog.stock_sites(
            os.path.realpath(args.path))
        if not probes:
            raise TargetError(f"no {abi.PROVIDER}:* probes and no known vLLM cache op "
                              f"in {args.path}")
        _print_file(args.path, probes)
        return 0
    files = discover.process_probe_files(args.pid)
    if not files:
        raise TargetError(f"process {args.pid} ({discover.comm(args.pid)}) maps no file "
                          f"with {abi.PROVIDER}:* probes")
    maps = discover.read_maps(args.pid)
    print(f"pid {args.pid} ({discover.comm(args.pid)})")
    for path, probes in files.items():
        _print_file(path, probes, args.pid, maps)
    return 0
