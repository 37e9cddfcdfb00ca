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
from tracer import heatmap


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
    text = heatmap.render(h).plain.splitlines()
    assert text[-3:] == ["# time 0.000-1.000 s, 100 ms per row", "# blocks 0-511, 8 per column",
                         "# 0 no writes, 1-9 up to 8 slot writes per cell"]


def test_heatmap_blocks_per_column_is_whole_and_ranges_filter():
    t = np.zeros(100, np.int64)
    b = np.arange(100)
    h = heatmap.compute(t, b, rows=1, cols=30, time_range=(0, 1), block_range=(10, 59))
    # 50 blocks in at most 30 columns: 2 per column, 25 columns
    assert (h.cols, h.blocks_per_col) == (25, 2)
    assert h.cells.sum() == 50


def test_heatmap_fits_a_fixed_width_console():
    rng = np.random.default_rng(1)
    t = rng.integers(0, 10**9, 5000)
    b = rng.integers(0, 4096, 5000)
    width = 60
    h = heatmap.compute(t, b, 12, width - heatmap.LABEL_WIDTH, (0, 10**9), (0, 4095))
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(heatmap.render(h))
    lines = console.export_text().rstrip("\n").split("\n")
    assert len(lines) == 12 + 3  # one per row and the footer: nothing wrapped
    assert all(len(line) <= width for line in lines)
    assert all(re.fullmatch(r" *\d+\.\d{3} [0-9]{51}", line) for line in lines[:12])
    assert lines[-2] == "# blocks 0-4095, 81 per column"  # ceil(4096 / 51)


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
        m = re.fullmatch(r"reshape_and_cache;layer_00;blocks_(\d+)-(\d+);block_(\d+) (\d+)", line)
        assert m, line
        lo, hi, b = int(m[1]), int(m[2]), int(m[3])
        assert lo <= b <= hi and hi - lo == 1023 and lo % 1024 == 0
        total += int(m[4])
        n += 1
    assert total == nslots and n == blocks


def test_report_terminal_fits_its_width(tmp_path):
    path = write_trace(tmp_path / "s.kvt", [synthetic_ops(50, 300, 900)])
    for width in (72, 100):
        r = run_kvtrace("report", path, env={**os.environ, "COLUMNS": str(width)})
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(line) <= width for line in lines), max(lines, key=len)
        assert any("per column" in line for line in lines)
        assert any("true occupancy" in line for line in lines)


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
