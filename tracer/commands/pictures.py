"""`kvtrace-bpf report A [B] --html FILE | --svg DIR | --png DIR`, and `report A
B`: the report's pictures (exporters/figures.py) and page (exporters/html.py),
of one recording or two side by side; with two, the terminal shows the
headline figures and their differences (views/compare_text.py).

Each recording's figures come from its report's own document (the JSON's,
exporters/report_json.document), so a picture, the terminal and --format json
agree.  Progress goes to stderr when it is a terminal: a large recording's
report takes a while, and ten figures more.
"""

import io
import os
import sys

from rich.console import Console
from rich.measure import Measurement

from ..analysis.report import Report
from ..errors import UsageError
from ..exporters import figures as figs
from ..exporters.html import page
from ..files import Outputs, check_writable, write_file
from ..trace import tracefile
from ..views.compare_text import table
from ..views.panels import output_console
from . import export


_MEASURE = Console(width=1000, file=io.StringIO())


def _say(message: str):
    print(f"kvtrace-bpf: {message}", file=sys.stderr)


def _progress(message: str):
    if sys.stderr.isatty():
        print(f"\rkvtrace-bpf: {message}\033[K", end="", file=sys.stderr, flush=True)


def check_outputs(args):
    """Before any trace is read: the page's file can be created, and the
    figure folders exist or can be made."""
    if args.html:
        check_writable(args.html)
    for flag, d in (("--svg", args.svg), ("--png", args.png)):
        if d is None:
            continue
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{flag} {d}: cannot make the folder: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise UsageError(f"{flag} {d}: permission denied")


def labels_of(paths) -> list:
    """Each recording's name in the figures: its file name, or where two
    have one name, its path (a: and b: before one file given twice)."""
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    if len(set(paths)) == len(paths):
        return list(paths)
    return [f"{'ab'[i]}: {p}" for i, p in enumerate(paths)]  # one file twice


def document_of(path: str, label: str, args) -> dict:
    """One recording's picture document."""
    _progress(f"{label}: reading")
    trace = tracefile.load(path, partial=args.partial, warn=_say)
    _progress(f"{label}: computing the report")
    rep = Report(trace, args.pid, with_lifecycle=True, timelines=None)
    folded = export.by_stack(trace, rep.ops, "slots")
    _progress(f"{label}: the pictures' figures")
    return figs.picture_document(rep, rep.op_rates(), folded, args.layer)


def run(args) -> int:
    check_outputs(args)
    runs = [(label, document_of(path, label, args))
            for path, label in zip(args.file, labels_of(args.file))]
    out = Outputs()
    if len(runs) == 2:
        t = table(runs)
        console = output_console()
        wide = Measurement.get(_MEASURE, _MEASURE.options, t).maximum
        if wide > console.width:  # a column a run, never folded: wider than asked
            console = Console(highlight=False, width=wide)
        out.write("to stdout", lambda: console.print(t), stdout=True)
    wanted = args.html or args.svg or args.png
    if wanted:
        drawn = []

        def progress(i, n, name):
            _progress(f"figure {i} of {n}: {name}")

        for f in figs.figures(runs, progress):
            for d, fmt in ((args.svg, "svg"), (args.png, "png")):
                if d is not None:
                    path = os.path.join(d, f"{f.name}.{fmt}")
                    out.write(path, lambda: f.save(path, fmt))
            if args.html:
                f.svg_text = "" if f.missing else f.svg()
            f.close()
            drawn.append(f)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        if args.html:
            out.write(args.html, lambda: write_file(args.html, page(runs, drawn)))
    return out.finish()
