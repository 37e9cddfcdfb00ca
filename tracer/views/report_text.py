"""The report in the terminal (rich): the trace's header, per-block
histograms, op rates, the heatmap, occupancy, access and the plugin tier's
figures.
"""

import io

import numpy as np
from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import abi
from ..analysis import heatmap, misses, occupancy
from ..analysis.report import Report, access_figures, log2_slot, value_counts
from . import heatmap_text, panels

ACCESS_MEANS = ("reads: (request, block) pairs at a forward step, counted once per step "
                "for the group's layers (all layers: x layers); working set: distinct "
                "blocks read at a step; utilization: tokens held in them over their "
                "capacity; sharing: requests reading one block at a step; age: time since "
                "a block's last read; idle before reuse: last read to its next generation's "
                "first write (docs/access.md)")


LIFE_SHOWN_REQUESTS = 12


def titled(table: Table):
    """The table under its title, the title a line of its own: a rich
    table wraps its title to the table's width, and a narrow table (the
    miss-ratio curve's two columns) squeezed a sentence into a column of
    25 characters."""
    if not table.title:
        return table
    head = Text(str(table.title), style=table.title_style or "table.title")
    table.title = None
    return Group(head, table)


def curve_table(t: Table, curve: list, room: int) -> Table:
    """The miss-ratio curve's points in t: across, a column a cache size
    (the curve has at most 11 points), where that fits in room; else
    down, a row a size."""
    heads = [f"{size:,}" for size, _ in curve]
    cells = [f"{100 * ratio:.1f}%" for _, ratio in curve]
    across = Table(box=t.box, pad_edge=False)
    across.add_column("cache blocks")
    for head in heads:
        across.add_column(head, justify="right")
    across.add_row("hit ratio", *cells)
    if Measurement.get(_MEASURE, _MEASURE.options, across).maximum <= room:
        for col in across.columns:
            t.add_column(col.header, justify=col.justify)
        t.add_row("hit ratio", *cells)
        return t
    t.add_column("cache blocks", justify="right")
    t.add_column("hit ratio", justify="right")
    for head, cell in zip(heads, cells):
        t.add_row(head, cell)
    return t


_MEASURE = Console(width=1000, file=io.StringIO())


def lifecycle_view(figs: dict, width: int) -> list:
    if not figs:
        return []
    s = figs["summary"]
    head = Text(", ".join(f"{n:,} {panels.LIFE_WORDS[k]}" + (
        f" ({s['reallocated']:,} of them re-allocations)" if k == "alloc" and "reallocated" in s
        else "") for k, n in s["blocks"].items()))
    if s["prefix_served_share"] is not None:
        head.append(f"; the prefix cache served {100 * s['prefix_served_share']:.1f}% of the "
                    "blocks requests needed")
    if s["incomplete_events"]:
        head.append(f"; {s['incomplete_events']:,} events with ids missing (left out)",
                    style="red")
    # vLLM's collector calls every re-allocation an eviction, cached or not:
    # its name is kept (the metrics overlay), and the screen says so
    hist = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="block residency, every block "
                 "(vLLM's kv_block_* buckets, seconds; cumulative)", title_justify="left")
    hist.add_column("le", justify="right")
    names = ("lifetime", "idle_before_evict", "reuse_gap")
    for n in names:
        hist.add_column(f"{n}\n{figs[n]['count']:,}", justify="right")
    rows = list(zip(*(figs[n]["buckets"] for n in names)))
    last = None
    for row in rows:
        counts = tuple(c for _, c in row)
        if counts == last and row[0][0] != "+Inf":
            continue  # runs of equal rows say nothing
        last = counts
        hist.add_row(str(row[0][0]), *(f"{c:,}" for c in counts))
    reqs = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                 title=f"requests (the first {min(LIFE_SHOWN_REQUESTS, s['requests'])} of "
                       f"{s['requests']:,}; --format json has all, event by event)",
                 title_justify="left")
    shown = figs["requests"][:LIFE_SHOWN_REQUESTS]
    for col in ("request", "first (s)", "last (s)", *abi.LIFE, "preempted"):
        reqs.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    acc = None
    if any(r.get("access") for r in shown):
        a = s["access_steps"]
        acc = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                    title="what each request wrote and read: tokens written, the blocks "
                          "they went to, block reads in all and a step (step_reqs named "
                          f"the rows of {a['steps']:,} steps" +
                          (f"; {a['unmatched']:,} unnamed" if a["unmatched"] else "") + ")")
        for col in ("request", "steps", "tokens", "blocks", "reads", "a step"):
            acc.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    for r in shown:
        per = dict.fromkeys(abi.LIFE, 0)
        preempted = 0
        for _, kind, _, what in r["events"]:
            if kind in per:
                per[kind] += len(what)
            elif kind == "preempt":
                preempted += 1
        reqs.add_row(r["id"] or r["req"], f"{r['events'][0][0]:.3f}", f"{r['events'][-1][0]:.3f}",
                     *(f"{per[k]:,}" for k in abi.LIFE), f"{preempted:,}")
        a = r.get("access")
        if acc is not None:
            acc.add_row(r["id"] or r["req"], *(("-",) * 5 if not a else (
                f"{a['steps']:,}", f"{a['tokens_written']:,}",
                f"{np.count_nonzero(a['blocks']['tokens_written']):,}",
                f"{a['block_reads']:,}",
                f"{a['block_reads'] / a['steps']:.1f}" if a["steps"] else "-")))
    parts = [head, titled(hist), Text("idle_before_evict: vLLM's name, one sample per "
                                       "re-allocation, cached or not")]
    mrc = figs.get("miss_ratio_curve")
    if mrc:
        n = mrc["references"]
        top = (n - mrc["compulsory"]) / n if n else 0
        m = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"miss-ratio curve: the hit ratio of an LRU cache of C free blocks "
                        f"(Mattson, over {n:,} block references)")
        # inside the panel: its border and padding take 4 columns
        parts.append(titled(curve_table(m, mrc["curve"], width - 4)))
        # what bounds the curve, under it: a title of its own would wrap
        parts.append(Text(f"vLLM hit {100 * mrc['observed_hits'] / n if n else 0:.1f}%; "
                          f"{mrc['compulsory']:,} first references miss at any size, so no "
                          f"cache hits more than {100 * top:.1f}%; {mrc['refetched']:,} blocks "
                          "recomputed whose content had been cached (a larger cache would "
                          "have hit them)"))
    parts.append(titled(reqs))
    if acc is not None:
        parts.append(titled(acc))
    parts.extend(misses_view(figs.get("misses"), mrc))
    return [Panel(Group(*parts), title="block lifecycle (plugin tier)",
                  title_align="left", width=width)]


MISS_WORDS = {"compulsory": "compulsory (new content)",
              "capacity": "capacity (evicted before)",
              "below_block": "below the block (prefix ended inside it)",
              "hash_domain": "hash domain (same tokens, other salt/LoRA/mm)",
              "resident": "resident (cached, not matched)"}


def misses_view(m: dict, mrc: dict = None) -> list:
    """Why the prefix cache missed (docs/misses.md): the classes, the worst
    requests, removal reasons, regret and LRU's gap to optimal."""
    if not m:
        return []
    parts = []
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
              title="prefix-cache misses: the prompt blocks requests computed, by cause" +
                    ("" if m["prefix_hashes"] else
                     " (no prefix_hashes: hash domain and below the block unseen)"))
    for col in ("cause", "blocks", "tokens", "requests"):
        t.add_column(col, justify="left" if col == "cause" else "right", no_wrap=True)
    for c in misses.CAUSES:
        x = m["totals"][c]
        t.add_row(MISS_WORDS[c], f"{x['blocks']:,}", f"{x['tokens']:,}", f"{x['requests']:,}")
    parts.append(titled(t))
    worst = sorted((r for r in m["requests"] if any(r["missed_blocks"].values())),
                   key=lambda r: -sum(r["recomputed_tokens"].values()))[:misses.WORST_SHOWN]
    if worst:
        w = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title="the requests that recomputed the most (tokens per cause)")
        w.add_column("request", no_wrap=True)
        w.add_column("hit", justify="right")
        for c in misses.CAUSES:
            w.add_column(c.replace("_", " "), justify="right")
        for r in worst:
            w.add_row(r["id"] or r["req"], f"{r['hit_blocks']:,}",
                      *(f"{r['recomputed_tokens'][c]:,}" for c in misses.CAUSES))
        parts.append(titled(w))
    rem = m["removals"]
    line = "removals: " + ", ".join(f"{n:,} {k}" for k, n in rem["reasons"].items())
    if rem["evicted_for"]:
        e = rem["evicted_for"][0]
        line += f"; most evictions were for {e['id'] or e['req']} ({e['blocks']:,} blocks)"
    reg = m["regret"]
    line += (f"; regret: {reg['blocks']:,} evicted blocks asked for again, "
             f"{reg['tokens']:,} tokens recomputed")
    parts.append(Text(line))
    opt = m.get("optimal_curve")
    if opt and mrc:
        gaps = [(c, o - lru) for (c, lru), (_, o) in zip(mrc["curve"], opt)]
        c, gap = max(gaps, key=lambda x: x[1])
        parts.append(Text("optimal (Belady) hit ratio at the curve's sizes: " + ", ".join(
            f"{c}: {100 * o:.1f}%" for c, o in opt) +
            f"; LRU's largest gap to it: {100 * gap:.1f} points at {c} blocks"))
    return parts


def access_view(figs: list, width: int) -> list:
    parts = []
    for f in figs:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_header=False)
        t.add_column("figure", no_wrap=True)
        t.add_column("value")

        def pct(pairs, fmt):
            return "  ".join(f"p{int(p)} {fmt(v)}" for p, v in pairs) or "-"

        layers = f"{f['layers']} layer{'s' if f['layers'] != 1 else ''}"
        t.add_row("steps", f"{f['steps']:,} ({layers} a step" +
                  (f"; {f['layers_note']})" if f.get("layers_note") else ")"))
        t.add_row("block reads", f"{f['reads']:,} (x {layers}: {f['reads_all_layers']:,})")
        t.add_row("working set, blocks a step", pct(f["wss_blocks"], lambda v: f"{v:,.0f}"))
        t.add_row("utilization of the working set",
                  pct(f["utilization"], lambda v: f"{100 * v:.1f}%"))
        # the live set's internal fragmentation: what occupancy from writes
        # (below) can only estimate, as it sees neither frees nor held blocks;
        # named apart from that panel's "unwritten share", which differs by
        # definition and may move the other way between two runs
        t.add_row("internal fragmentation of the blocks read (1 - utilization)",
                  pct(f["internal_fragmentation"], lambda v: f"{100 * v:.1f}%"))
        if f["sharing_mean"] is not None:
            t.add_row("sharing (requests a block)", f"mean {f['sharing_mean']:.2f}; most at "
                      f"one step: " + ", ".join(f"{d}: {n} blocks" for d, n in
                                                f["sharing_max_by_block"][-4:]))
        t.add_row("blocks read", f"{f['blocks_read']:,}")
        r = f["prefix_reuse"]
        if r is not None:
            how = "by request id" if r["by"] == "request ids" else "inferred from rows"
            t.add_row(f"prefix reuse ({how})", f"{r['blocks']:,} blocks found cached by "
                      f"{r['requests']:,} requests at their first step" +
                      (f"; most reused block:times " + ", ".join(
                          f"{b}:{n}" for b, n in r["most_reused"]) if r["most_reused"] else ""))
        t.add_row("hottest block:reads", ", ".join(f"{b}:{n:,}" for b, n in f["hottest"]))
        t.add_row("coldest block:reads", ", ".join(f"{b}:{n:,}" for b, n in f["coldest"]))
        t.add_row("age at the end (s)", pct(f["age_s_at_end"], lambda v: f"{v:.3g}"))
        t.add_row("idle before reuse (s)", f"{f['reuses']:,} reuses: " +
                  pct(f["idle_before_reuse_s"], lambda v: f"{v:.3g}"))
        freq = _distribution_rows(f["frequency"])
        parts.append(Panel(Group(t, freq), title=f"pid {f['pid']}, group {f['group']}: "
                           "access patterns (reads)", title_align="left", width=width))
    if parts:
        parts.append(Text(ACCESS_MEANS, style="dim"))
    return parts


def _distribution_rows(rows: list) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="access frequency: blocks by reads",
              title_justify="left", title_style="bold")
    for col in ("reads", "blocks", ""):
        t.add_column(col, justify="right" if col else "left")
    top = max([n for _, _, n in rows] + [0])
    for lo, hi, n in rows:
        t.add_row(f"{lo}-{hi}" if lo != hi else f"{lo}", f"{n:,}", _bar(n, top))
    return t


def _header(rep: Report) -> Text:
    t, m = rep.trace, rep.trace.meta
    text = Text()
    text.append(f"{t.path}\n", style="bold")
    release = (m['kernel'].split() + ["?", "?"])[1]  # "Linux RELEASE VERSION"
    text.append(f"recorded {m['created_utc']} on {m['host']} ({release})\n")
    text.append(f"{rep.duration_ns() / 1e9:.1f} s, {len(rep.ops.ops):,} ops, "
                f"{rep.ops.values_decoded:,} index values\n")
    for pid, p in sorted(t.processes.items()):
        ids = ", ".join(f"{f['path'].rsplit('/', 1)[-1]} build-id {(f.get('build_id') or '?')[:12]}"
                        for f in p.get("probe_files", []))
        proc = rep.agg.processes.get(pid)
        who = panels.describe(proc) if proc is not None else f"pid {pid} ({p.get('comm', '?')})"
        text.append(f"{who}: {ids}\n")
    text.append("stream: ")
    text.append("complete" if not rep.reasons else "NOT complete: " + "; ".join(rep.reasons),
                style="green" if not rep.reasons else "bold red")
    return text


def _bar(v, top, width=16):
    return "*" * max(1 if v else 0, round(width * v / top)) if top else ""


def _moves_histograms(rep: Report, width: int) -> list:
    parts = []
    for p in sorted(rep.agg.processes.values(), key=lambda p: p.pid):
        for kind, arr in p.moves.items():
            if arr.any():
                parts += [Text(f"pid {p.pid}: {kind} per block, all layers", style="bold"),
                          panels.histogram(arr, width, rows=4, what=kind)]
    return parts


def _rates_table(rates: dict, width: int = 120) -> Table:
    """Calls/s per time bin: a row a bin and a column an op where the ops
    fit in width; else a row an op and a column a bin (its 10 bins fit),
    so that no op's name is cut to a few letters."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False,
              title=f"calls/s per {rates['bin_s']:.3g} s, all layers",
              title_justify="left", title_style="bold")
    ops = list(rates["calls_per_s"])
    nbins = len(next(iter(rates["calls_per_s"].values()), []))
    digits = max(0, 1 - int(np.floor(np.log10(rates["bin_s"])))) if rates["bin_s"] > 0 else 0
    starts = [f"{(rates['t0_ns'] / 1e9 + i * rates['bin_s']):.{digits}f}" for i in range(nbins)]
    cells = {op: [panels._rate(v) for v in rates["calls_per_s"][op]] for op in ops}
    if 8 + sum(max(len(op), 5) + 3 for op in ops) > width:
        t.add_column("op \\ from s", no_wrap=True)
        for start in starts:
            t.add_column(start, justify="right")
        for op in ops:
            t.add_row(op, *cells[op])
        return t
    t.add_column("from s", justify="right")
    for op in ops:
        t.add_column(op, justify="right")
    for i in range(nbins):
        t.add_row(starts[i], *(cells[op][i] for op in ops))
    return t


def _distribution(title: str, pairs: list, unit: str) -> Table:
    """Value counts bucketed in log2 ranges (exact counts)."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left",
              title_style="bold")
    for col in (unit, "generations", ""):
        t.add_column(col, justify="right" if col != "" else "left")
    if not pairs:
        return t
    v = np.array([p[0] for p in pairs])
    n = np.array([p[1] for p in pairs])
    slot = log2_slot(v)
    agg = np.bincount(slot, weights=n).astype(np.int64)
    top = agg.max()
    for s in np.flatnonzero(agg):
        lo, hi = (0, 0) if s == 0 else (1 << (s - 1), (1 << s) - 1)
        t.add_row(f"{lo}-{hi}", f"{agg[s]:,}", _bar(agg[s], top))
    return t


def _mean(a: np.ndarray) -> float:
    """The mean, or NaN for none (which numpy would warn about)."""
    return float(a.mean()) if len(a) else float("nan")


GENERATION_MEANS = ("generation: one use of a block, from a write at its offset 0 (or a "
                    "copy or swap into it) to the block's next such start")


def _occupancy_view(rep: Report, layer: int, width: int) -> list:
    parts = []
    src = rep.occupancy_source
    by_pid = {}
    for (pid, cache_id), g in rep.gens.items():
        by_pid.setdefault(pid, []).append((rep.layers[(pid, cache_id)], g))
    for pid, layers in sorted(by_pid.items()):
        layers.sort(key=lambda x: x[0])
        chosen = [g for n, g in layers if n == layer]
        if not chosen:
            parts.append(Text(f"pid {pid}: no layer {layer}", style="yellow"))
            continue
        g = chosen[0]
        same = sum(1 for _, o in layers if np.array_equal(o.fill, g.fill)
                   and np.array_equal(o.block, g.block))
        parts.append(occupancy_panel(g, src, f"pid {pid}, layer {layer}",
                                     f"{same} of {len(layers)} layers have the same generations",
                                     width))
    return parts


def occupancy_panel(g: occupancy.Generations, src: occupancy.Source, where: str, note: str,
                    width: int) -> Panel:
    """One layer's generations, named by src (occupancy.Source), its caveat
    at the top: the figures mean what the source can see."""
    fill = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=src.fill,
                 title_justify="left", title_style="bold")
    for col in ("tokens", "fill", "generations", ""):
        fill.add_column(col, justify="right" if col != "" else "left")
    hist = g.fill_hist
    top = hist.max() if len(hist) else 0
    for tok in np.flatnonzero(hist):
        fill.add_row(str(tok), f"{tok / g.block_size:.0%}", f"{hist[tok]:,}",
                     _bar(hist[tok], top))
    frag = g.fragmentation
    spark = Text()
    if g.steps:
        bins = min(g.steps, max(10, width - 20))
        edges = np.linspace(0, g.steps, bins + 1).astype(int)
        for a, b in zip(edges[:-1], edges[1:]):
            seg = frag[a:max(b, a + 1)]
            seg = seg[~np.isnan(seg)]
            spark.append(panels._BARS[int(round(seg.mean() * 8))] if len(seg) else " ",
                         style="magenta")
    mean = float(np.nanmean(frag)) if np.any(~np.isnan(frag)) else float("nan")
    body = []
    if src.caveat:
        body.append(Text(src.caveat + " (docs/occupancy.md)", style="yellow"))
    body += [Text(f"{len(g):,} generations (" + ", ".join(
                f"{int(np.count_nonzero(g.kind == i)):,} by {k}"
                for i, k in enumerate(occupancy.KINDS) if np.any(g.kind == i)) +
                f"); mean {src.fill} {_mean(g.fill) / g.block_size:.1%} of {g.block_size} "
                f"tokens; most writes in one generation: {g.max_writes}"
                + (" (more than block_size!)" if g.max_writes > g.block_size else "")),
             Text(note), fill,
             Text(f"{src.fragmentation}, over {g.steps:,} steps (mean {mean:.1%}; "
                  "bar height 0-100%)", style="bold"), spark]
    if src.not_fragmentation:
        body.append(Text(src.not_fragmentation, style="dim"))
    grid = Table.grid(padding=(0, 4))
    span, gap = (x.split(" (")[0] for x in (src.span, src.gap))
    grid.add_row(_distribution(span, value_counts(g.lifetime_steps), "steps"),
                 _distribution(gap, value_counts(g.reuse_steps[g.reuse_steps >= 0]), "steps"))
    body.append(grid)
    body.append(Text(f"{GENERATION_MEANS}. {src.span}; {src.gap}.", style="dim"))
    if g.incomplete_ops:
        body.append(Text(f"{g.incomplete_ops} ops left out (values lost)", style="red"))
    return Panel(Group(*body), title=f"{src.title}: {where}", title_align="left", width=width)


def render(rep: Report, hm: heatmap.Heatmap, rates: dict, width: int, layer: int) -> Group:
    parts = [_header(rep),
             panels.render(rep.agg, None, title="per-block histograms (from the stream)",
                         elapsed=rep.duration_ns() / 1e9, width=width)]
    parts += _moves_histograms(rep, max(10, width - 12))
    if rates["calls_per_s"]:
        parts.append(_rates_table(rates, width))
    parts += [Text(f"{hm.what}: time (rows) x blocks (columns)", style="bold"),
              heatmap_text.render(hm)]
    parts += access_view(access_figures(rep), width)
    parts += lifecycle_view(rep.lifecycle, width)
    parts += _occupancy_view(rep, layer, width)
    return Group(*parts)
