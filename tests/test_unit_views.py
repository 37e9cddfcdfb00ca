"""Unit tests of the outputs that need no BPF: folded stacks (export.py) and
the rich live view (live.py), fed with hand-built data."""

import io
import re

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from tracer import live
from tracer.aggregate import Aggregate, Layer, Process
from tracer.export import folded_lines

# -- folded stacks -----------------------------------------------------------

# flamegraph.pl's stackcollapse input: "frame;frame;... COUNT"
FOLDED = re.compile(r"^(.*)\s+(\d+)$")

FRAMES = {
    1: ["main", "step", "reshape"],
    2: ["main", "a;b", "x\ny"],       # separators inside names
    3: ["main", "", "   "],           # unnamed frames
}


def fold(stacks, layers=None):
    layers = layers or {(100, 0): 0, (100, 1): 1, (100, 12): 12}
    return folded_lines(stacks,
                        lambda sid, pid: FRAMES.get(sid, []),
                        lambda pid: {100: "vllm", 200: "my;proc"}.get(pid, ""),
                        lambda pid, idx: layers.get((pid, idx)))


def check_grammar(lines):
    for line in lines:
        m = FOLDED.match(line)
        assert m, line
        stack = m.group(1)
        assert "\n" not in line and "" not in stack.split(";"), line
        assert int(m.group(2)) > 0


def test_identical_stacks_merged_and_zero_skipped():
    lines = fold([(100, 1, "reshape_and_cache", 0, 5),
                  (100, 1, "reshape_and_cache", 0, 7),
                  (100, 1, "reshape_and_cache", 1, 3),
                  (100, 1, "copy_blocks", 0, 0)])     # weight 0: no line
    assert lines == ["vllm;main;step;reshape;reshape_and_cache;layer_00 12",
                     "vllm;main;step;reshape;reshape_and_cache;layer_01 3"]
    check_grammar(lines)


def test_frame_names_cleaned():
    lines = fold([(100, 2, "copy_blocks", 12, 1), (100, 3, "copy_blocks", 12, 2),
                  (200, 1, "swap_blocks", 0, 4)])
    assert lines == ["my:proc;main;step;reshape;swap_blocks;all_layers 4",
                     "vllm;main;[unknown];[unknown];copy_blocks;layer_12 2",
                     "vllm;main;a:b;x:y;copy_blocks;layer_12 1"]
    check_grammar(lines)


def test_no_stack_and_unknown_layer():
    # stack id -1: the kernel could not take the stack; cache index 999: no layer
    lines = fold([(100, -1, "swap_blocks_batch", 999, 6), (300, -1, "copy_blocks", 0, 1)])
    assert lines == ["[unknown];[no stack];copy_blocks;all_layers 1",
                     "vllm;[no stack];swap_blocks_batch;all_layers 6"]
    check_grammar(lines)


def test_no_stacks_no_lines():
    assert fold([]) == []


# -- live view -------------------------------------------------------------------

def layer(pid, n, writes, num_blocks):
    return Layer(pid, n, 0x1000 + n, n, "reshape_and_cache", 16, num_blocks, 10, 100, 1, 0,
                 np.array(writes, dtype=np.uint64))


def process(pid, nblocks=300):
    rng = np.random.default_rng(pid)
    w0 = rng.integers(0, 5000, nblocks).astype(np.uint64)
    w1 = rng.integers(0, 5000, nblocks).astype(np.uint64)
    moves = {k: rng.integers(0, 3, nblocks).astype(np.uint64)
             for k in ("copy_src", "copy_dst", "swap_out", "swap_in")}
    ops = {"reshape_and_cache": dict(calls=123456789, items=987654321, slots=987654000,
                                     padding=321, bytes=0, truncated=0, read_errors=0,
                                     out_of_range=0),
           "swap_blocks": dict(calls=5, items=40, slots=0, padding=0, bytes=3 * 2**30,
                               truncated=0, read_errors=0, out_of_range=0)}
    return Process(pid, "VLLM::EngineCore_with_a_long_name",
                   [layer(pid, 0, w0, nblocks), layer(pid, 1, w1, nblocks)], ops, moves)


class FakeAggregate(Aggregate):
    """An Aggregate whose honesty verdict is set by the test."""

    def __init__(self, processes, reasons=(), log2=None, lost=0):
        super().__init__(time=5.0, processes=processes, log2=log2 or {}, globals={},
                         records=4242, lost=lost)
        self._reasons = list(reasons)

    def inexact_reasons(self):
        return self._reasons


def render_text(agg, width, prev=None):
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(live.render(agg, prev, title="kvtrace-bpf  pid 7 (vllm)", elapsed=3.25,
                              width=width))
    return console.file.getvalue()


def flat(text):
    return " ".join(text.split())  # rich may wrap long lines at spaces


WIDTHS = (80, 120)


@pytest.mark.parametrize("width", WIDTHS)
def test_render_fits_width_and_says_exact(width):
    agg = FakeAggregate({7: process(7), 9: process(9, 40000)},
                        log2={"reshape_and_cache": {3: 10, 9: 2}, "swap_blocks": {4: 5}})
    text = render_text(agg, width)
    lines = text.splitlines()
    assert len(lines) > 20
    assert max(cell_len(l) for l in lines) <= width
    assert "counts: exact" in flat(text) and "NOT exact" not in text
    # each histogram is 6 bar rows and an axis, none wrapped by the panel
    heads = [i for i, l in enumerate(lines) if "tokens written per block" in l]
    feet = [i for i, l in enumerate(lines) if "per column, max column" in l]
    assert len(heads) == 2 and [f - h for h, f in zip(heads, feet)] == [8, 8]
    for expected in ("pid 7 (VLLM::EngineCore_with_a_long_name)", "pid 9 (", "40000 blocks",
                     "reshape_and_cache", "swap_blocks",
                     "246,913,578", "6.0G",  # two processes' totals, whole
                     "records 4,242", "lost 0", "items per op (log2)"):
        assert expected in flat(text), expected


@pytest.mark.parametrize("width", WIDTHS)
def test_render_not_exact_shows_reasons(width):
    agg = FakeAggregate({7: process(7)}, lost=17,
                        reasons=["11 fake reasons for a test", "2 more of them"])
    text = flat(render_text(agg, width))
    assert "NOT exact: 11 fake reasons for a test; 2 more of them" in text
    assert "lost 17" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_render_empty(width):
    text = render_text(FakeAggregate({}), width)
    assert "(no ops yet)" in text and "counts: exact" in flat(text)
    assert max(cell_len(l) for l in text.splitlines()) <= width


def test_render_process_without_writes():
    p = Process(3, "idle")
    text = render_text(FakeAggregate({3: p}), 80)
    assert "pid 3 (idle): 0 layers, 0 blocks" in flat(text)
    assert "(nothing written yet)" in text


def test_rates_shown_against_previous():
    before, now = FakeAggregate({7: process(7)}), FakeAggregate({7: process(7)})
    before.time = 3.0  # 2 s earlier, 4 calls and 30 items fewer
    before.processes[7].ops["swap_blocks"] = dict(before.processes[7].ops["swap_blocks"],
                                                  calls=5 - 4, items=40 - 30)
    text = render_text(now, 120, prev=before)
    row = next(l for l in text.splitlines() if l.strip().startswith("swap_blocks"))
    # op, calls, calls/s (4 more calls in 2 s)
    assert row.split()[:3] == ["swap_blocks", "5", "2"]


def test_histogram_text():
    text = live.histogram(np.array([8, 4, 0, 1], dtype=np.uint64), width=4).plain
    # 6 rows of 8 eighths each; top = 8: heights 48, 24, 0, 6 eighths
    assert text.split("\n") == [
        "     8 █   ",
        "       █   ",
        "       █   ",
        "       ██  ",
        "       ██  ",
        "       ██ ▆",
        "       0  3",
        "       1 block per column, max column 8",
    ]


def test_histogram_buckets_blocks():
    # 10 blocks in at most 4 columns: 3 blocks per column, sums 3, 0, 0, 9
    text = live.histogram(np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 9], dtype=np.uint64),
                          width=4).plain
    assert "3 blocks per column, max column 9" in text
    assert text.split("\n")[0] == "     9    █"
    # first column: ceil(3/9 * 48) = 16 eighths, the two bottom rows
    assert text.split("\n")[3:6] == ["          █", "       █  █", "       █  █"]


def test_histogram_empty():
    assert live.histogram(np.zeros(5, dtype=np.uint64), 40).plain == "(nothing written yet)"
    assert live.histogram(np.zeros(0, dtype=np.uint64), 40).plain == "(nothing written yet)"


def test_log2_table_ranges():
    # bpf_log2l(v) = floor(log2 v) + 1: slot 1 holds 0..1, slot 4 holds 8..15
    agg = FakeAggregate({}, log2={"copy_blocks": {1: 3, 4: 2}})
    text = render_text(agg, 120)
    assert "0 -> 1" in text and "8 -> 15" in text
