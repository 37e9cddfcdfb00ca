"""`kvtrace-bpf report FILE`: what a recorded trace says, in the terminal
(rich), as JSON or as CSV.  The figures are analysis/report.py's; the
outputs views/report_text.py's and exporters/report_json.py's and
report_csv.py's.
"""

import argparse
import contextlib
import gc
import sys
import threading

from rich.console import Console

from ..analysis import heatmap, invariants
from ..analysis.report import Report
from ..errors import EXIT_DATA, UsageError
from ..exporters.report_csv import write_csv
from ..exporters.report_json import document, json_fragment, json_parts, plain, write_json
from ..trace import tracefile
from ..views.panels import output_console
from ..views.report_text import LIFE_SHOWN_REQUESTS, render

TABLES = ("blocks", "generations", "fragmentation", "heatmap", "access", "wss")
KINDS = ("writes", "reads")

EXAMPLES = """\
examples:
  kvtrace-bpf report run.kvt
  kvtrace-bpf report run.kvt > run.txt             # 120 columns (COLUMNS=N: N)
  kvtrace-bpf report run.kvt --resol 30 100 --time-range 2 5 --block-range 0 1023
  kvtrace-bpf report run.kvt --format json > run.json
  kvtrace-bpf report run.kvt --format csv --table generations > gens.csv
  kvtrace-bpf report run.kvt --kind reads          # the read heatmap (temperature)
  kvtrace-bpf report run.kvt --format csv --table wss > wss.csv
  kvtrace-bpf report run.kvt --check              # figures agree? exit 4 if not
  kvtrace-bpf report run.kvt --html run.html       # every figure, one page
  kvtrace-bpf report run.kvt --svg figs --png figs # one file a figure

Two trace files (report A B): their headline figures side by side with the
differences (B - A); with --html/--svg/--png, every figure of both, paired or
overlaid (docs/pictures.md).

--check: the cross-figure invariants over the report's JSON, one line each
(ok or FAIL, and what it compared); exit 0 when all hold, 4 when one fails
(docs/report-json.md, "Invariants").
"""


def add_parser(sub):
    p = sub.add_parser(
        "report", help="report a recorded trace: histograms, heatmap, fill from writes",
        description="Per-block histograms (writes, copies, swaps), a heatmap of time x\n"
                    "block range (zoomed to the blocks written), op size and rate\n"
                    "histograms, and occupancy from writes (written fill at each block\n"
                    "generation's end, the unwritten share of the blocks being written,\n"
                    "write span and write gap) of a trace file written by `record` or\n"
                    "`attach -o`. Writes alone do not show frees or blocks held but not\n"
                    "written. Text goes to the terminal at its width (up to 120\n"
                    "columns), to a pipe or a file at 120 columns, or COLUMNS where set.\n"
                    "Definitions: docs/occupancy.md, docs/glossary.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="+", help="trace file; two: their headline figures side "
                   "by side (and with --html/--svg/--png, their figures)")
    p.add_argument("--format", choices=("text", "json", "csv"), default="text")
    p.add_argument("--table", choices=TABLES, default="blocks",
                   help="with --format csv: which table (default blocks)")
    p.add_argument("--resol", nargs=2, type=int, metavar=("ROWS", "COLS"),
                   help="heatmap resolution, exactly (default 20 rows, and the "
                   "terminal's width or one column per block, whichever is fewer)")
    p.add_argument("--time-range", nargs=2, type=float, metavar=("START", "END"),
                   help="heatmap and rates: seconds from the start of the trace")
    p.add_argument("--block-range", nargs=2, type=int, metavar=("LO", "HI"),
                   help="heatmap: blocks LO to HI, inclusive (default: the blocks "
                   "written, a little padded)")
    p.add_argument("--kind", choices=KINDS, default="writes",
                   help="what the heatmap counts: slot writes, or block reads (once per "
                   "step per KV-cache group; docs/access.md) (default writes)")
    p.add_argument("--pid", type=int, help="only this process")
    p.add_argument("--layer", type=int, default=0,
                   help="layer shown in the terminal's occupancy section (default 0; "
                        "JSON and CSV have every layer)")
    p.add_argument("--check", action="store_true",
                   help="check that the report's figures agree with each other (one "
                   "line per invariant; exit 4 when one fails) instead of showing them")
    p.add_argument("--html", metavar="FILE", help="write every figure to one self-contained "
                   "page (inline SVG, no script, no network; docs/pictures.md)")
    p.add_argument("--svg", metavar="DIR", help="write each figure to DIR/NAME.svg")
    p.add_argument("--png", metavar="DIR", help="write each figure to DIR/NAME.png")
    p.add_argument("--partial", action="store_true",
                   help="read a damaged or cut-short trace up to the damage")
    p.set_defaults(run=run)
    return p


# --resol and --time-range bounds: the heatmap has at most 4M cells (32 MB),
# and times x rows stay within an int64: a span of 2 x tracefile.MAX_SPAN_NS
# (2**53) times fewer than 1024 rows
MAX_ROWS, MAX_COLS = 1000, 4096


def check_args(args):
    """Bad flag values, found before the trace is read (it may be large)."""
    if args.resol and not (0 < args.resol[0] <= MAX_ROWS and 0 < args.resol[1] <= MAX_COLS):
        raise UsageError(f"--resol ROWS COLS needs 1 <= ROWS <= {MAX_ROWS} and "
                         f"1 <= COLS <= {MAX_COLS}")
    if args.time_range:
        start, end = args.time_range
        if not 0 <= start < end <= tracefile.MAX_SPAN_NS / 1e9:
            raise UsageError("--time-range START END needs 0 <= START < END <= "
                             f"{tracefile.MAX_SPAN_NS / 1e9:.0f} seconds")
    if args.block_range and not 0 <= args.block_range[0] <= args.block_range[1] < \
            tracefile.MAX_BLOCKS:
        raise UsageError(f"--block-range LO HI needs 0 <= LO <= HI < {tracefile.MAX_BLOCKS}")
    if args.check and args.format != "text":
        raise UsageError("--check prints its own lines: no --format")
    if args.table != "blocks" and args.format != "csv":
        raise UsageError("--table goes with --format csv")
    if len(args.file) > 2:
        raise UsageError("report compares at most two trace files")
    pictures = args.html or args.svg or args.png
    if (pictures or len(args.file) == 2) and (args.format != "text" or args.check or
                                               args.resol or args.time_range or
                                               args.block_range or args.kind != "writes"):
        raise UsageError("--html/--svg/--png and two trace files go with no --format, "
                         "--check, --resol, --time-range, --block-range or --kind")


@contextlib.contextmanager
def no_cycle_collection():
    """The cyclic garbage collector paused: the report makes a million
    Python objects (every request's events, in JSON) and keeps them all,
    so its full collections, each a walk over every object alive, found
    nothing and took half a second of a large trace's JSON report (and
    held the GIL from the other thread meanwhile).  Reference counting still frees what
    the report drops; the collector is back on when the report is done
    (the fuzz tests run it many times in one process)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run(args) -> int:
    with no_cycle_collection():
        return _run(args)


def _run(args) -> int:
    check_args(args)
    if args.html or args.svg or args.png or len(args.file) == 2:
        from . import pictures  # matplotlib only where pictures are drawn
        return pictures.run(args)
    args.file = args.file[0]
    trace = tracefile.load(args.file, partial=args.partial,
                           warn=lambda m: print(f"kvtrace-bpf: {m}", file=sys.stderr))
    if args.check:
        return check(trace, args)
    # the plugin tier's figures: every request's in JSON, the first few in
    # the terminal, none in CSV (no table has them)
    console = output_console()
    width = min(console.width, 120)

    def views(rep):  # the heatmap and the rates: Report computes them meanwhile
        if args.resol:
            rows, cols = args.resol
        else:
            t0, t1 = rep.span_ns() if args.time_range is None else \
                (int(args.time_range[0] * 1e9), int(args.time_range[1] * 1e9))
            rows, cols = 20, width - heatmap.label_width(t0, t1)
        hm = rep.heatmap(rows, cols, args.time_range, args.block_range,
                         exact_cols=bool(args.resol), kind=args.kind)
        rates = rep.op_rates(time_range=args.time_range)
        # JSON: the document but the plugin tier's figures, serialized while
        # those are computed, not after them
        parts = json_parts(document(rep, hm, rates)) if args.format == "json" else None
        return hm, rates, parts

    rep = Report(trace, args.pid, with_lifecycle=args.format != "csv",
                 timelines=LIFE_SHOWN_REQUESTS if args.format == "text" else None,
                 meanwhile=views, access_as=json_fragment if args.format == "json" else None)
    hm, rates, parts = rep.meanwhile
    if args.format == "json":
        # everything is made: the file's pages are let go beside the writing
        threading.Thread(target=trace.let_go_of_pages, daemon=True).start()
        write_json({**parts, "lifecycle": rep.lifecycle}, sys.stdout)
    elif args.format == "csv":
        write_csv(rep, args.table, hm, sys.stdout)
    else:
        wide = hm.cols + heatmap.label_width(hm.t0_ns, hm.t1_ns)
        if wide > console.width:
            # --resol is honoured exactly, even wider than the terminal
            # (without it the map is never wider: cols come from the width)
            console = Console(highlight=False, width=wide)
        console.print(render(rep, hm, rates, width, args.layer))
    return 0


def check(trace, args) -> int:
    """report --check: the document JSON would give (every request's
    figures), checked by analysis/invariants.py, one line per invariant."""
    def views(rep):
        hm = rep.heatmap(20, 100, args.time_range, args.block_range, exact_cols=False,
                         kind=args.kind)
        return document(rep, hm, rep.op_rates(time_range=args.time_range))

    rep = Report(trace, args.pid, meanwhile=views)
    doc = plain({**rep.meanwhile, "lifecycle": rep.lifecycle})
    results = invariants.check(doc)
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return EXIT_DATA if any(not ok for _, ok, _ in results) else 0
