"""Unit tests of the outputs that need no BPF: folded stacks (folded.py) and
the rich live view (panels.py), fed with hand-built data."""

import io
import os
import re

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from conftest import run_kvtrace
from tracer import abi
from tracer.analysis import heatmap
from tracer.analysis.report import Report
from tracer.trace import tracefile
from tracer.views import panels
from tracer.analysis.aggregate import Aggregate, Layer, Process, ReadGroup
from tracer.exporters import folded
from tracer.exporters.folded import folded_lines

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
    assert lines == ["vllm-100;main;step;reshape;reshape_and_cache;layer_00 12",
                     "vllm-100;main;step;reshape;reshape_and_cache;layer_01 3"]
    check_grammar(lines)


def test_frame_names_cleaned():
    lines = fold([(100, 2, "copy_blocks", 12, 1), (100, 3, "copy_blocks", 12, 2),
                  (200, 1, "swap_blocks", 0, 4)])
    assert lines == ["my:proc-200;main;step;reshape;swap_blocks;all_layers 4",
                     "vllm-100;main;[unknown];[unknown];copy_blocks;layer_12 2",
                     "vllm-100;main;a:b;x:y;copy_blocks;layer_12 1"]
    check_grammar(lines)


def test_no_stack_and_unknown_layer():
    # stack id -1: no stack was taken; cache index 999: no layer
    lines = fold([(100, -1, "swap_blocks_batch", 999, 6), (300, -1, "copy_blocks", 0, 1)])
    assert lines == ["[unknown]-300;[no stack: not taken];copy_blocks;all_layers 1",
                     "vllm-100;[no stack: not taken];swap_blocks_batch;all_layers 6"]
    check_grammar(lines)


def test_no_stack_says_why_and_each_reason_weighs_apart():
    """A stack without frames is one frame that names why, from the id the
    op record holds (bpf/kvtrace.bpf.c stack_id_of): the kernel could not
    walk it (-EFAULT), both stack maps were full (-E2BIG), another error,
    or an id whose frames the trace does not hold (99: not in FRAMES)."""
    import errno
    lines = fold([(100, -errno.EFAULT, "copy_blocks", 0, 2),
                  (100, -errno.E2BIG, "copy_blocks", 0, 3),
                  (100, -errno.E2BIG, "copy_blocks", 0, 4),
                  (100, -errno.ENOENT, "copy_blocks", 0, 5),
                  (100, 99, "copy_blocks", 0, 7),
                  (100, 1, "copy_blocks", 0, 11)])
    assert lines == ["vllm-100;[no stack: error 2];copy_blocks;layer_00 5",
                     "vllm-100;[no stack: frames not kept];copy_blocks;layer_00 7",
                     "vllm-100;[no stack: maps full];copy_blocks;layer_00 7",
                     "vllm-100;[no stack: unreadable];copy_blocks;layer_00 2",
                     "vllm-100;main;step;reshape;copy_blocks;layer_00 11"]
    check_grammar(lines)


def test_no_stacks_no_lines():
    assert fold([]) == []


def test_layers_zero_padded_to_the_widest():
    # 100 layers: layer_005 sorts before layer_100 in flamegraph.pl's string order
    lines = fold([(100, 1, "reshape_and_cache", 5, 1), (100, 1, "reshape_and_cache", 100, 1)],
                 layers={(100, 5): 5, (100, 100): 100})
    assert [l.split(";")[-1] for l in lines] == ["layer_005 1", "layer_100 1"]
    assert lines == sorted(lines)


def test_block_lines_hierarchy_and_padding():
    rows = [("vllm-9", "reshape_and_cache", 0, 5, 3), ("vllm-9", "reshape_and_cache", 0, 12, 4),
            ("vllm-9", "reshape_and_cache", 0, 130, 1), ("vllm-9", "copy_blocks", 1, 7, 2),
            ("vllm-9", "reshape_and_cache", 1, 5, 0)]  # weight 0: no line
    lines = folded.block_lines(rows, group=64)
    assert lines == [
        "vllm-9;copy_blocks;layer_01;blocks_000-063;block_007 2",
        "vllm-9;reshape_and_cache;layer_00;blocks_000-063;block_005 3",
        "vllm-9;reshape_and_cache;layer_00;blocks_000-063;block_012 4",
        "vllm-9;reshape_and_cache;layer_00;blocks_128-191;block_130 1"]
    # flamegraph.pl sorts lines as strings: that order is the cache's order
    assert lines == sorted(lines)
    check_grammar(lines)
    assert folded.block_lines([], 64) == []


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

    def __init__(self, processes, reasons=(), log2=None, lost=0, records=4242):
        super().__init__(time=5.0, processes=processes, log2=log2 or {}, globals={},
                         records=records, lost=lost)
        self._reasons = list(reasons)

    def inexact_reasons(self):
        return self._reasons


def render_text(agg, width, prev=None):
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(panels.render(agg, prev, title="kvtrace-bpf  pid 7 (vllm)", elapsed=3.25,
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
    # what "exact" promises is said once something was traced
    assert "exact: the per-block counters hold every slot of every probe hit" in flat(text)
    # each histogram is 6 bar rows, an axis, the range line and the height
    # line, none wrapped by the panel
    heads = [i for i, l in enumerate(lines) if "tokens written per block" in l]
    feet = [i for i, l in enumerate(lines) if "height: tokens summed over" in l]
    assert len(heads) == 2 and [f - h for h, f in zip(heads, feet)] == [9, 9]
    for expected in ("pid 7 (VLLM::EngineCore_with_a_long_name)", "pid 9 (", "40000 blocks",
                     "reshape_and_cache", "swap_blocks",
                     "246,913,578", "6.0G",  # two processes' totals, whole
                     "records 4,242", "lost 0", "items per op (log2)",
                     "blocks 0-299 of 300", "blocks 0-39999 of 40000"):
        assert expected in flat(text), expected


@pytest.mark.parametrize("width", WIDTHS)
def test_render_not_exact_shows_reasons(width):
    agg = FakeAggregate({7: process(7)}, lost=17,
                        reasons=["11 fake reasons for a test", "2 more of them"])
    text = flat(render_text(agg, width))
    assert "NOT exact: 11 fake reasons for a test; 2 more of them" in text
    assert "lost 17" in text


def test_render_without_a_stream_says_nothing_of_records():
    # plain attach sends no per-op record: "records 0" would read as no ops
    text = flat(render_text(FakeAggregate({7: process(7)}, records=0), 100))
    assert "counts: exact" in text
    assert "records 0" not in text and "lost 0" not in text
    # ... and with a stream the status line counts them
    assert "records 4,242 lost 0" in flat(render_text(FakeAggregate({7: process(7)}), 100))


@pytest.mark.parametrize("width", WIDTHS)
def test_render_empty(width):
    text = render_text(FakeAggregate({}), width)
    # nothing traced: no verdict on counts that do not exist yet
    assert "(no ops yet)" in text and "counts: nothing traced yet" in flat(text)
    assert "exact" not in text
    assert max(cell_len(l) for l in text.splitlines()) <= width


def test_idle_processes_fold_into_one_line():
    # vLLM's API server maps the library too: traced, but its probes never fire
    idle = [Process(3, "idle"), Process(4, "api_server", tier="uprobe", parent=2),
            Process(5, "other", moves={"copy_src": np.zeros(8, np.uint64)})]
    agg = FakeAggregate({p.pid: p for p in idle} | {7: process(7)})
    text = render_text(agg, 100)
    assert "3 traced processes with no probe hit yet: pid 3 (idle); pid 4 (api_server), " \
        "child of 2, stock uprobe; pid 5 (other)" in flat(text)
    # one panel (pid 7's), none for the idle ones
    assert text.count("╭─") == 1 and "pid 7 (" in text
    assert "0 layers" not in text and "(no tokens yet)" not in text
    one = render_text(FakeAggregate({3: Process(3, "idle")}), 80)
    assert "1 traced process with no probe hit yet: pid 3 (idle)" in flat(one)
    assert "╭─" not in one and "counts: nothing traced yet" in flat(one)


def test_panel_title_has_parent_and_tier():
    p = process(9)
    p.parent, p.tier = 7, "uprobe"
    text = flat(render_text(FakeAggregate({9: p}), 120))
    assert "pid 9 (VLLM::EngineCore_with_a_long_name), child of 7, stock uprobe: 2 layers" \
        in text
    p.parent, p.tier = 0, "usdt"
    text = flat(render_text(FakeAggregate({9: p}), 120))
    assert "pid 9 (VLLM::EngineCore_with_a_long_name), fork USDT: 2 layers" in text


def op_row(text, op):
    return next(l for l in text.splitlines() if l.strip().startswith(op + " "))


def test_not_probed_ops_are_said_not_zero():
    p = process(7)
    # a stock CPU build: only the write op has a probe site
    p.probed_ops = ["reshape_and_cache"]
    del p.ops["swap_blocks"]
    text = render_text(FakeAggregate({7: p}), 120)
    missing = [op for op in abi.OPS if op != "reshape_and_cache"]
    assert "not probed on this build: " + ", ".join(missing) in flat(text)
    assert re.search(r"copies and swaps, all layers *│\n.* not probed on this build: *│\n"
                     r".* copy_blocks, swap_blocks *│", text)
    # no move column of zeros in the hottest blocks
    assert "copy src/dst" not in text and "swap out/in" not in text
    # half probed: the probed kinds in the table, the others named
    p.probed_ops = ["reshape_and_cache", "swap_blocks"]
    text = render_text(FakeAggregate({7: p}), 120)
    assert "copy_src, copy_dst: not probed on this build" in flat(text)
    assert re.search(r"swap_out +\d", text) and not re.search(r"copy_src +\d", text)
    assert "swap out/in" in text and "copy src/dst" not in text
    # unknown (an old trace file): shown as before, without a claim
    p.probed_ops = None
    text = render_text(FakeAggregate({7: p}), 120)
    assert "not probed" not in text and "copy src/dst" in text


def test_op_table_units():
    text = render_text(FakeAggregate({7: process(7)}), 120)
    # write ops: slots and padding summed over all layers, no pairs, no bytes
    assert op_row(text, "reshape_and_cache").split() == \
        ["reshape_and_cache", "123,456,789", "38.0M", "987,654,000", "321", "-", "-"]
    # moves: pairs and bytes, no slots
    assert op_row(text, "swap_blocks").split() == ["swap_blocks", "5", "2", "-", "-", "40", "3.0G"]
    assert "all layers" in text and "pairs" in text and "mean" in text  # headers
    # the summary's rate is the run's mean (5 calls / 3.25 s = 1.5 -> "2")


def test_rates_shown_against_previous():
    before, now = FakeAggregate({7: process(7)}), FakeAggregate({7: process(7)})
    before.time = 3.0  # 2 s earlier, 4 calls and 30 items fewer
    before.processes[7].ops["swap_blocks"] = dict(before.processes[7].ops["swap_blocks"],
                                                  calls=5 - 4, items=40 - 30)
    text = render_text(now, 120, prev=before)
    # op, calls, calls/s (4 more calls in 2 s)
    assert op_row(text, "swap_blocks").split()[:3] == ["swap_blocks", "5", "2"]
    # the header says the rate is over the last interval, not a mean
    assert "last 2.0s" in text and "mean" not in text.split("─")[0]
    # a live frame keeps its rows: one line of legend, not the summary's
    assert panels.SHORT_LEGEND in flat(text) and panels.EXACT_MEANS not in flat(text)


def test_histogram_text():
    text = panels.histogram(np.array([8, 4, 0, 1], dtype=np.uint64), width=4).plain
    # 6 rows of 8 eighths each; top = 8: heights 48, 24, 0, 6 eighths
    assert text.split("\n") == [
        "     8 █   ",
        "       █   ",
        "       █   ",
        "       ██  ",
        "       ██  ",
        "       ██ ▆",
        "       0  3",
        "       blocks 0-3 of 4",
        "       height: tokens per block; top 8",
    ]


def test_histogram_buckets_blocks():
    # 10 blocks in at most 4 columns: 3 blocks per column, sums 3, 0, 0, 9
    text = panels.histogram(np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 9], dtype=np.uint64),
                          width=4).plain
    assert "height: tokens summed over 3 blocks per column; top 9" in text
    assert text.split("\n")[0] == "     9    █"
    # first column: ceil(3/9 * 48) = 16 eighths, the two bottom rows
    assert text.split("\n")[3:6] == ["          █", "       █  █", "       █  █"]


def test_histogram_zooms_to_blocks_in_use():
    # 2048 blocks, 12 written (3..14): drawn 1 per column, not 19 per column
    counts = np.zeros(2048, np.uint64)
    counts[3:15] = 16
    text = panels.histogram(counts, width=100, what="tokens").plain.split("\n")
    assert text[-2].strip() == "blocks 1-16 of 2048 (zoomed to those in use)"
    assert text[-1].strip() == "height: tokens per block; top 16"
    bars = text[0][panels.LABEL + 1:]
    assert bars == " " * 2 + "█" * 12 + " " * 2  # 16 columns: blocks 1..16
    assert text[6].split() == ["1", "16"]
    # an explicit range is honoured, and not called a zoom
    text = panels.histogram(counts, width=100, block_range=(0, 2047)).plain
    assert "blocks 0-2047 of 2048\n" in text and "zoomed" not in text
    assert "summed over 21 blocks per column" in text  # ceil(2048 / 100)


@pytest.mark.parametrize("counts,window", [
    ([0] * 10, (0, 9)),                 # nothing: everything
    ([0, 0, 0, 0, 5, 0, 0, 0, 0, 0], (2, 6)),   # one block, padded by 2
    ([1] + [0] * 98 + [1], (0, 99)),    # both ends
    ([0] * 100 + [1] * 64 + [0] * 900, (96, 167)),  # 64 used: padded by 64 // 16 = 4
])
def test_block_window(counts, window):
    assert heatmap.block_window(np.array(counts, np.uint64)) == window


def test_histogram_empty():
    assert panels.histogram(np.zeros(5, dtype=np.uint64), 40).plain == "(no tokens yet)"
    assert panels.histogram(np.zeros(0, dtype=np.uint64), 40).plain == "(no tokens yet)"


def test_log2_table_ranges():
    # bpf_log2l(v) = floor(log2 v) + 1: slot 1 holds 0..1, slot 4 holds 8..15
    agg = FakeAggregate({}, log2={"copy_blocks": {1: 3, 4: 2}})
    text = render_text(agg, 120)
    assert "0 -> 1" in text and "8 -> 15" in text


def test_json_bytes_null_where_not_measured():
    p = process(7)
    doc = Aggregate.to_json(FakeAggregate({7: p}))
    assert doc["ops"]["reshape_and_cache"]["bytes"] is None
    assert doc["ops"]["swap_blocks"]["bytes"] == 3 * 2**30
    proc = doc["processes"][0]
    assert proc["ops"]["reshape_and_cache"]["bytes"] is None
    assert proc["ops"]["swap_blocks"]["bytes"] == 3 * 2**30
    assert p.ops["reshape_and_cache"]["bytes"] == 0  # the aggregate itself is untouched


# -- reads (Process.groups, filled by the reads aggregation) --------------------

class FakeGroup:
    def __init__(self, reads, last, steps):
        self.pid, self.group, self.group_id, self.block_size = 7, 0, 0xabc, 16
        self.num_blocks = len(reads)
        self.steps, self.layer_calls, self.requests, self.tokens = steps, steps * 2, 3, 99
        self.reads_per_block = np.array(reads, np.uint64)
        self.last_read_step = np.array(last, np.uint64)
        self.reads = int(self.reads_per_block.sum())
        self.distinct = int(np.count_nonzero(self.reads_per_block))
        self.held_tokens = self.distinct * self.block_size - 12
        self.null_entries = self.out_of_range = self.truncated = self.read_errors = 0

    # as aggregate.ReadGroup: layer calls per step, a whole number
    layers = ReadGroup.layers
    layers_note = ReadGroup.layers_note


def test_reads_panel_from_groups():
    p = process(7)
    reads = [0] * 64
    reads[5:9] = [10, 3, 7, 1]
    last = [0] * 64
    last[5:9] = [10, 4, 10, 2]  # blocks 5 and 7 read at the latest step (10)
    p.groups = [FakeGroup(reads, last, 10)]
    text = flat(render_text(FakeAggregate({7: p}), 120))
    assert "reads per block, group 0: 10 steps, 21 block reads (once per step for the " \
        "group's 2 layers)" in text
    assert "working set: 2 blocks read at the last step, 4 read at least once, of 64" in text
    assert "hottest block:reads 5:10, 7:7, 6:3, 8:1" in text
    # four blocks read: all among the hottest, none listed as coldest too
    assert "coldest read block:reads -" in text
    # 4 distinct blocks over 10 steps, 52 of their 64 token slots held; 21
    # reads of them; blocks 6 and 8 idle for 6 and 8 steps
    assert "live set: 0.4 blocks a step (mean), utilization 81.2% (tokens held / " \
        "capacity), sharing 5.25 requests a block; 2" in text
    assert "blocks idle, median 7 steps since their last read" in text
    assert "blocks 3-10 of 64 (zoomed to those in use)" in text
    assert "height: reads per block; top 10" in text
    # more blocks than both lists: the coldest are the least read of the rest
    many = [0] * 64
    many[1:15] = range(1, 15)
    p.groups = [FakeGroup(many, [3] * 64, 10)]
    text = flat(render_text(FakeAggregate({7: p}), 120))
    assert "hottest block:reads 14:14, 13:13, 12:12, 11:11, 10:10, 9:9" in text
    assert "coldest read block:reads 1:1, 2:2, 3:3, 4:4, 5:5, 6:6" in text
    p.groups = [FakeGroup(reads, last, 10)]
    # a truncated table says so, in the panel
    p.groups[0].truncated = 5
    text = flat(render_text(FakeAggregate({7: p}), 120))
    assert "reads NOT exact: 5 entries truncated" in text
    # a process that has only reads is not idle
    q = Process(8, "reader")
    q.groups = [FakeGroup(reads, last, 10)]
    assert not panels.is_idle(q) and panels.reads_panel(Process(9, "x"), 80) == []


def test_probed_ops_of_a_traced_process():
    from tracer.probes.sdt import Probe
    from tracer.kernel.session import TracedProcess

    def probe(name, path="/lib/a.so"):
        return Probe(path, "vllm", name, 0x10, 0x10, 0, 0, "")

    skipped = probe("swap_blocks")
    proc = TracedProcess(5, 0, "w", probe_files={
        "/lib/a.so": [probe("reshape_and_cache"), skipped, probe("not_an_op")],
        "/lib/b.so": [probe("copy_blocks", "/lib/b.so")]})
    proc.skipped = [(skipped, "not mapped")]
    # attached: known op names, less what was skipped
    assert proc.probed_ops == ["copy_blocks", "reshape_and_cache"]


def test_cmd_output_path_choice():
    import argparse
    import os
    from tracer.commands.attach import _drop_if_empty, cmd_output_path

    def args(**kw):
        return argparse.Namespace(**{"command": ["x"], "cmd_output": None, **kw})

    assert cmd_output_path(args(command=[]), live_view=True) is None  # -p: not ours
    assert cmd_output_path(args(cmd_output="-"), live_view=True) is None  # the terminal
    assert cmd_output_path(args(cmd_output="/some/f.log"), live_view=False) == "/some/f.log"
    assert cmd_output_path(args(), live_view=False) is None  # no view to tear
    made = args()
    path = made.cmd_output_path = cmd_output_path(made, live_view=True)  # a view: a new file
    try:
        assert os.path.basename(path).startswith("kvtrace-cmd-") and path.endswith(".log")
        assert os.stat(path).st_mode & 0o777 == 0o600
        # one the command wrote to stays at exit, an empty one goes
        with open(path, "w") as f:
            f.write("x\n")
        _drop_if_empty(made)
        assert os.path.exists(path) and made.cmd_output_path == path
        open(path, "w").close()
        _drop_if_empty(made)
        assert not os.path.exists(path) and made.cmd_output_path is None
        assert made.cmd_output_dropped
    finally:
        if os.path.exists(path):
            os.unlink(path)
    # a file the user named stays, even empty
    named = args(cmd_output=path)
    named.cmd_output_path = cmd_output_path(named, live_view=True)
    open(path, "w").close()
    try:
        _drop_if_empty(named)
        assert os.path.exists(path) and named.cmd_output_path == path
    finally:
        os.unlink(path)


def test_lifecycle_panel_says_what_the_scheduler_did():
    """The plugin tier's panel: per event the blocks, the share of needed
    blocks the prefix cache served (3 hits of 3 + 9 needed: 25.0%), the
    requests, and the blocks hit most; nothing for a process without it."""
    from tracer.analysis.aggregate import Process

    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    p = Process(pid=5, comm="EngineCore", tier="plugin",
                life={"alloc": u(0, 4, 5), "hit": u(0, 0, 3), "cache": u(0, 2, 0),
                      "free": u(0, 4, 5), "evict": u(0, 1, 0)},
                requests=[dict(finish_ns=1, preemptions=0, recomputed=0),
                          dict(finish_ns=0, preemptions=2, recomputed=48)])
    text = "\n".join(str(part) for part in panels.lifecycle_panel(p, 100))
    assert "9 allocated, 3 prefix hits, 2 cached, 9 freed, 1 evicted" in text
    assert "served 25.0% of the 12 blocks" in text
    assert "2 seen, 1 running, 1 finished, 2 preemptions (48 tokens to recompute)" in text
    assert "b2 x3" in text and "b1 x" not in text
    assert panels.lifecycle_panel(Process(pid=6, comm="w"), 100) == []


def test_layer_count_is_whole_or_says_why():
    """Counters read while a step is under way count some of its layers:
    attach's live view once said "the group's 1.99953 layers"."""
    p = process(7)
    reads = [0] * 64
    reads[5:9] = [10, 3, 7, 1]
    g = FakeGroup(reads, [1] * 64, 10)
    g.layer_calls = 19  # 2 layers x 10 steps, the last layer of the last step not yet
    p.groups = [g]
    text = flat(render_text(FakeAggregate({7: p}), 200))
    assert "(once per step for the group's 2 layers; 19 layer calls over 10 steps: steps " \
        "under way when counted)" in text
    assert "1.9" not in text
    g.layer_calls = 10
    assert "(once per step for the group's 1 layer)" in flat(render_text(FakeAggregate({7: p}),
                                                                         120))


def test_reader_process_header_counts_the_blocks_it_reads():
    """A process that only reads (vLLM's engine core, the plugin tier) said
    "0 layers, 0 blocks" above a 64-block read histogram."""
    q = Process(8, "reader")
    q.groups = [FakeGroup([0, 4, 2] + [0] * 61, [0, 3, 3] + [0] * 61, 3)]
    text = flat(render_text(FakeAggregate({8: q}), 120))
    assert "pid 8 (reader): no layer written, 64 blocks" in text
    assert "0 blocks" not in text


def _lifecycle_text(mrc, width=200):
    from tracer.analysis import lifecycle
    from tracer.views import report_text
    hist = {"count": 232, "sum_s": 1.0, "buckets": lifecycle.histogram(np.full(232, 0.3))}
    figs = {"summary": {"blocks": {"alloc": 300, "hit": 50, "cache": 40, "free": 340,
                                   "evict": 0},
                        "reallocated": 232, "prefix_served_share": 0.14, "requests": 0,
                        "incomplete_events": 0, "access_steps": {"steps": 0, "unmatched": 0}},
            "lifetime": hist, "idle_before_evict": hist, "reuse_gap": hist,
            "miss_ratio_curve": mrc, "requests": []}
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(*report_text.lifecycle_view(figs, width))
    return flat(re.sub("[│╭╮╰╯─]", " ", console.file.getvalue()))


def test_lifecycle_says_what_idle_before_evict_and_the_curve_count():
    """"0 evicted" above an idle_before_evict histogram of 232 blocks, and
    "0 recomputed that a larger cache would have hit" above hit ratios up to
    78.9%, read as contradictions: the screen now says what each counts."""
    text = _lifecycle_text({"references": 400, "observed_hits": 120, "compulsory": 280,
                            "refetched": 0, "curve": [[1, 0.1], [8, 0.3]]})
    assert "300 allocated (232 of them re-allocations)" in text
    assert "0 evicted from the prefix cache" in text
    assert "idle_before_evict: vLLM's name, one sample per re-allocation, cached or not" in text
    assert "vLLM hit 30.0%; 280 first references miss at any size, so no cache hits more " \
        "than 30.0%; 0 blocks recomputed whose content had been cached" in text


# -- density: the live view fits 50 rows, the report keeps its width ----------

DATA = os.path.join(os.path.dirname(__file__), "data")
# Real CPU vLLM with the plugin, make demo-vllm's workload for 2 rounds,
# recorded on 2026-12-07 by
#   kvtrace-bpf record -o tests/data/vllm-demo.kvt -- .venv-vllm/bin/python \
#     scripts/vllm-workload.py --model TINY --repeat 2 --requests \
#     160:16,128:16,96:16,200:16,64:16 --prefix-caching on --shared-prefix 64 \
#     --fresh-prompts --num-gpu-blocks 24 --max-model-len 256
# an engine core (the plugin's lifecycle and reads) and a worker (writes and
# reads): the two panels of demo-vllm's live view.
VLLM_DEMO = os.path.join(DATA, "vllm-demo.kvt")


def vllm_demo_aggregate():
    """The recording's aggregate as the live view draws it at the end of
    the run: the stream's counts, and the scheduler's lifecycle counts and
    requests from the END record (the live view reads those from the maps)."""
    trace = tracefile.load(VLLM_DEMO)
    agg = Report(trace).agg
    for p in trace.end["aggregate"]["processes"]:
        lc = p.get("lifecycle")
        if not lc:
            continue
        proc = agg.processes[p["pid"]]
        proc.life = {}
        for kind, pairs in lc["blocks"].items():
            arr = np.zeros(max([b for b, _ in pairs] + [0]) + 1, np.uint64)
            for b, n in pairs:
                arr[b] = n
            proc.life[kind] = arr
        proc.requests = [dict(r, req=int(r["req"], 16)) for r in lc["requests"]]
    return agg


def live_frame(agg, width, full):
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(panels.render(agg, agg, title="kvtrace-bpf  pid 1  traced: 2 VLLM::EngineCor, "
                              "3 VLLM::Worker", elapsed=3.25, width=min(width, 120),
                              full=full, note="python3's output: /tmp/kvtrace-cmd-x.log"))
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width", (100, 120, 200))
def test_live_view_of_vllm_fits_50_rows(width):
    """attach's live view by default fits a 50-row terminal (less the line
    rich's Live keeps free) with both of vLLM's panels whole: the worker's
    reads were cut off at 60 rows; --full has every panel."""
    agg = vllm_demo_aggregate()
    procs = [p for p in agg.processes.values() if not panels.is_idle(p)]
    assert len(procs) == 2 and any(p.life for p in procs) and all(p.groups for p in procs)
    lines = live_frame(agg, width, full=False)
    assert len(lines) <= panels.FIT_ROWS - 1, "\n".join(lines)
    text = flat("\n".join(lines))
    for p in procs:
        assert f"pid {p.pid} ({p.comm})" in text
        assert text.count(f"reads per block, group {p.groups[0].group}:") == 2
    assert "lifecycle (scheduler):" in text and "tokens written per block" in text
    # the second of two panels with the same group says which drew it
    assert f"block reads (the same group as pid {min(p.pid for p in procs)}'s, drawn " \
        "above)" in text
    # mid-run the scheduler is a step ahead of its worker (a step in
    # flight): the two counts differ, and the group is still drawn once
    later = max(procs, key=lambda p: p.pid).groups[0]
    later.steps -= 1
    later.reads_per_block = later.reads_per_block.copy()
    later.reads_per_block[int(np.argmax(later.reads_per_block))] -= 1
    assert len(live_frame(agg, width, full=False)) <= panels.FIT_ROWS - 1
    full = live_frame(agg, width, full=True)
    assert len(full) > panels.FIT_ROWS and "items per op (log2)" in flat("\n".join(full))
    assert "items per op (log2)" not in text


def test_report_tables_keep_their_titles_on_one_line():
    """A table's title is a line of its own: rich wrapped it to the table's
    width, and the miss-ratio curve's two columns squeezed its title into a
    column of 25 characters.  The curve's points go across, and so do the
    rates of more ops than fit as columns."""
    r = run_kvtrace("report", VLLM_DEMO, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for title, end in (("miss-ratio curve: ", "block references)"),
                       ("block residency, every block", "cumulative)"),
                       ("what each request wrote and read:", "block reads in all and a step")):
        at = [l for l in lines if title in l]
        assert len(at) == 1 and end in at[0], at
    curve = next(i for i, l in enumerate(lines) if "miss-ratio curve: " in l)
    assert "cache blocks" in lines[curve + 2] and "hit ratio" in lines[curve + 4], \
        "\n".join(lines[curve:curve + 6])
    assert max(cell_len(l) for l in lines) <= 120
    # ten ops' rates: a row an op, no name cut to "block_t…"
    assert "…" not in r.stdout
    assert any(l.split()[:1] == ["cpu_attn_reshape_and_cache"] and len(l.split()) == 11
               for l in lines)


@pytest.mark.parametrize("columns, width", ((None, 120), ("100", 100)))
def test_report_piped_keeps_its_width(columns, width):
    """`report` into a pipe or a file is drawn 120 columns wide
    (panels.PIPE_WIDTH; rich's own default there is 80); COLUMNS still wins."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    r = run_kvtrace("report", os.path.join(DATA, "before-reads.kvt"), env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # the panels are drawn to the width, their borders whole
    borders = [l for l in lines if l.startswith("╭─ pid")]
    assert borders and all(cell_len(l) == width for l in borders), borders
    assert max(cell_len(l) for l in lines) <= width
    assert width == int(columns or panels.PIPE_WIDTH)
