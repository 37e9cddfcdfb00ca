"""Let go of a process that exited, and hand its rows back (the agent).

attach and record trace one tree for one run: a row of the counter arrays,
once given to a process or a cache, stays its own.  The agent traces every
engine on a node for weeks, while engines start and exit: each exit has to
give back everything it took, or the arrays run out of rows and the hashes
fill.  forget() does that once the process is gone and its series were
served for the grace period: it closes its uprobes (the kernel keeps a
link open on a dead process until its fd is closed), deletes its entries
from every hash the program keys by pid, zeroes its rows of the counter
arrays and gives them back: process indices and `sites` rows to the
Tracer, cache and group rows to the program's free queues (a program built
with reuse_rows: bpf/kvtrace.bpf.c TAKE_ROW), which it takes before a new
row.  Rows are zeroed before they are given back: the next owner starts
at 0, and no hit of the dead process can come to add to them.
"""

import ctypes
import mmap

import numpy as np

from .. import abi


def _zero_row(tracer, name: str, rows: int, row: int):
    """Zero one row of an mmapable array map of `rows` rows, through a
    writable mmap of that row's pages only, closed at once.  Not the whole
    map: an mmap of it puts every page of it in the agent's RSS at once
    (all of block_writes, block_moves, block_life, block_reads and
    block_fill: hundreds of MiB at the defaults, docs/design.md), which
    the read-only RowMap views exist to avoid."""
    table = tracer.bpf[name]
    per = table.max_entries * ctypes.sizeof(table.Leaf) // rows
    start = row * per
    first = start - start % mmap.PAGESIZE  # an mmap's offset is in whole pages
    m = mmap.mmap(table.map_fd, start + per - first, mmap.MAP_SHARED,
                  mmap.PROT_READ | mmap.PROT_WRITE, offset=first)
    try:
        view = np.frombuffer(m, dtype=np.uint8, count=per, offset=start - first)
        view[:] = 0
        del view  # an mmap with a live view cannot close
    finally:
        m.close()


def forget(tracer, pid: int):
    """Remove pid from the traced set and give back its rows.  Only for a
    process that exited: a live one's probes would add to rows given away."""
    proc = tracer.procs.get(pid)
    if proc is None:
        return
    for up in proc.uprobes:
        up.close()
    proc.uprobes.clear()
    proc.attached.clear()
    reuse = tracer.reuse_rows
    bpf = tracer.bpf
    # caches and groups: rows in the arrays, then their entries, then the rows back
    freed = {"free_caches": [], "free_groups": []}
    caches = bpf["caches"]
    for k, v in list(caches.items()):
        if k.pid != pid:
            continue
        idx = v.index
        if idx < tracer.max_caches:
            _zero_row(tracer, "block_writes", tracer.max_caches, idx)
            if tracer.fill is not None:
                _zero_row(tracer, "block_fill", tracer.max_caches, idx)
        if idx < abi.CACHE_ENTRIES:
            _zero_row(tracer, "cache_stats", abi.CACHE_ENTRIES, idx)
        del caches[k]
        if idx < tracer.max_caches:
            freed["free_caches"].append(idx)
    groups = bpf["groups"]
    for k, v in list(groups.items()):
        if k.pid != pid:
            continue
        idx = v.index
        del groups[k]
        if idx < tracer.max_groups:
            _zero_row(tracer, "block_reads", tracer.max_groups + 1, idx)
            freed["free_groups"].append(idx)
    if reuse:
        for name, rows in freed.items():
            _give_back(bpf[name], rows)
    requests = bpf["requests"]
    for k in [k for k in requests.keys() if k.pid == pid]:
        try:
            del requests[k]
        except KeyError:  # an LRU map may have dropped it meanwhile
            pass
    # sites: their rows back to the Tracer (attach() empties a row's memo
    # before it uses it again)
    site_index = None if tracer.use_links else bpf["site_index"]
    for key in [key for key in tracer.site_rows if key[0] == pid]:
        row = tracer.site_rows.pop(key)
        if site_index is not None:
            k = site_index.Key()
            k.pid, k.ip = key
            try:
                del site_index[k]
            except KeyError:
                pass
        tracer.free_site_rows.append(row)
    # the process's own rows, then its index back (track() takes the lowest free)
    _zero_row(tracer, "op_stats", tracer.max_procs, proc.index)
    _zero_row(tracer, "block_moves", tracer.max_procs, proc.index)
    _zero_row(tracer, "block_life", tracer.max_procs, proc.index)
    _zero_row(tracer, "life_pages", tracer.max_procs, proc.index)
    try:
        del bpf["traced_pids"][bpf["traced_pids"].Key(pid)]
    except KeyError:
        pass
    del tracer.procs[pid]


def _give_back(queue, rows: list):
    """Put rows in the program's free queue, the queue kept in ascending
    order: a process's caches take rows in the order it first wrote them,
    and aggregate.py numbers a process's layers by their rows' order.  The
    rows waiting are taken out and put back with the new ones, sorted (a
    row the program takes meanwhile is simply not among them)."""
    waiting = []
    while True:
        try:
            waiting.append(queue.pop().value)
        except KeyError:
            break
    for row in sorted(set(waiting) | set(rows)):
        queue.push(ctypes.c_uint32(row))


def hash_entries(tracer) -> dict:
    """Entries in each hash the program keys by pid: what forget() empties
    (the agent's memory test compares them after many starts and exits)."""
    names = ["traced_pids", "caches", "groups", "requests"]
    if not tracer.use_links:
        names.append("site_index")
    out = {name: len(list(tracer.bpf[name].keys())) for name in names}
    out["site_rows"] = len(tracer.site_rows)
    out["procs"] = len(tracer.procs)
    return out
