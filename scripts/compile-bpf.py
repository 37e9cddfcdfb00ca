#!/usr/bin/env python3
"""make setup's last step: the BPF program compiled now, into the program
cache (tracer/kernel/program.py), for the commands people start with, so
that their first attach loads it in a second instead of compiling for
3-8 s (more beside a busy vLLM).  The command lines are
parsed by the CLI itself (each command's program_options), so the
entries are the ones those commands look up.  Two compile at a time:
each is one CPU's work, in a child process.  An entry already cached
costs a load.

    .venv/bin/python scripts/compile-bpf.py
"""

import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the README's first commands, and what the live views and the endpoint add
COMMANDS = {
    "attach": ["attach", "--", "true"],
    "attach --folded": ["attach", "--folded", "F", "--", "true"],
    "record, attach -o": ["record", "-o", "F", "--", "true"],
    "attach --prometheus": ["attach", "--prometheus", "9090", "--", "true"],
    "agent": ["agent"],
}


def options(argv, where):
    import importlib

    from tracer import cli

    argv = [os.path.join(where, "out") if a == "F" else a for a in argv]
    args = cli.build_parser(argv[0]).parse_args(argv)
    # record is attach's loop (commands/record.py)
    command = importlib.import_module(
        f"tracer.commands.{'attach' if argv[0] == 'record' else argv[0]}")
    command.validate(args)
    return command.program_options(args)


def load(name, opts):
    """Loads (compiling and caching where there is no entry) one program:
    (name, how, seconds)."""
    from tracer.kernel.session import Tracer

    t0 = time.monotonic()
    tracer = Tracer(**opts)
    try:
        return name, tracer.program_source, time.monotonic() - t0
    finally:
        tracer.close()


def main() -> int:
    from tracer import cache
    from tracer.errors import KvtraceError

    where, why_not = cache.directory()
    if where is None:
        print(f"setup: BPF program not compiled ahead: the cache is not usable ({why_not})")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtrace-compile-bpf-") as tmp:
        todo = {name: options(argv, tmp) for name, argv in COMMANDS.items()}
    try:
        # processes, not threads: each loads its program and maps on its own
        with concurrent.futures.ProcessPoolExecutor(max_workers=2) as pool:
            for name, how, s in pool.map(load, todo, todo.values()):
                print(f"setup: BPF program for {name}: {how} ({s:.1f} s)", flush=True)
    except KvtraceError as e:
        print(f"setup: BPF program not compiled ahead: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
