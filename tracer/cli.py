"""`kvtrace-bpf`: the command line.  One module per subcommand (commands/)."""

import argparse
import faulthandler
import importlib
import os
import signal
import sys

from . import __version__
from .errors import EXIT_OUTPUT, EXIT_USAGE, KvtraceError
from .files import WatchedStdout, silence_stdout

EPILOG = """\
examples:
  sudo kvtrace-bpf attach -p $(pgrep -of 'vllm serve|vllm.entrypoints')   # live view
  sudo kvtrace-bpf attach -- tests/target/kvsim --workload swap
  sudo kvtrace-bpf record -o run.kvt -- tests/target/kvsim --workload swap
  kvtrace-bpf report run.kvt                         # histograms, heatmap, true fill
  kvtrace-bpf export --folded run.kvt --by block > run.folded
  kvtrace-bpf probes tests/target/libkvsim_ops.so
  sudo kvtrace-bpf doctor -p $(pgrep -of 'vllm serve|vllm.entrypoints')   # can it be traced?
  sudo kvtrace-bpf agent                             # every engine on the node: /metrics
  sudo kvtrace-bpf audit-kv-events -p $(pgrep -of 'vllm serve|vllm.entrypoints') \\
      --kv-events tcp://127.0.0.1:5557               # do vLLM's KV events tell the truth?

exit codes: 0 ok, 1 usage, 2 environment or privileges, 3 target, 4 data, 5 output
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors exit with our usage code, on one line."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# the subcommands, in --help's order, by module (commands/)
COMMANDS = ("attach", "record", "report", "export", "probes", "doctor", "agent",
            "audit-kv-events")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each subcommand's help on its name's line: argparse (3.11) sizes the
    column by the names at the list's indent, not at the subcommands'
    deeper one, and put audit-kv-events' help on a line of its own."""

    def add_argument(self, action):
        super().add_argument(action)
        for sub in getattr(action, "_choices_actions", ()):
            self._action_max_length = max(self._action_max_length,
                                          len(sub.dest) + self._current_indent
                                          + self._indent_increment)


def chosen_command(argv):
    """The subcommand argv names (its first word that is no option), or None
    (also where the top level's --help comes first: it lists them all)."""
    for a in argv:
        if a in ("-h", "--help"):
            return None
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def build_parser(command=None):
    """The parser of every subcommand, or of `command` alone: a run of one
    subcommand imports only its module (report needs numpy, not attach's
    bcc, ELF and live-view modules: 0.1 s of every `report`)."""
    parser = _Parser(prog="kvtrace-bpf", epilog=EPILOG,
                     description="eBPF tracer for vLLM's paged KV cache: what happens "
                                 "to every physical block.",
                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS if command is None else (command,):
        module = name.replace("-", "_")  # audit-kv-events: commands/audit_kv_events.py
        importlib.import_module(f".commands.{module}", __package__).add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(chosen_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.error(f"give a COMMAND: {', '.join(COMMANDS[:-1])} or {COMMANDS[-1]}")
    # `kill -QUIT` prints where every thread is, and the run goes on: how a
    # tracer that seems stuck tells what it waits for (the tests use it too)
    try:
        faulthandler.register(signal.SIGQUIT, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file (embedded)
        pass
    watched = sys.stdout = WatchedStdout(sys.stdout)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a full disk behind stdout shows here, not at exit
        return code
    except KvtraceError as e:
        if args.debug:
            raise
        print(f"kvtrace-bpf: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `report ... | head`: the reader left, not an error
        silence_stdout()
        return 141
    except OSError as e:
        # a view written to stdout that cannot take it (a full disk); any
        # other OSError is a bug and keeps its traceback
        if args.debug or watched.error is not e:
            raise
        silence_stdout()
        print(f"kvtrace-bpf: cannot write to stdout: {e.strerror or e}", file=sys.stderr)
        return EXIT_OUTPUT
    finally:
        sys.stdout = watched._f


# the commands that leave nothing behind them but their output: no probe,
# no child, no file open (export writes its -o file whole and closes it)
_ENDS_AT_ONCE = ("report", "export")


def entry(argv=None):
    """The console script: main(), then the process's exit.  After report
    or export, once its output is flushed, the process ends at once
    (os._exit): Python's teardown of what the command built (a large
    trace's JSON report: a million objects, every request's figures) is
    work that helps no one, after the last byte was written.  Every other command exits as usual (attach's probes are detached
    by their owners' cleanup, which may run at exit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    code = main(argv)
    if chosen_command(argv) in _ENDS_AT_ONCE:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):  # a reader that left, a closed stream
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
