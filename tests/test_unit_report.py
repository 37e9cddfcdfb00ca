"""report and export on synthetic traces (no BPF): the heatmap's rendering and
resolution, fixed-width terminals, folded output, and 10 million slot writes."""

import io
import json
import os
import re

import numpy as np
import pytest
from rich.console import Console

from conftest import run_kvtrace
from test_unit_tracefile import BS, write_trace, synthetic_ops
from tracer.analysis import heatmap
from tracer.views import heatmap_text
from tracer.analysis.report import Report, value_counts
from tracer.exporters import report_json


def test_heatmap_cells_and_footer():
    # one write per ms for a second, block = ms % 512
    t = np.arange(1000, dtype=np.int64) * 1_000_000
    b = np.arange(1000) % 512
    h = heatmap.compute(t, b, rows=10, cols=64, time_range=(0, 10**9), block_range=(0, 511))
    assert (h.rows, h.cols, h.blocks_per_col) == (10, 64, 8)
    assert h.ns_per_row == 1e8
    assert h.cells.sum() == 1000
    # row 0 is ms 0-99: blocks 0-99, i.e. columns 0-12 (8 blocks each)
    assert h.cells[0, :12].tolist() == [8] * 12 and h.cells[0, 12] == 4 and h.cells[0, 13:].sum() == 0
    d = h.digits()
    assert d.max() == 9 and d[h.cells == 0].max() == 0 and d[h.cells > 0].min() >= 1
    text = heatmap_text.render(h).plain.splitlines()
    assert text[-3:] == ["# time 0.000-1.000 s, 100 ms per row", "# blocks 0-511, 8 per column",
                         "# 0 none, 1-9 up to 8 slot writes per cell (all layers)"]


def test_heatmap_columns_are_exactly_as_asked_and_ranges_filter():
    t = np.zeros(100, np.int64)
    b = np.arange(100)
    h = heatmap.compute(t, b, rows=1, cols=30, time_range=(0, 1), block_range=(10, 59))
    # 50 blocks in exactly 30 columns: 20 columns of 2 blocks, 10 of 1
    assert h.cols == 30 and h.blocks_per_col == 50 / 30
    assert h.cells.sum() == 50
    spans = [h.col_blocks(c) for c in range(30)]
    assert spans[0] == (10, 10) and spans[-1] == (58, 59)
    assert [lo for lo, _ in spans[1:]] == [hi + 1 for _, hi in spans[:-1]]  # no gap, no overlap
    assert sorted({hi - lo + 1 for lo, hi in spans}) == [1, 2]
    assert h.cells[0].tolist() == [hi - lo + 1 for lo, hi in spans]


def test_heatmap_resol_80_on_81_blocks_gives_80_columns():
    # the case: --resol 10 80 --block-range 0 80 gave 41 columns
    t = np.arange(81, dtype=np.int64)
    h = heatmap.compute(t, np.arange(81), 10, 80, (0, 81), (0, 80))
    assert h.cells.shape == (10, 80) and h.cells.sum() == 81
    assert h.col_blocks(79) == (79, 80)


def test_heatmap_fewer_blocks_than_columns_spans_each_block():
    # 4 blocks over 10 columns: each block over 2 or 3 columns, each showing its count
    t = np.zeros(10, np.int64)
    b = np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    h = heatmap.compute(t, b, 1, 10, (0, 1), (0, 3))
    assert h.cells[0].tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 4, 4]
    assert heatmap_text.per_column(h) == "1 block per 2.5 columns"


def test_heatmap_fits_a_fixed_width_console():
    rng = np.random.default_rng(1)
    t = rng.integers(0, 10**9, 5000)
    b = rng.integers(0, 4096, 5000)
    width = 60
    h = heatmap.compute(t, b, 12, width - heatmap.LABEL_WIDTH, (0, 10**9), (0, 4095))
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(heatmap_text.render(h))
    lines = console.export_text().rstrip("\n").split("\n")
    assert len(lines) == 12 + 3  # one per row and the footer: nothing wrapped
    assert all(len(line) <= width for line in lines)
    assert all(re.fullmatch(r" *\d+\.\d{3} [0-9]{51}", line) for line in lines[:12])
    assert lines[-2] == "# blocks 0-4095, 80.3 per column"  # 4096 / 51, exactly 51 columns


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory):
    """10,002,432 slot writes: 1221 ops of 8192, in four batches."""
    path = tmp_path_factory.mktemp("big") / "big.kvt"
    nops, per_op, blocks = 1221, 8192, 65536
    parts = np.array_split(np.arange(nops), 4)
    batches = [synthetic_ops(len(p), per_op, blocks, t0=10**9 + int(p[0]) * 1000,
                             seq0=int(p[0])) for p in parts]
    write_trace(path, batches, blocks=blocks)
    return path, nops * per_op, blocks


def test_report_json_on_ten_million_slot_writes(big_trace):
    path, nslots, blocks = big_trace
    r = run_kvtrace("report", path, "--format", "json", "--resol", 8, 256, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["stream"]["values"] == nslots and doc["blocks"]["exact"]
    proc = doc["blocks"]["processes"][0]
    tokens = np.zeros(blocks, np.int64)
    for b, n in proc["blocks"]["tokens"]:
        tokens[b] = n
    # slots 0..nslots-1 cycled through blocks * BS slots
    want = np.bincount((np.arange(nslots) % (blocks * BS)) // BS, minlength=blocks)
    assert np.array_equal(tokens, want)
    hm = doc["heatmap"]
    assert (hm["rows"], hm["cols"], hm["blocks_per_col"]) == (8, 256, 256)
    assert (hm["block_lo"], hm["block_hi"], hm["total_blocks"]) == (0, blocks - 1, blocks)
    assert sum(map(sum, hm["writes"])) == nslots
    occ = doc["occupancy"][0]
    assert occ["generations"] == nslots // BS and occ["fill_hist"][BS] == nslots // BS
    assert occ["steps"] == 1221 and occ["max_writes"] == BS


def test_export_by_block_on_ten_million_slot_writes(big_trace):
    path, nslots, blocks = big_trace
    r = run_kvtrace("export", "--folded", path, "--by", "block", "--group", 1024, timeout=300)
    assert r.returncode == 0, r.stderr
    total, n = 0, 0
    for line in r.stdout.splitlines():
        m = re.fullmatch(r"synthetic-4242;reshape_and_cache;layer_00;"
                         r"blocks_(\d{5})-(\d{5});block_(\d{5}) (\d+)", line)
        assert m, line
        lo, hi, b = int(m[1]), int(m[2]), int(m[3])
        assert lo <= b <= hi and hi - lo == 1023 and lo % 1024 == 0
        total += int(m[4])
        n += 1
    assert total == nslots and n == blocks
    # zero-padded: flamegraph.pl's string sort is the cache's order
    assert r.stdout.splitlines() == sorted(r.stdout.splitlines())


def test_report_terminal_fits_its_width(tmp_path):
    path = write_trace(tmp_path / "s.kvt", [synthetic_ops(50, 300, 900)])
    for width in (72, 100):
        r = run_kvtrace("report", path, env={**os.environ, "COLUMNS": str(width)})
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(line) <= width for line in lines), max(lines, key=len)
        assert any("per column" in line for line in lines)
        assert any("occupancy from writes" in line for line in lines)
        # the caveat stands beside the figures it qualifies
        words = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.stdout).split())
        assert "from writes only: frees and held-but-unwritten blocks are not seen" in words


def test_report_csv_tables(tmp_path):
    path = write_trace(tmp_path / "s.kvt", [synthetic_ops(3, 40, 8)])  # 120 slots, 8 blocks
    r = run_kvtrace("report", path, "--format", "csv", "--table", "generations")
    assert r.returncode == 0, r.stderr
    rows = [line.split(",") for line in r.stdout.splitlines()]
    assert rows[0][:4] == ["pid", "layer", "block", "kind"]
    # 120 slots over 8 blocks of 16: blocks 0-6 full, block 7 holds 8
    fills = {int(r[2]): int(r[9]) for r in rows[1:]}
    assert fills == {**{b: 16 for b in range(7)}, 7: 8}
    r = run_kvtrace("report", path, "--format", "csv", "--table", "blocks")
    rows = [line.split(",") for line in r.stdout.splitlines()]
    assert [int(r[2]) for r in rows[1:]] == [16] * 7 + [8]


@pytest.mark.parametrize("args,words", [
    (("--resol", 0, 10), "--resol"), (("--time-range", 2, 1), "--time-range"),
    (("--block-range", 5, 1), "--block-range"), (("--pid", 1),  "no ops of pid 1")])
def test_report_bad_arguments(tmp_path, args, words):
    path = write_trace(tmp_path / "s.kvt", [synthetic_ops(3, 40, 8)])
    r = run_kvtrace("report", path, *args)
    assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr


def heatmap_lines(stdout):
    return [l for l in stdout.splitlines() if re.fullmatch(r" *-?\d+\.\d{3} [0-9]+", l)]


def test_report_heatmap_zooms_to_blocks_written(tmp_path):
    # 12 of 2048 blocks written: the map covers them (padded), one per column
    path = write_trace(tmp_path / "z.kvt", [synthetic_ops(30, 16, 12)], blocks=2048)
    r = run_kvtrace("report", path, env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    assert "# blocks 0-13 of 2048, 1 per column" in r.stdout
    assert "# zoomed to the blocks written (--block-range to choose)" in r.stdout
    rows = heatmap_lines(r.stdout)
    assert len(rows) == 20 and {len(l.split()[1]) for l in rows} == {14}
    # the live-style histogram above it zooms the same way
    assert "blocks 0-13 of 2048 (zoomed to those in use)" in r.stdout
    r = run_kvtrace("report", path, "--format", "json")
    hm = json.loads(r.stdout)["heatmap"]
    assert (hm["block_lo"], hm["block_hi"], hm["cols"], hm["zoomed"]) == (0, 13, 14, True)
    assert sum(map(sum, hm["writes"])) == 30 * 16


def test_report_resol_is_honoured_exactly(tmp_path):
    # the case: --resol 10 80 --block-range 0 80 gave 41 columns
    path = write_trace(tmp_path / "r.kvt", [synthetic_ops(60, 32, 81)], blocks=2048)
    args = ("--resol", 10, 80, "--block-range", 0, 80)
    r = run_kvtrace("report", path, *args, "--format", "json")
    assert r.returncode == 0, r.stderr
    hm = json.loads(r.stdout)["heatmap"]
    assert (hm["rows"], hm["cols"], hm["block_lo"], hm["block_hi"]) == (10, 80, 0, 80)
    assert not hm["zoomed"] and sum(map(sum, hm["writes"])) == 60 * 32
    # the terminal too, even one narrower than the map asked for
    r = run_kvtrace("report", path, *args, env={**os.environ, "COLUMNS": "72"})
    assert r.returncode == 0, r.stderr
    rows = heatmap_lines(r.stdout)
    assert len(rows) == 10 and {len(l.split()[1]) for l in rows} == {80}
    assert "# blocks 0-80 of 2048, 1.01 per column" in r.stdout
    r = run_kvtrace("report", path, *args, "--format", "csv", "--table", "heatmap")
    cells = [line.split(",") for line in r.stdout.splitlines()[1:]]
    assert len(cells) == 800 and cells[79][4:6] == ["79", "80"]


def _trace_with_process(path, process_extra, end_processes=None):
    """One write process whose process document has process_extra."""
    from test_unit_tracefile import CACHE_ID, PID
    from tracer.trace import tracefile
    w = tracefile.TraceWriter(str(path), tracefile.trace_meta({"pid": PID}))
    w.meta("process", {"pid": PID, "comm": "worker", "cmdline": [], "probe_files": [
        {"path": "/x/_C.abi3.so", "build_id": None}], **process_extra})
    w.meta("caches", {"caches": [{"pid": PID, "cache_id": CACHE_ID, "index": 0,
                                  "op": "reshape_and_cache", "block_size": BS,
                                  "num_blocks": 64}]})
    w.batch(synthetic_ops(5, 16, 8))
    agg = {"lost_records": 0, "inexact_reasons": [], "duration_s": 1.0}
    if end_processes is not None:
        agg["processes"] = end_processes
    w.end({"aggregate": agg, "stacks": {}, "records": {}})
    w.close()
    return path, PID


def test_report_keeps_parent_tier_and_probed_ops(tmp_path):
    path, pid = _trace_with_process(tmp_path / "p.kvt", {
        "parent": 77, "tier": "uprobe", "probed_ops": ["reshape_and_cache"]})
    r = run_kvtrace("report", path, "--format", "json")
    assert r.returncode == 0, r.stderr
    proc = json.loads(r.stdout)["blocks"]["processes"][0]
    assert (proc["pid"], proc["parent"], proc["tier"], proc["probed_ops"]) == \
        (pid, 77, "uprobe", ["reshape_and_cache"])
    r = run_kvtrace("report", path, env={**os.environ, "COLUMNS": "120"})
    assert f"pid {pid} (worker), child of 77, stock uprobe: 1 layer" in r.stdout  # panel
    assert f"pid {pid} (worker), child of 77, stock uprobe: _C.abi3.so build-id ?" \
        in r.stdout  # the header
    assert "not probed on this build: reshape_and_cache_flash" in r.stdout


def test_report_of_an_older_trace_takes_parent_and_tier_from_its_end(tmp_path):
    from test_unit_tracefile import PID
    path, pid = _trace_with_process(tmp_path / "o.kvt", {}, end_processes=[
        {"pid": PID, "parent": 12, "tier": "usdt"}])
    r = run_kvtrace("report", path, "--format", "json")
    assert r.returncode == 0, r.stderr
    proc = json.loads(r.stdout)["blocks"]["processes"][0]
    # probed ops unknown: null, and nothing is called "not probed"
    assert (proc["parent"], proc["tier"], proc["probed_ops"]) == (12, "usdt", None)
    assert "not probed" not in run_kvtrace("report", path).stdout


def test_report_json_occupancy_names_its_source(tmp_path):
    path = write_trace(tmp_path / "s.kvt", [synthetic_ops(3, 40, 8)])
    r = run_kvtrace("report", path, "--format", "json")
    (occ,) = json.loads(r.stdout)["occupancy"]
    assert occ["source"] == "writes"
    assert occ["caveat"] == "from writes only: frees and held-but-unwritten blocks are not seen"


def test_heatmap_label_widens_for_long_traces():
    # 12,345 s into a trace: the label is wider than 8 characters, and no
    # digit of the map is cropped for it
    t = np.array([12_345 * 10**9], np.int64)
    h = heatmap.compute(t, np.array([3]), 1, 4, (12_345 * 10**9, 12_346 * 10**9), (0, 3))
    assert heatmap.label_width(h.t0_ns, h.t1_ns) == len("12346.000 ")
    console = Console(width=len("12346.000 ") + 4, file=io.StringIO(), record=True,
                      color_system=None)
    console.print(heatmap_text.render(h))
    assert console.export_text().splitlines()[0] == "12345.000 0009"


def test_heatmap_names_what_it_counts():
    # the same map for another kind of event (reads): its footer and JSON key
    h = heatmap.compute(np.array([0]), np.array([2]), 1, 4, (0, 1), (0, 3),
                        what="block reads (once per step per group)", key="reads")
    assert heatmap_text.render(h).plain.splitlines()[-1] == \
        "# 0 none, 1-9 up to 1 block reads per cell (once per step per group)"
    assert h.to_json()["reads"] == [[0, 0, 1, 0]] and "writes" not in h.to_json()


def test_write_heatmap_holds_every_slot_of_its_range(tmp_path):
    """Report.heatmap counts the slot writes as the generations' runs (a
    run: one op's consecutive slots in one block): every slot of the time
    and block range once, at its op's time."""
    from tracer.trace import tracefile
    nops, per_op, blocks = 40, 30, 200
    path = write_trace(tmp_path / "h.kvt", [synthetic_ops(nops, per_op, blocks)],
                       blocks=blocks)
    rep = Report(tracefile.load(str(path)))
    lo, hi = rep.span_ns()
    mid = (lo + (hi - lo) // 2) / 1e9
    views = {50: [rep.heatmap(5, 16), rep.heatmap(4, 8, time_range=(mid, hi / 1e9)),
                  rep.heatmap(3, 10, block_range=(20, 60))]}
    # every slot once: op i wrote per_op slots at t0 + 1000 i ns
    assert views[50][0].cells.sum() == nops * per_op
    op_t = 1000 * np.arange(nops) + 10**9 - rep.t0
    later = int(np.count_nonzero(op_t >= int(mid * 1e9)))
    assert views[50][1].cells.sum() == later * per_op
    # slots cycle through the blocks in order, BS to a block: 20..60 hold 41 of them
    assert views[50][2].cells.sum() == 41 * BS
    assert views[50][0].zoomed and views[50][0].total_blocks == blocks


@pytest.mark.parametrize("weighted", [False, True])
def test_heatmap_of_events_in_time_order_or_not_equals_a_cell_by_cell_count(weighted):
    """compute_chunks finds a time-ordered chunk's rows by a search of the
    rows' edges, and any other by a row number per event: both equal a
    plain count of every event into its cell, with times on and around the
    rows' edges and the range's ends, blocks outside the block range, and
    row counts that do not divide the range.  block_counts (the zoom's
    counts) too, by a slice or a mask."""
    rng = np.random.default_rng(11)
    for rows, t0, t1, b0, b1 in ((7, 100, 1000, 3, 40), (20, 0, 19, 0, 63), (3, 5, 6, 10, 10)):
        t = np.sort(np.concatenate([rng.integers(t0 - 50, t1 + 50, 400),
                                    [t0 + -(-k * (t1 - t0) // rows) + d
                                     for k in range(rows + 1) for d in (-1, 0, 1)]]))
        b = rng.integers(0, 70, len(t))
        w = rng.integers(1, 5, len(t)) if weighted else None
        want = np.zeros((rows, b1 - b0 + 1), np.int64)
        for i in range(len(t)):
            if t0 <= t[i] < t1 and b0 <= b[i] <= b1:
                want[(t[i] - t0) * rows // (t1 - t0), b[i] - b0] += 1 if w is None else w[i]
        cols = b1 - b0 + 1  # a column per block: the cells are the counts
        shuffled = rng.permutation(len(t))
        for chunks in ([(t, b, w)],  # in order
                       [(t[:150], b[:150], None if w is None else w[:150]),
                        (t[150:], b[150:], None if w is None else w[150:])],
                       [(t[shuffled], b[shuffled], None if w is None else w[shuffled])]):
            got = heatmap.compute_chunks(chunks, rows, cols, (t0, t1), (b0, b1))
            assert got.cells.tolist() == want.tolist()
            # the zoom's count per block: every block up to the highest of
            # any time, those in the range counted
            in_range = (t >= t0) & (t < t1)
            plain = np.bincount(b[in_range], None if w is None else w[in_range],
                                minlength=int(b.max()) + 1).astype(np.int64)
            assert heatmap.block_counts(chunks, (t0, t1)).tolist() == plain.tolist()


def test_write_json_is_json_that_the_standard_library_reads_back():
    """report --format json's writer (orjson): numpy columns written as
    lists, contiguous slices of them too, a NaN as null (json.dumps wrote
    NaN, which no strict reader takes), number keys as strings, one line;
    to a text stream, and as bytes to the CLI's stdout after text written
    first; a full disk behind it is noted as the CLI's stdout's error."""
    from tracer.exporters.report_json import write_json
    from tracer.files import WatchedStdout
    col = np.array([0.5, np.nan, 1e-05, 2.25])
    doc = {"a": np.arange(5, dtype=np.int64)[1:4], "t": col[1:], "n": 7, 3: "x",
           "s": [1.5, None, "é"], "u64": 2**64 - 1}
    want = {"a": [1, 2, 3], "t": [None, 1e-05, 2.25], "n": 7, "3": "x",
            "s": [1.5, None, "é"], "u64": 2**64 - 1}
    for text in (io.StringIO(), WatchedStdout(io.StringIO())):  # a text-only stdout too
        write_json(doc, text)
        assert text.getvalue().endswith("}\n") and text.getvalue().count("\n") == 1
        assert json.loads(text.getvalue(), parse_constant=pytest.fail) == want
    raw = io.BytesIO()
    wrapped = WatchedStdout(io.TextIOWrapper(raw, encoding="utf-8"))
    wrapped.write("first\n")
    write_json(doc, wrapped)
    wrapped.flush()
    head, body = raw.getvalue().decode().split("\n", 1)
    assert head == "first" and json.loads(body, parse_constant=pytest.fail) == want
    # past the file's buffer, so that the write itself meets the full disk
    with open("/dev/full", "w") as full:
        watched = WatchedStdout(full)
        with pytest.raises(OSError) as e:
            write_json({"a": np.arange(1 << 16)}, watched)
        assert watched.error is e.value


def test_write_json_writes_the_bytes_of_one_dumps_in_pieces():
    """write_json writes the document a piece at a time (the members of its
    dicts, two levels deep; a long list's items 64 at a time) and in writes
    of a MiB or more: the bytes are one orjson.dumps of the whole, for lists
    of every length around a piece's, nested dicts, number keys, numpy
    columns, fragments made before, NaN and text that is not ASCII."""
    import orjson
    from tracer.files import WatchedStdout
    opts = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    rng = np.random.default_rng(3)
    for n in (0, 1, 63, 64, 65, 128, 129, 6000):
        doc = {"schema": "x", "empty": {}, "none": [], "mixed": {7: "seven", "a": 1},
               "part": orjson.Fragment(orjson.dumps({"a": [1, 2]})),
               "lifecycle": {"summary": {"é": 1.5, 3: float("nan")},
                             "requests": [{"req": f"{i:x}", "t": [i / 7, None],
                                           "access": orjson.Fragment(orjson.dumps(
                                               {"b": rng.integers(0, 9, (i % 5) * 40)},
                                               option=opts))}
                                          for i in range(n)],
                             "col": rng.random(n)}}
        want = orjson.dumps(doc, option=opts | orjson.OPT_APPEND_NEWLINE)
        assert b"".join(report_json._json_pieces(doc)) + b"\n" == want, n
        raw = io.BytesIO()
        wrapped = WatchedStdout(io.TextIOWrapper(raw, encoding="utf-8"))
        writes = []
        real = wrapped.write_bytes
        wrapped.write_bytes = lambda data: (writes.append(len(data)), real(data))[1]
        report_json.write_json(doc, wrapped)
        wrapped.flush()
        assert raw.getvalue() == want, n
        # every write but the last a MiB or more
        assert all(k >= report_json._JSON_WRITE_BYTES for k in writes[:-1]), writes
    assert len(writes) > 1  # the 6000 requests took several


def layers_trace(path):
    """Three layers (caches 10, 11, 12 of one process): 11 writes what 10
    writes, 12 other slots in ops of the same sizes."""
    return write_trace(path, [synthetic_ops(20, 8, 30, seq0=0, cache_id=10, slot0=0),
                              synthetic_ops(20, 8, 30, seq0=20, cache_id=11, slot0=0),
                              synthetic_ops(20, 8, 30, seq0=40, cache_id=12, slot0=5)],
                       blocks=30, cache_ids=(10, 11, 12))


@pytest.mark.parametrize("timelines", [None, 3])
def test_report_generations_on_either_side_are_by_caches(tmp_path, monkeypatch, timelines):
    """Report computes each distinct cache's generations on the side with
    time to spare: every layer's on the main side where every request's
    figures are asked (JSON), and beside for the layers no read scan needs
    where few are (text).  Either way, each layer's equal those of
    occupancy.by_cache, in its order."""
    import threading
    from tracer.analysis import occupancy
    from tracer.trace import tracefile
    trace = tracefile.load(str(layers_trace(tmp_path / "l.kvt")))
    want = occupancy.by_cache(trace.ops, trace.block_sizes())
    where, computed = {}, occupancy.computed

    def tell(caches):
        (pid, cache_id), *_ = caches[0]  # the one computed
        where[cache_id] = threading.current_thread() is threading.main_thread()
        return computed(caches)
    monkeypatch.setattr(occupancy, "computed", tell)
    got = Report(trace, timelines=timelines).gens
    assert list(got) == list(want) == [(4242, 10), (4242, 11), (4242, 12)]
    for key, g in want.items():
        for f in ("block", "kind", "fill", "start_step", "last_step", "start_ns", "last_ns",
                  "writes", "run_ns"):
            assert np.array_equal(getattr(got[key], f), getattr(g, f)), (key, f)
    # 10 and 11 are one computation, with the first layer's; 12 its own
    assert sorted(where) == [10, 12]
    assert where == {10: True, 12: timelines is None}


@pytest.mark.parametrize("where", ["rows_of", "events", "generations"])
def test_report_raises_what_its_second_thread_raised(tmp_path, monkeypatch, where):
    """Report computes the rows, a text report's generations of the layers
    no read scan needs, and the plugin tier's figures on a thread beside
    the main one: an error there (damage found late, a bug) must reach the
    caller as itself, not leave the report waiting for what never comes."""
    import threading
    from tracer.analysis import access_stream, lifecycle, occupancy
    from tracer.trace import tracefile
    path = write_trace(tmp_path / "t.kvt", [synthetic_ops(10, 4, 20)], blocks=20) \
        if where != "generations" else layers_trace(tmp_path / "t.kvt")
    trace = tracefile.load(str(path))
    builder = []  # the thread that builds the report: its main side

    def fail(*_):
        raise ValueError(f"{where} failed")
    if where == "rows_of":
        monkeypatch.setattr(access_stream, "steps_of", lambda ops, groups: [None])  # one group
        monkeypatch.setattr(access_stream, "rows_of", fail)
    elif where == "events":
        monkeypatch.setattr(lifecycle, "events", fail)
    else:
        computed = occupancy.computed
        monkeypatch.setattr(occupancy, "computed", lambda caches: computed(caches)
                            if threading.current_thread() in builder else fail())
    raised = []

    def build():
        builder.append(threading.current_thread())
        try:
            Report(trace, timelines=3)
        except ValueError as e:
            raised.append(str(e))
    t = threading.Thread(target=build, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "Report hung"
    assert raised == [f"{where} failed"]


def test_report_pauses_the_cycle_collector_and_restores_it(tmp_path, monkeypatch):
    """The report runs with the cyclic collector paused (its full passes
    over the JSON document's objects found nothing), and it is on again
    after, whether the report ended well or not: a test process runs many."""
    import contextlib
    import gc
    from tracer import cli
    from tracer.commands import report as cmd_report
    path = write_trace(tmp_path / "t.kvt", [synthetic_ops(10, 4, 20)], blocks=20)
    seen = []
    real = cmd_report.write_json
    monkeypatch.setattr(cmd_report, "write_json",
                        lambda doc, out: (seen.append(gc.isenabled()), real(doc, out)))
    assert gc.isenabled()
    for argv, code in ((["report", str(path), "--format", "json"], 0),
                       (["report", str(tmp_path / "missing.kvt"), "--format", "json"], 4)):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(argv) == code
        assert gc.isenabled(), argv
    assert seen == [False]


def test_value_counts_in_value_order_any_integers():
    """_value_counts counts small non-negative steps by a bincount and
    anything else by np.unique: both give every value once, in order, with
    its count (the test's own Counter)."""
    from collections import Counter
    rng = np.random.default_rng(5)
    for a in (rng.integers(0, 50, 1000), rng.integers(-3, 50, 1000),
              rng.integers(0, 1 << 40, 50), np.zeros(0, np.int64), np.array([7])):
        assert value_counts(a) == sorted([v, n] for v, n in Counter(a.tolist()).items())


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(
    os.path.join(os.path.dirname(__file__), "data")) if n.endswith(".kvt")))
def test_every_recording_kept_here_holds_its_invariants(name):
    """The recordings the suite keeps (real kvsim and real CPU vLLM) pass
    `report --check` as a user's would: one that an older tracer made with a
    fault the invariants name (its root process called "kvtrace-bpf") fails
    here until it is recorded again."""
    r = run_kvtrace("report", os.path.join(os.path.dirname(__file__), "data", name), "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and r.stdout.count("ok ") >= 3, r.stdout
