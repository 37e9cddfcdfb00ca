"""The headline figures of a report, and two reports' differences: what
`report A B` prints in the terminal and heads its page with (report --html).
Read from the report's JSON document (read back as plain lists:
exporters/report_json.plain), so a headline is the number JSON has.
Numbers only: views/ and exporters/ draw them.
"""

import numpy as np

from .. import abi
from ..trace import stream


def _pct(pairs, p):
    return next((v for q, v in pairs or [] if q == p), None)


def read_groups(doc: dict) -> set:
    """The (pid, group_id) of each KV-cache group's reads, counted once: vLLM's
    engine core counts a group's reads from the plugin and its worker (a
    child of it) from the op, the same block tables (at the end, the same
    counts: tests/test_e2e_plugin.py), and the first of the two, by pid, stands
    for both.  The same group: parent and child, the same group index,
    blocks and block size (as views/panels.py's reads_panel tells them)."""
    procs = sorted(doc["blocks"]["processes"], key=lambda p: p["pid"])
    parent = {p["pid"]: p.get("parent") for p in procs}
    kept, out = [], set()
    for p in procs:
        for g in p.get("groups") or []:
            key = (g["group"], g.get("num_blocks"), g.get("block_size"))
            if any(k == key and (parent.get(p["pid"]) == q or parent.get(q) == p["pid"])
                   for k, q in kept):
                continue
            kept.append((key, p["pid"]))
            out.add((p["pid"], g["group_id"]))
    return out


def _sum_group(doc, key):
    keep = read_groups(doc)
    return sum(g.get(key) or 0 for g in doc.get("access") or []
               if (g["pid"], g["group_id"]) in keep)


def dense(pairs, n: int = 0) -> np.ndarray:
    """A per-block array from the document's sparse [[block, count], ...]."""
    a = np.asarray(pairs, np.int64).reshape(-1, 2)
    out = np.zeros(max(n, int(a[:, 0].max()) + 1 if len(a) else 0), np.int64)
    out[a[:, 0]] = a[:, 1]
    return out


def reads_per_block(doc: dict) -> np.ndarray:
    """Every group's reads per block (blocks.processes[].groups[]), one array:
    blocks of different groups are different blocks; a group two processes
    count, once (read_groups)."""
    keep = read_groups(doc)
    parts = [dense(g["reads_per_block"], g.get("num_blocks") or 0)
             for p in doc["blocks"]["processes"] for g in p.get("groups") or []
             if (p["pid"], g["group_id"]) in keep]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def hottest_share(per_block: np.ndarray, fraction: float) -> float:
    """The share of the reads that the hottest `fraction` of the blocks read
    took (at least one block); None without reads."""
    read = np.sort(per_block[per_block > 0])[::-1]
    if not len(read):
        return None
    return float(read[:max(1, int(round(fraction * len(read))))].sum() / read.sum())


def _hottest(doc, fraction):
    return hottest_share(reads_per_block(doc), fraction)




def _fill(doc):
    """Mean written fill at generation end, over the chosen layer's
    generations of every process (occupancy's fill_level_mean, weighted)."""
    layer = doc.get("layer", 0)
    n = s = 0
    seen = set()
    for o in doc.get("occupancy") or []:
        if o["layer"] == layer and o["pid"] not in seen and o["fill_level_mean"] is not None:
            seen.add(o["pid"])
            n += o["generations"]
            s += o["fill_level_mean"] * o["generations"]
    return s / n if n else None


def headlines(doc: dict) -> list:
    """[(label, value, kind)]: kind "n" a count, "%" a share (0-1), "s"
    seconds.  None where the recording has no such figure."""
    ops = doc["blocks"]["ops"]
    writes = sum(o["slots"] for name, o in ops.items() if name in WRITE_OPS)
    life = doc.get("lifecycle") or {}
    summary = life.get("summary") or {}
    blocks = summary.get("blocks") or {}
    preempts = sum(1 for r in life.get("requests") or [] for e in r["events"]
                   if e[1] == "preempt") if life else None
    keep = read_groups(doc)
    acc = [a for a in doc.get("access") or [] if (a["pid"], a["group_id"]) in keep]
    util = [_pct(a["utilization"], 50) for a in acc if a["utilization"]]
    wss = [_pct(a["wss_blocks"], 50) for a in acc if a["wss_blocks"]]
    wss_max = [_pct(a["wss_blocks"], 100) for a in acc if a["wss_blocks"]]
    blocks_written = sum(int(np.count_nonzero(dense(l["writes"])))
                         for p in doc["blocks"]["processes"] for l in p["layers"]
                         if l["layer"] == doc.get("layer", 0))
    return [
        ("duration", doc["trace"]["duration_s"], "s"),
        ("ops recorded", doc["stream"]["ops"], "n"),
        ("slot writes (all layers)", writes, "n"),
        ("blocks written (one layer)", blocks_written, "n"),
        ("mean written fill at generation end", _fill(doc), "%"),
        ("block reads", _sum_group(doc, "reads") if acc else None, "n"),
        ("blocks read", _sum_group(doc, "blocks_read") if acc else None, "n"),
        ("working set, median blocks", sum(wss) if wss else None, "n"),
        ("working set, most blocks", sum(wss_max) if wss_max else None, "n"),
        ("utilization of the working set, median", min(util) if len(util) == 1 else
         (float(np.mean(util)) if util else None), "%"),
        ("reads to the hottest 1% of blocks", _hottest(doc, 0.01) if acc else None, "%"),
        ("reads to the hottest 10% of blocks", _hottest(doc, 0.10) if acc else None, "%"),
        ("requests", summary.get("requests"), "n"),
        ("blocks allocated", blocks.get("alloc"), "n"),
        ("prefix hits (blocks)", blocks.get("hit"), "n"),
        ("prefix cache's share of blocks needed", summary.get("prefix_served_share"), "%"),
        ("evictions", blocks.get("evict"), "n"),
        ("preemptions", preempts, "n"),
    ]


WRITE_OPS = {abi.OP_NAMES[i] for i in stream.WRITE_OP_IDS}


def differences(a: dict, b: dict) -> list:
    """[(label, a value, b value, b - a, (b - a) / a or None, kind)] of the
    two documents' headlines, in headlines' order."""
    out = []
    for (label, x, kind), (_, y, _) in zip(headlines(a), headlines(b)):
        diff = None if x is None or y is None else y - x
        rel = diff / x if diff is not None and x else None
        out.append((label, x, y, diff, rel, kind))
    return out


def formatted(value, kind: str, signed: bool = False) -> str:
    """A headline as the terminal and the page print it."""
    if value is None:
        return "-"
    sign = "+" if signed else ""
    if kind == "%":
        return f"{100 * value:{sign}.1f}" + ("pp" if signed else "%")
    if kind == "s":
        return f"{value:{sign}.3g} s"
    return f"{value:{sign},.0f}" if float(value).is_integer() else f"{value:{sign},.1f}"

