"""The report's tables as CSV (`report --format csv --table ...`)."""

import csv

import numpy as np

from ..analysis import heatmap, occupancy
from ..analysis.report import Report


def write_csv(rep: Report, table: str, hm: heatmap.Heatmap, out):
    w = csv.writer(out, lineterminator="\n")
    if table == "blocks":
        w.writerow(["pid", "block", "tokens", "all_layer_writes", "copy_src", "copy_dst",
                    "swap_out", "swap_in"])
        for p in sorted(rep.agg.processes.values(), key=lambda p: p.pid):
            n = p.num_blocks
            cols = [p.tokens, p.all_layer_writes] + [p.moves.get(k, np.zeros(0)) for k in
                                                     ("copy_src", "copy_dst", "swap_out", "swap_in")]
            cols = [np.pad(c.astype(np.int64), (0, n - len(c))) for c in cols]
            m = np.stack(cols, axis=1)
            nz = np.flatnonzero(m.any(axis=1))
            w.writerows([[p.pid, int(b), *m[b].tolist()] for b in nz])
    elif table == "generations":
        w.writerow(["pid", "layer", "block", "kind", "start_step", "last_step", "start_ns",
                    "last_ns", "inherited", "fill", "writes", "reuse_steps"])
        for key, g in sorted(rep.gens.items()):
            cols = np.stack([g.block, g.start_step, g.last_step, g.start_ns - rep.t0,
                             g.last_ns - rep.t0, g.inherited, g.fill, g.writes,
                             g.reuse_steps], axis=1).tolist()
            kinds = [occupancy.KINDS[k] for k in g.kind]
            w.writerows([[key[0], rep.layers[key], r[0], k, *r[1:]]
                         for r, k in zip(cols, kinds)])
    elif table == "fragmentation":
        w.writerow(["pid", "layer", "step", "active_blocks", "active_tokens", "fragmentation"])
        for key, g in sorted(rep.gens.items()):
            frag = g.fragmentation
            w.writerows([[key[0], rep.layers[key], k, int(b), int(t),
                          "" if np.isnan(f) else f"{f:.6f}"]
                         for k, (b, t, f) in enumerate(zip(g.active_blocks, g.active_tokens, frag))])
    elif table == "access":
        w.writerow(["pid", "group", "block", "reads", "last_read_s", "max_sharing"])
        for st, scan in zip(rep.steps, rep.scans):
            proc = rep.agg.processes[st.pid]
            g = next(g for g in proc.groups if g.group_id == st.group_id)
            last, share = scan.last_read_ns, scan.sharing
            for b in np.flatnonzero(g.reads_per_block):
                w.writerow([st.pid, g.group, int(b), int(g.reads_per_block[b]),
                            f"{(int(last[b]) - rep.t0) / 1e9:.6f}", int(share[b])])
    elif table == "wss":
        w.writerow(["pid", "group", "step", "t_s", "requests", "reads", "working_set",
                    "tokens", "held_tokens", "utilization"])
        for n, st in enumerate(rep.steps):
            util = st.utilization
            for i in range(len(st)):
                w.writerow([st.pid, n, i, f"{(st.ts_ns[i] - rep.t0) / 1e9:.6f}",
                            int(st.rows[i]), int(st.reads[i]), int(st.distinct[i]),
                            int(st.tokens[i]), int(st.held_tokens[i]),
                            "" if np.isnan(util[i]) else f"{util[i]:.6f}"])
    elif table == "heatmap":
        w.writerow(["row", "col", "t_start_s", "t_end_s", "block_lo", "block_hi", hm.key])
        for r in range(hm.rows):
            ts = (hm.t0_ns + r * hm.ns_per_row) / 1e9
            for c in range(hm.cols):
                lo, hi = hm.col_blocks(c)
                w.writerow([r, c, f"{ts:.6f}", f"{ts + hm.ns_per_row / 1e9:.6f}", lo, hi,
                            int(hm.cells[r, c])])
