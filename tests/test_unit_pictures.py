"""The pictures' pure logic on small hand-made documents (fakes for pure
logic: the figures against real recordings are tests/test_e2e_pictures.py):
which read groups count once, the headline differences and their words,
the hottest share, the flame graph's tree, and a figure a document cannot
have saying why."""

import numpy as np
import pytest

from tracer.analysis import headlines
from tracer.exporters import figures


def proc(pid, parent, groups):
    return {"pid": pid, "parent": parent, "layers": [], "ops": {},
            "groups": [{"group": g, "group_id": gid, "num_blocks": 8, "block_size": 16,
                        "reads_per_block": pairs} for g, gid, pairs in groups]}


def test_a_group_of_a_parent_and_its_child_counts_once():
    # vLLM: the engine core (plugin) and its worker (op) count one group
    doc = {"blocks": {"processes": [proc(20, 10, [(0, 7, [[1, 3]])]),
                                    proc(10, 1, [(0, 5, [[1, 3]])])]}}
    assert headlines.read_groups(doc) == {(10, 5)}
    assert headlines.reads_per_block(doc).tolist() == [0, 3, 0, 0, 0, 0, 0, 0]


def test_groups_of_unrelated_processes_both_count():
    # two kvsims under one shell: siblings, not one engine
    doc = {"blocks": {"processes": [proc(10, 1, [(0, 5, [[1, 3]])]),
                                    proc(11, 1, [(0, 6, [[2, 4]])])]}}
    assert headlines.read_groups(doc) == {(10, 5), (11, 6)}
    assert headlines.reads_per_block(doc).sum() == 7


def test_hottest_share():
    per = np.array([0, 10] + [1] * 9)
    assert headlines.hottest_share(per, 0.1) == pytest.approx(10 / 19)
    assert headlines.hottest_share(per, 0.01) == pytest.approx(10 / 19)  # one block at least
    assert headlines.hottest_share(np.zeros(4, np.int64), 0.1) is None


@pytest.mark.parametrize("value,kind,signed,want", [
    (0.25, "%", False, "25.0%"), (-0.031, "%", True, "-3.1pp"), (12345, "n", False, "12,345"),
    (2.5, "n", True, "+2.5"), (None, "n", False, "-"), (0.339, "s", False, "0.339 s"),
])
def test_formatted(value, kind, signed, want):
    assert headlines.formatted(value, kind, signed) == want


def test_flame_tree_sums_each_frame():
    t = figures.flame_tree(["a;b;c 3", "a;b;d 2", "a;e 5"])
    assert t["weight"] == 10
    a = t["children"]["a"]
    assert a["weight"] == 10 and a["children"]["b"]["weight"] == 5
    assert a["children"]["b"]["children"]["d"]["weight"] == 2


def test_a_figure_without_its_data_says_why():
    doc = {"lifecycle": None, "folded": []}
    for build in (figures.residency_figure, figures.mrc_figure, figures.timeline_figure,
                  figures.flame_figure):
        f = build([("run", doc)])
        f.close()
        assert f.missing and not f.data, f.name


@pytest.mark.parametrize("paths,want", [
    (["x/a.kvt", "y/b.kvt"], ["a.kvt", "b.kvt"]),
    (["x/run.kvt", "y/run.kvt"], ["x/run.kvt", "y/run.kvt"]),
    (["run.kvt", "run.kvt"], ["a: run.kvt", "b: run.kvt"]),
])
def test_each_run_has_a_name_of_its_own(paths, want):
    from tracer.commands.pictures import labels_of
    assert labels_of(paths) == want
