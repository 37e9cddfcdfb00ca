"""The headline figures in the terminal (rich): one recording's, or two
side by side with their differences (`report A B`).  The numbers are
analysis/headlines.py's, the same the page's table has."""

from rich import box
from rich.table import Table

from ..analysis.headlines import differences, formatted, headlines


def table(runs) -> Table:
    """runs: [(label, the report's document)], one or two."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
              title="headline figures" + (" and their differences (b - a)"
                                          if len(runs) == 2 else ""))
    t.add_column("figure", no_wrap=True)
    for label, _ in runs:
        t.add_column(label, justify="right", no_wrap=True)
    if len(runs) == 2:
        t.add_column("difference", justify="right", no_wrap=True)
        t.add_column("relative", justify="right", no_wrap=True)
        for label, x, y, d, r, kind in differences(runs[0][1], runs[1][1]):
            t.add_row(label, formatted(x, kind), formatted(y, kind),
                      formatted(d, kind, True), "-" if r is None else f"{100 * r:+.1f}%")
    else:
        for label, v, kind in headlines(runs[0][1]):
            t.add_row(label, formatted(v, kind))
    return t
