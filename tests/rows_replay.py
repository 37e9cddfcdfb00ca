"""Rows kept from step_rows' deltas, for the tests: a small pure replay of
an OpStream's step_rows and block_free ops, in their order (bpf/
kvtrace_probes.h, "step_rows").  Each row starts from the row last kept
for its request and group, cut at tail_from, then gains its tail; a
block_free nulls the freed blocks in its request's kept rows (a sliding
window's, a preemption's).  Deliberately naive (a list per row, a loop per
event), so that it shares nothing with the tracer's own derivation."""

from tracer import abi
from tracer.trace import stream

FREE = abi.OPS["block_free"]


def replay(ops: stream.OpStream):
    """[(pid, group, [(req, seq_len, new_tokens, row_len, row)]) per step_rows
    op, in order].  Raises AssertionError where the deltas do not add up:
    an op not complete, a tail_from beyond the row kept, a row whose length
    is not row_len."""
    sr = stream.step_rows(ops)
    at = {int(p): k for k, p in enumerate(sr.pos)}
    o = ops.ops
    kept = {}  # (pid, group) -> {req: [block ids]}
    out = []
    for i in sorted(set(at) | set(map(int, (o["op"] == FREE).nonzero()[0]))):
        if i not in at:  # a block_free
            assert o["complete"][i], f"block_free op {i} incomplete"
            row = kept.get((int(o["pid"][i]), int(o["cache_index"][i])), {}).get(
                int(o["cache_id"][i]))
            if row:
                freed = set(ops.values_of(i)[:int(o["items"][i])].tolist())
                row[:] = [0 if b in freed else b for b in row]
            continue
        k = at[i]
        assert sr.complete[k], f"step_rows op {i} incomplete"
        rows = kept.setdefault((int(sr.pid[k]), int(sr.group[k])), {})
        got = []
        for r in range(int(sr.lo[k]), int(sr.lo[k + 1])):
            req, tf, n = int(sr.req[r]), int(sr.tail_from[r]), int(sr.row_len[r])
            cur = rows.get(req, []) if tf else []
            assert tf <= len(cur), (i, req, tf, len(cur))
            row = cur[:tf] + sr.tail[sr.tail_lo[r]:sr.tail_lo[r + 1]].tolist()
            assert len(row) == n, (i, req, len(row), n)
            rows[req] = row
            got.append((req, int(sr.seq_len[r]), int(sr.new_tokens[r]), n, list(row)))
        out.append((int(sr.pid[k]), int(sr.group[k]), got))
    return out
