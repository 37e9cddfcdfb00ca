"""The report's pictures (report --html, --svg DIR, --png DIR): matplotlib
figures (the Agg backend: no display), each drawn from the picture
document (picture_document: the report's JSON document, the same numbers
the terminal and --format json show, plus what only a picture needs: the
read heatmap beside the write heatmap, the per-step working set, the
folded stacks).  Every builder returns a Figure: its drawing, its title
(what it measures), its caveat (what it cannot see), its resolution where
it was downsampled, and the numbers it drew (`data`), which the tests
check against kvsim's ground truth.  A figure a recording cannot have says
why in its place (`missing`).

Builders take runs: [(label, picture document)], one run for a report,
two for a comparison (drawn overlaid, or side by side where one picture
would hide the other).  docs/pictures.md describes each figure.
"""

import io
import re
import zlib
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from ..analysis import access_counters  # noqa: E402
from ..analysis.headlines import hottest_share, read_groups, reads_per_block  # noqa: E402
from ..files import open_private  # noqa: E402
from .report_json import document, plain  # noqa: E402

# text as text in the SVGs (small, searchable), no dates in the files
matplotlib.rcParams.update({"svg.fonttype": "none", "font.size": 8,
                            "axes.titlesize": 9, "figure.titlesize": 10})

# the most points a time series keeps, the busiest requests a timeline
# shows, the flame graph's narrowest frame drawn (a share of the total)
MAX_POINTS = 1000
TIMELINE_REQUESTS = 40
FLAME_MIN_SHARE = 0.002
# the heatmaps' resolution in a picture: rows of time, columns of blocks
HEATMAP_ROWS, HEATMAP_COLS = 80, 400
COLORS = ("tab:blue", "tab:orange")


@dataclass
class Figure:
    name: str  # file stem and the page's element id
    title: str  # what it measures
    caveat: str  # what it cannot see
    fig: object = None  # the matplotlib figure
    data: dict = field(default_factory=dict)  # per run label: the numbers drawn
    resolution: str = ""  # how it was downsampled, "" where it was not
    missing: str = ""  # why a recording cannot have it (every run), "" where drawn
    svg_text: str = ""  # svg(), kept for the page once the figure is closed

    def svg(self) -> str:
        """The drawing as an SVG element, for a page (no XML prolog), without
        the title and caption drawn in it: the page has them as text."""
        labels = [a for a in (self.fig._suptitle, *self.fig.texts) if a is not None]
        for a in labels:
            a.set_visible(False)
        buf = io.StringIO()
        self.fig.savefig(buf, format="svg", metadata={"Date": None})
        for a in labels:
            a.set_visible(True)
        text = buf.getvalue()
        return text[text.index("<svg"):]

    def save(self, path: str, fmt: str):
        """The drawing to a new 0600 file (files.open_private: a picture of
        another process's memory use is as private as its trace)."""
        with open_private(path, binary=True) as out:
            self.fig.savefig(out, format=fmt, dpi=110, metadata=(
                {"Date": None} if fmt == "svg" else {"Software": None}))

    def close(self):
        plt.close(self.fig)


# -- the picture document ------------------------------------------------------


def picture_document(rep, rates: dict, folded: list, layer: int = 0) -> dict:
    """The report's JSON document (what --format json writes, read back as
    plain lists), and what only the pictures draw: the write and read
    heatmaps at the pictures' resolution, each access group's per-step
    series (downsampled to MAX_POINTS, saying so) and the folded stacks."""
    hm_w = rep.heatmap(HEATMAP_ROWS, HEATMAP_COLS, exact_cols=False, kind="writes")
    hm_r = rep.heatmap(HEATMAP_ROWS, HEATMAP_COLS, exact_cols=False, kind="reads")
    doc = plain({**document(rep, hm_w, rates), "lifecycle": rep.lifecycle})
    doc["heatmap_reads"] = plain(hm_r.to_json())
    doc["steps"] = [step_series(rep, st) for st in rep.steps]
    doc["folded"] = list(folded)
    doc["layer"] = layer
    return doc


def step_series(rep, st) -> dict:
    """One KV-cache group's per-step figures (access_stream.Steps): time,
    blocks read (the working set), tokens held in them.  Over MAX_POINTS
    steps, each point is the mean of `per_point` consecutive steps."""
    n = len(st)
    groups = {(g["pid"], g["group_id"]): g for g in rep.groups}
    nb = int((groups.get((st.pid, st.group_id)) or {}).get("num_blocks") or 0)
    t = (st.ts_ns.astype(np.int64) - rep.t0) / 1e9
    distinct = st.distinct.astype(np.float64)
    held = st.held_tokens.astype(np.float64)
    per = max(1, -(-n // MAX_POINTS))
    if per > 1:
        edges = np.arange(0, n, per)
        counts = np.diff(np.r_[edges, n])
        t, distinct, held = (np.add.reduceat(a, edges) / counts for a in (t, distinct, held))
    return {"pid": st.pid, "group_id": st.group_id, "block_size": st.block_size,
            "num_blocks": nb, "steps": n, "per_point": per, "t_s": t.tolist(),
            "distinct": distinct.tolist(), "held_tokens": held.tolist()}


# -- helpers -------------------------------------------------------------------


def _new(cols: int = 1, rows: int = 1, width: float = 7.0, height: float = 3.2, **kw):
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols if cols > 1 else width,
                                                 height * rows), squeeze=False, **kw)
    return fig, axes


def _finish(f: Figure, runs) -> Figure:
    """The title on top, the caveat and the resolution under the drawing:
    a figure saved alone (--svg, --png) says what the page says."""
    w, h = f.fig.get_figwidth(), f.fig.get_figheight()
    title = _wrap(f.title, int(w * 12))
    f.fig.suptitle(title, fontweight="bold", y=1 - 0.05 / h, va="top")
    foot = _wrap(" ".join(x for x in (f.caveat, f.resolution) if x), int(w * 15))
    f.fig.text(0.01, 0.01, foot, fontsize=7, va="bottom", ha="left", color="dimgray")
    top = 1 - (0.08 + 0.16 * (title.count("\n") + 1)) / h
    bottom = (0.1 + 0.12 * (foot.count("\n") + 1)) / h
    f.fig.tight_layout(rect=(0, bottom, 1, top))
    return f


def _wrap(text: str, width: int) -> str:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(out + [line] if line else out)


def _say(ax, text: str):
    """A recording without this figure's data: why, in its place."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, _wrap(text, 60), ha="center", va="center", transform=ax.transAxes,
            fontsize=9, color="dimgray")


def _missing(name, title, caveat, reason) -> Figure:
    fig, axes = _new(height=1.6)
    _say(axes[0][0], reason)
    return _finish(Figure(name, title, caveat, fig, missing=reason), None)


def _label(runs, i, label):
    return label if len(runs) > 1 else None


# -- heatmaps ------------------------------------------------------------------


def heatmap_figure(runs, kind: str) -> Figure:
    key = "heatmap" if kind == "writes" else "heatmap_reads"
    name = f"heatmap_{kind}"
    if kind == "writes":
        title = "Write heatmap: slot writes (all layers) by time and physical block"
        caveat = ("Writes only: a block held but not written (a full prompt block of a "
                  "decoding request) is blank, and frees are not seen.")
    else:
        title = "Read heatmap: block reads by time and physical block"
        caveat = ("A read is a (request, block) pair in a step's block table, once per step "
                  "per KV-cache group (docs/access.md): which blocks attention reads, not "
                  "how many bytes; no reads without the block_table probe.")
    docs = [(label, d[key]) for label, d in runs]
    if not any(np.any(h.get(kind) or []) for _, h in docs):
        return _missing(name, title, caveat, f"no {kind} in this recording" +
                        (" (no block_table probe: stock vLLM's reads need the plugin "
                         "or the fork)" if kind == "reads" else ""))
    fig, axes = _new(len(docs), width=7.0 if len(docs) == 1 else 5.5, height=3.6)
    f = Figure(name, title, caveat, fig)
    res = []
    for i, (label, h) in enumerate(docs):
        ax = axes[0][i]
        cells = np.asarray(h[kind], dtype=np.float64)
        f.data[label] = {"cells": cells, "total": int(cells.sum()), "rows": h["rows"],
                         "cols": h["cols"], "block_lo": h["block_lo"],
                         "block_hi": h["block_hi"]}
        if not cells.any():
            _say(ax, f"{label}: no {kind}")
            continue
        t0, t1 = h["t0_ns"] / 1e9, h["t1_ns"] / 1e9
        im = ax.imshow(np.where(cells > 0, cells, np.nan), aspect="auto",
                       interpolation="nearest", cmap="inferno_r" if kind == "writes"
                       else "viridis_r", origin="upper",
                       extent=(h["block_lo"] - 0.5, h["block_hi"] + 0.5, t1, t0))
        ax.set_facecolor("white")
        fig.colorbar(im, ax=ax, label=f"{kind} a cell", fraction=0.05)
        ax.set_xlabel(f"physical block ({h['block_lo']}-{h['block_hi']} of "
                      f"{h['total_blocks']})")
        ax.set_ylabel("seconds since start")
        if len(docs) > 1:
            ax.set_title(label)
        res.append(f"{label + ': ' if len(docs) > 1 else ''}{h['rows']} rows of "
                   f"{h['ns_per_row'] / 1e6:.3g} ms x {h['cols']} columns of "
                   f"{h['blocks_per_col']:.3g} blocks")
    f.resolution = "Resolution: " + "; ".join(res) + "."
    return _finish(f, runs)


# -- utilization ---------------------------------------------------------------


def _first_layer(doc: dict) -> list:
    """The occupancy entries of the chosen layer, one per process."""
    seen, out = set(), []
    for o in doc.get("occupancy") or []:
        if o["layer"] == doc.get("layer", 0) and o["pid"] not in seen:
            seen.add(o["pid"])
            out.append(o)
    return out


def fill_figure(runs) -> Figure:
    name = "fill"
    title = ("Block utilization: tokens a block held at the end of each use "
             "(generation), as a share of its slots")
    caveat = ("From writes only (occupancy from writes, docs/occupancy.md): a generation "
              "ends at the block's next first write, so frees and blocks held but not "
              "written are not seen. A uniform cache would have every generation full but "
              "each request's last.")
    if not any(_first_layer(d) for _, d in runs):
        return _missing(name, title, caveat, "no slot writes with a known block size in "
                        "this recording")
    fig, axes = _new()
    ax = axes[0][0]
    f = Figure(name, title, caveat, fig)
    width = 0.8 / len(runs)
    for i, (label, d) in enumerate(runs):
        occ = _first_layer(d)
        if not occ:
            continue
        bs = occ[0]["block_size"]
        hist = np.zeros(bs + 1, np.int64)
        for o in occ:
            h = np.asarray(o["fill_hist"], np.int64)
            hist[:len(h)] += h[:bs + 1]
        total = int(hist.sum())
        f.data[label] = {"fill_hist": hist, "generations": total, "block_size": bs,
                         "pids": [o["pid"] for o in occ],
                         "full_share": hist[bs] / total if total else None}
        x = np.arange(bs + 1) + (i - (len(runs) - 1) / 2) * width
        share = hist / total if total else hist
        ax.bar(x, 100 * share, width=width, color=COLORS[i % 2],
               label=f"{label}: {total:,} generations" if len(runs) > 1 else None)
        if len(runs) == 1:
            ax.set_title(f"{total:,} generations of layer {occ[0]['layer']}; "
                         f"{100 * f.data[label]['full_share']:.1f}% ended full "
                         f"({bs} tokens)")
    ax.set_xlabel("tokens held at the generation's end")
    ax.set_ylabel("% of generations")
    if len(runs) > 1:
        ax.legend()
    return _finish(f, runs)


def utilization_figure(runs) -> Figure:
    name = "utilization_over_time"
    title = ("True utilization over time (tokens held / slots of the blocks read) beside "
             "vLLM's block-level usage (blocks read / blocks)")
    caveat = ("Both from the block tables read at each step: the blocks running requests "
              "hold, as vLLM's kv_cache_usage counts them (cached blocks no request holds "
              "are free to vLLM and not counted). The gap between the two lines is the "
              "internal fragmentation of the last, part-filled blocks.")
    series = step_series_of(runs)
    if not series:
        return _missing(name, title, caveat, "no block reads in this recording (no "
                        "block_table probe), so no per-step utilization")
    fig, axes = _new(height=3.4)
    ax = axes[0][0]
    f = Figure(name, title, caveat, fig)
    res = []
    for i, (label, s) in enumerate(series):
        t = _since_first(s)
        distinct = np.asarray(s["distinct"])
        held = np.asarray(s["held_tokens"])
        util = np.divide(held, distinct * s["block_size"], out=np.full(len(t), np.nan),
                         where=distinct > 0)
        usage = distinct / s["num_blocks"] if s["num_blocks"] else np.full(len(t), np.nan)
        c = COLORS[i % 2]
        who = f"{label} " if len(runs) > 1 else ""
        ax.plot(t, 100 * util, color=c, lw=1, label=f"{who}true utilization")
        ax.plot(t, 100 * usage, color=c, lw=1, ls="--", label=f"{who}block usage")
        f.data.setdefault(label, []).append({"t_s": t, "utilization": util, "usage": usage,
                                             "steps": s["steps"]})
        if s["per_point"] > 1:
            res.append(f"{who}each point the mean of {s['per_point']} steps "
                       f"({s['steps']:,} steps)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since the group's first step")
    ax.set_ylabel("%")
    ax.legend(fontsize=7)
    f.resolution = ("Resolution: " + "; ".join(res) + ".") if res else ""
    return _finish(f, runs)


def _since_first(s: dict) -> np.ndarray:
    """A series' times from its first step: two runs, overlaid, start
    together (vLLM takes a minute or more to start, a different one a run)."""
    t = np.asarray(s["t_s"], np.float64)
    return t - t[0] if len(t) else t


def step_series_of(runs) -> list:
    """[(label, series)] of each run's groups with steps, a group two
    processes count once (headlines.read_groups)."""
    out = []
    for label, d in runs:
        keep = read_groups(d)
        out += [(label, s) for s in d.get("steps") or []
                if s["steps"] and (s["pid"], s["group_id"]) in keep]
    return out


# -- access --------------------------------------------------------------------


def access_figure(runs) -> Figure:
    name = "access_frequency"
    title = ("Access frequency: reads per physical block (histogram, and the CDF of blocks "
             "by reads)")
    caveat = ("Over the whole recording, blocks read at least once (blocks never read are "
              "counted apart); a read is a (request, block) pair at a step, once per step "
              "per KV-cache group, so a block shared by n requests counts n a step. Every "
              "block read about as often would be one bar and a vertical CDF.")
    per = [(label, reads_per_block(d)) for label, d in runs]
    if not any(p.sum() for _, p in per):
        return _missing(name, title, caveat, "no block reads in this recording (no "
                        "block_table probe)")
    fig, axes = _new(2, width=4.2, height=3.4)
    hist_ax, cdf_ax = axes[0]
    f = Figure(name, title, caveat, fig)
    top = max(int(p.max()) for _, p in per if len(p))
    bins = np.unique(np.linspace(1, top + 1, min(40, top) + 1).astype(np.int64))
    for i, (label, p) in enumerate(per):
        read = p[p > 0]
        if not len(read):
            continue
        blocks, _ = np.histogram(read, bins=bins)
        reads, _ = np.histogram(read, bins=bins, weights=read)
        h1, h10 = hottest_share(p, 0.01), hottest_share(p, 0.10)
        f.data[label] = {"reads_per_block": p, "bins": bins, "blocks": blocks,
                         "reads": reads.astype(np.int64), "total_reads": int(read.sum()),
                         "blocks_read": int(len(read)), "never_read": int(len(p) - len(read)),
                         "hottest_1pct": h1, "hottest_10pct": h10,
                         "frequency": access_counters.frequency_histogram(p)}
        c = COLORS[i % 2]
        who = f"{label}: " if len(runs) > 1 else ""
        hist_ax.stairs(blocks, bins, color=c, fill=len(runs) == 1, alpha=0.8,
                       label=f"{who}{len(read):,} blocks read, {len(p) - len(read):,} never")
        x = np.sort(read)
        cdf_ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=c,
                    label=f"{who}hottest 1% of blocks: {100 * h1:.1f}% of reads; "
                          f"10%: {100 * h10:.1f}%")
    hist_ax.set_xlabel("reads per block")
    hist_ax.set_ylabel("blocks")
    hist_ax.legend(fontsize=7)
    cdf_ax.set_xlabel("reads per block")
    cdf_ax.set_ylabel("share of blocks read with at most x reads")
    cdf_ax.set_ylim(0, 1.02)
    cdf_ax.legend(fontsize=7, loc="lower right")
    f.resolution = (f"Resolution: {len(bins) - 1} bins of "
                    f"{(bins[-1] - bins[0]) / max(1, len(bins) - 1):.3g} reads.")
    return _finish(f, runs)


def working_set_figure(runs) -> Figure:
    name = "working_set"
    title = "Working set over time: distinct blocks read at each step"
    caveat = ("From the block tables read at each step (docs/access.md): the blocks the "
              "running requests' attention reads; a block shared by several requests "
              "counts once.")
    series = step_series_of(runs)
    if not series:
        return _missing(name, title, caveat, "no block reads in this recording (no "
                        "block_table probe), so no working set")
    fig, axes = _new(height=3.0)
    ax = axes[0][0]
    f = Figure(name, title, caveat, fig)
    res = []
    for i, (label, s) in enumerate(series):
        who = f"{label}: " if len(runs) > 1 else ""
        d = np.asarray(s["distinct"])
        t = _since_first(s)
        ax.plot(t, d, color=COLORS[i % 2], lw=1,
                label=f"{who}pid {s['pid']}, {s['num_blocks']:,} blocks")
        f.data.setdefault(label, []).append({"t_s": t, "distinct": d,
                                             "steps": s["steps"]})
        if s["per_point"] > 1:
            res.append(f"{who}each point the mean of {s['per_point']} steps")
    ax.set_xlabel("seconds since the group's first step")
    ax.set_ylabel("blocks")
    ax.legend(fontsize=7)
    f.resolution = ("Resolution: " + "; ".join(res) + ".") if res else ""
    return _finish(f, runs)


# -- the plugin tier -----------------------------------------------------------

RESIDENCY = (("lifetime", "lifetime"), ("idle_before_evict", "idle before evict"),
             ("reuse_gap", "reuse gap"))


def residency_figure(runs) -> Figure:
    name = "residency"
    title = ("Block residency in vLLM's kv_block_* buckets: lifetime, idle before "
             "eviction, reuse gap")
    caveat = ("From the plugin tier's block events (docs/lifecycle.md), every block. "
              "idle_before_evict is vLLM's name: one sample per re-allocation, cached or "
              "not. Buckets are vLLM's, in seconds: a sample counts in the first bucket "
              "whose bound it does not exceed.")
    have = [(label, d["lifecycle"]) for label, d in runs if d.get("lifecycle")]
    if not have:
        return _missing(name, title, caveat, "no plugin tier events in this recording "
                        "(block allocations, hits, frees come from the vLLM plugin)")
    fig, axes = _new(len(runs), width=7.0 if len(runs) == 1 else 5.5)
    f = Figure(name, title, caveat, fig)
    for i, (label, d) in enumerate(runs):
        ax = axes[0][i]
        life = d.get("lifecycle")
        if not life:
            _say(ax, f"{label}: no plugin tier events")
            continue
        bounds = [b for b, _ in life["lifetime"]["buckets"]]
        width = 0.8 / len(RESIDENCY)
        f.data[label] = {}
        for j, (key, words) in enumerate(RESIDENCY):
            cum = np.asarray([c for _, c in life[key]["buckets"]], np.int64)
            per = np.diff(np.r_[0, cum])
            f.data[label][key] = {"bounds": bounds, "counts": per,
                                  "count": life[key]["count"]}
            ax.bar(np.arange(len(per)) + (j - 1) * width, per, width=width,
                   label=f"{words} ({life[key]['count']:,})")
        ax.set_xticks(np.arange(len(bounds)), [str(b) for b in bounds], rotation=60,
                      fontsize=6)
        ax.set_xlabel("seconds, at most (le)")
        ax.set_ylabel("blocks")
        ax.legend(fontsize=7)
        if len(runs) > 1:
            ax.set_title(label)
    return _finish(f, runs)


def mrc_figure(runs) -> Figure:
    name = "miss_ratio_curve"
    title = "The prefix cache's miss-ratio curve: misses of an LRU cache of C free blocks"
    caveat = ("Mattson's stack distances over the block references with content hashes "
              "(prefix hits and blocks cached); vLLM evicts only free blocks, so C counts "
              "the blocks free for reuse, not the cache's size. First references miss at "
              "any size.")
    have = [(label, (d.get("lifecycle") or {}).get("miss_ratio_curve")) for label, d in runs]
    if not any(m for _, m in have):
        return _missing(name, title, caveat, "no prefix-cache references with content "
                        "hashes in this recording (prefix caching off, or no plugin tier)")
    fig, axes = _new(height=3.2)
    ax = axes[0][0]
    f = Figure(name, title, caveat, fig)
    for i, (label, m) in enumerate(have):
        if not m:
            continue
        n = m["references"]
        sizes = np.asarray([c for c, _ in m["curve"]])
        miss = 1 - np.asarray([r for _, r in m["curve"]])
        floor = m["compulsory"] / n if n else 0
        observed = 1 - m["observed_hits"] / n if n else 0
        c = COLORS[i % 2]
        who = f"{label}: " if len(runs) > 1 else ""
        ax.plot(sizes, 100 * miss, marker="o", color=c, label=f"{who}LRU ({n:,} references)")
        ax.axhline(100 * observed, color=c, ls="--", lw=1,
                   label=f"{who}vLLM's misses {100 * observed:.1f}%")
        ax.axhline(100 * floor, color=c, ls=":", lw=1,
                   label=f"{who}first references {100 * floor:.1f}%")
        f.data[label] = {"sizes": sizes, "miss_ratio": miss, "references": n,
                         "observed_miss": observed, "compulsory": floor}
    ax.set_ylim(0, 105)
    ax.set_xlabel("free blocks in the LRU cache (C)")
    ax.set_ylabel("miss ratio, %")
    ax.legend(fontsize=7)
    return _finish(f, runs)


MARKS = {"hit": ("^", "tab:green", "prefix hit"), "evict": ("x", "tab:red", "eviction"),
         "preempt": ("D", "tab:orange", "preempted"), "alloc": ("|", "tab:blue", "allocation")}


def timeline_figure(runs) -> Figure:
    name = "request_timeline"
    title = "Per-request timeline: each request's blocks from allocation to free"
    caveat = ("From the plugin tier's block and request events (docs/lifecycle.md): a bar "
              "from a request's first block event to its last; its thickness is the most "
              "blocks it held at once (allocations and hits less frees); prefix hits, "
              "evictions and preemptions marked.")
    have = [(label, (d.get("lifecycle") or {}).get("requests") or []) for label, d in runs]
    if not any(r for _, r in have):
        return _missing(name, title, caveat, "no plugin tier events in this recording "
                        "(requests come from the vLLM plugin)")
    height = max(2.6, 0.12 * min(TIMELINE_REQUESTS, max(len(r) for _, r in have)) + 1.4)
    fig, axes = _new(len(runs), width=7.0 if len(runs) == 1 else 5.5, height=height)
    f = Figure(name, title, caveat, fig)
    res = []
    for i, (label, reqs) in enumerate(have):
        ax = axes[0][i]
        if not reqs:
            _say(ax, f"{label}: no plugin tier events")
            continue
        rows = []
        for r in reqs:
            held = peak = blocks = 0
            marks = {}
            for t, kind, _, what in r["events"]:
                n = len(what) if isinstance(what, list) else 0
                if kind in ("alloc", "hit"):
                    held += n
                    blocks += n
                elif kind == "free":
                    held -= n
                peak = max(peak, held)
                if kind in MARKS:
                    marks.setdefault(kind, []).append(t)
            times = [e[0] for e in r["events"]]
            rows.append({"req": r["req"], "id": r["id"], "start": min(times),
                         "end": max(times), "peak_blocks": peak, "blocks": blocks,
                         "marks": marks})
        shown = sorted(rows, key=lambda x: -x["blocks"])[:TIMELINE_REQUESTS]
        shown.sort(key=lambda x: x["start"])
        top = max([x["peak_blocks"] for x in shown] + [1])
        for y, x in enumerate(shown):
            ax.barh(y, max(x["end"] - x["start"], 1e-6), left=x["start"],
                    height=0.2 + 0.7 * x["peak_blocks"] / top, color="lightsteelblue",
                    edgecolor="steelblue", lw=0.5)
            for kind, ts in x["marks"].items():
                if kind == "alloc":
                    continue  # the bar is the allocations
                m, c, _ = MARKS[kind]
                ax.plot(ts, [y] * len(ts), m, color=c, ms=4, ls="none")
        for kind in ("hit", "evict", "preempt"):
            m, c, words = MARKS[kind]
            ax.plot([], [], m, color=c, ls="none", label=words)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_yticks([])
        ax.set_ylabel(f"{len(shown)} of {len(rows):,} requests, by first event")
        ax.set_xlabel("seconds since start")
        if len(runs) > 1:
            ax.set_title(label)
        f.data[label] = {"requests": len(rows), "shown": shown}
        if len(shown) < len(rows):
            res.append(f"{label + ': ' if len(runs) > 1 else ''}the {len(shown)} busiest "
                       f"requests (most blocks) of {len(rows):,}")
    f.resolution = ("Shown: " + "; ".join(res) + ".") if res else ""
    return _finish(f, runs)


# -- the flame graph -----------------------------------------------------------


def flame_tree(lines: list) -> dict:
    """Folded lines (`a;b;c WEIGHT`) as a tree: {"name", "weight", "children"}."""
    root = {"name": "all", "weight": 0, "children": {}}
    for line in lines:
        path, _, w = line.rpartition(" ")
        w = int(w)
        root["weight"] += w
        node = root
        for frame in path.split(";"):
            node = node["children"].setdefault(frame, {"name": frame, "weight": 0,
                                                       "children": {}})
            node["weight"] += w
    return root


def flame_figure(runs) -> Figure:
    name = "flame_graph"
    title = ("Flame graph: where the cache traffic comes from (process; user stack; op; "
             "layer), by slots written and block pairs moved")
    caveat = ("From the stacks the tracer took at each op (export --folded --by stack): "
              "short where the target's libraries were built without frame pointers, as "
              "torch's and vLLM's wheels are; [no stack: ...] says why a path is missing "
              "(docs/folded.md). Reads and the plugin's events are not weighed here.")
    have = [(label, d.get("folded") or []) for label, d in runs]
    if not any(lines for _, lines in have):
        return _missing(name, title, caveat, "no slot writes or block moves in this "
                        "recording to weigh")
    trees = [(label, flame_tree(lines)) for label, lines in have]
    depth = max(_depth(t) for _, t in trees)
    fig, axes = _new(len(runs), width=7.0 if len(runs) == 1 else 5.5,
                     height=max(2.4, 0.28 * depth + 1.2))
    f = Figure(name, title, caveat, fig)
    for i, (label, tree) in enumerate(trees):
        ax = axes[0][i]
        if not tree["weight"]:
            _say(ax, f"{label}: nothing to weigh")
            continue
        drawn = []
        _flame(ax, tree, 0.0, 0, tree["weight"], drawn)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, depth + 1)
        ax.set_yticks([])
        ax.set_xticks([])
        for s in ax.spines.values():
            s.set_visible(False)
        if len(runs) > 1:
            ax.set_title(label)
        f.data[label] = {"total": tree["weight"], "frames": drawn, "lines": have[i][1]}
    f.resolution = (f"Frames under {100 * FLAME_MIN_SHARE:.1f}% of the weight are not "
                    "drawn (their weight stays in their parent).")
    return _finish(f, runs)


def _depth(node) -> int:
    return 1 + max([_depth(c) for c in node["children"].values()] + [0])


def _flame(ax, node, x: float, level: int, total: int, drawn: list):
    w = node["weight"] / total
    if w < FLAME_MIN_SHARE:
        return
    # a frame's colour from its name, the same every run (hash() is salted)
    hue = (zlib.crc32(node["name"].encode()) % 1000) / 1000
    ax.add_patch(Rectangle((x, level), w, 0.92, facecolor=(0.95, 0.45 + 0.4 * hue, 0.2),
                           edgecolor="white", lw=0.3))
    label = f"{node['name']} ({100 * w:.1f}%)"
    if w > 0.06:
        ax.text(x + 0.004, level + 0.46, label[:int(w * 110)], va="center", fontsize=6,
                clip_on=True)
    drawn.append((level, node["name"], node["weight"]))
    for child in sorted(node["children"].values(), key=lambda c: c["name"]):
        _flame(ax, child, x, level + 1, total, drawn)
        x += child["weight"] / total


# -- all of them ---------------------------------------------------------------

BUILDERS = (
    lambda runs: heatmap_figure(runs, "writes"),
    lambda runs: heatmap_figure(runs, "reads"),
    fill_figure, utilization_figure, access_figure, working_set_figure, residency_figure,
    mrc_figure, timeline_figure, flame_figure,
)
NAMES = ("heatmap_writes", "heatmap_reads", "fill", "utilization_over_time",
         "access_frequency", "working_set", "residency", "miss_ratio_curve",
         "request_timeline", "flame_graph")


def figures(runs, progress=None):
    """Every figure of runs ([(label, picture document)]), in the page's order,
    one at a time (a generator: each can be written and closed before the
    next is drawn).  progress(i, n, name): called before each."""
    for i, (build, name) in enumerate(zip(BUILDERS, NAMES)):
        if progress:
            progress(i + 1, len(NAMES), name)
        yield build(runs)


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)
