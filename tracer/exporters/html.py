"""report --html: one self-contained page of the report's figures
(exporters/figures.py).  Every figure's SVG is inline and the style is in
the page: no script, no font, no image or style sheet from anywhere else,
so the file opens from disk on a machine with no network and can be mailed.
"""

import html

from ..analysis.headlines import differences, formatted, headlines

STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-bottom: 0.2em; }
figure { margin: 1.5em 0; border-top: 1px solid #ccc; padding-top: 0.5em; }
figure svg { max-width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #555; }
.missing { color: #777; font-style: italic; padding: 1em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 0.15em 0.8em; border-bottom: 1px solid #eee; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.warn { color: #a00; }
"""


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def headline_table(runs) -> str:
    """The headline figures: one column a run, and for two runs the
    difference (b - a, and relative to a)."""
    if len(runs) == 2:
        (la, a), (lb, b) = runs
        rows = "".join(
            f"<tr><td>{_esc(label)}</td><td>{_esc(formatted(x, kind))}</td>"
            f"<td>{_esc(formatted(y, kind))}</td><td>{_esc(formatted(d, kind, True))}</td>"
            f"<td>{'-' if r is None else f'{100 * r:+.1f}%'}</td></tr>"
            for label, x, y, d, r, kind in differences(a, b))
        head = (f"<tr><th>figure</th><th>{_esc(la)}</th><th>{_esc(lb)}</th>"
                "<th>difference</th><th>relative</th></tr>")
    else:
        (label, doc), = runs
        rows = "".join(f"<tr><td>{_esc(name)}</td><td>{_esc(formatted(v, kind))}</td></tr>"
                       for name, v, kind in headlines(doc))
        head = f"<tr><th>figure</th><th>{_esc(label)}</th></tr>"
    return f'<table id="headlines">{head}{rows}</table>'


def _about(label: str, doc: dict) -> str:
    t = doc["trace"]
    reasons = doc["blocks"].get("inexact_reasons") or []
    state = ("complete" if not reasons else
             '<span class="warn">NOT complete: ' + _esc("; ".join(reasons)) + "</span>")
    procs = ", ".join(f"{p.get('comm', '?')} {p['pid']} ({p.get('tier', '?')} tier)"
                      for p in t["processes"])
    return (f"<li><b>{_esc(label)}</b>: {_esc(t['path'])}, recorded {_esc(t['created_utc'])}"
            f" on {_esc(t['host'])}, {t['duration_s']:.1f} s, {doc['stream']['ops']:,} ops;"
            f" {_esc(procs)}; stream {state}</li>")


def page(runs, figures) -> str:
    """The page: what was recorded, the headline table, then every figure
    (a figures.Figure each, drawn or saying why it is missing)."""
    labels = " vs ".join(label for label, _ in runs)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>kvtrace-bpf report: {_esc(labels)}</title>",
             f"<style>{STYLE}</style></head><body>",
             f"<h1>kvtrace-bpf report: {_esc(labels)}</h1>",
             "<ul>" + "".join(_about(label, doc) for label, doc in runs) + "</ul>",
             "<h2>Headline figures</h2>", headline_table(runs)]
    for f in figures:
        body = (f'<p class="missing">{_esc(f.missing)}</p>' if f.missing else f.svg_text or f.svg())
        cap = " ".join(x for x in (f.caveat, f.resolution) if x)
        parts.append(f'<figure id="{_esc(f.name)}" data-missing="{"yes" if f.missing else "no"}">'
                     f"<h2>{_esc(f.title)}</h2>{body}<figcaption>{_esc(cap)}</figcaption>"
                     "</figure>")
    parts.append("<p><small>Made by kvtrace-bpf report --html; figures defined in "
                 "docs/pictures.md.</small></p></body></html>")
    return "\n".join(parts) + "\n"
