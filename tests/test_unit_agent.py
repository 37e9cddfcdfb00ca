"""The agent's pure logic: --include/--exclude, --config, the labels it
reads from command lines (docs/agent.md).  No BPF here: the agent's
tracing is tests/test_e2e_agent.py's."""

import argparse

import pytest

from tracer.commands import agent
from tracer.errors import UsageError
from tracer.exporters import prometheus
from tracer.probes import node


def args(**kw):
    base = dict(include=None, exclude=None, grace=None, config=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_selection_include_then_exclude():
    s = node.Selection(["llama"], ["bench"])
    assert not s.wants(["Meta/Llama-3", "vllm serve Meta/Llama-3"])  # patterns are case-sensitive
    assert s.wants(["", "vllm serve /m/llama-3 --port 8000"])
    assert not s.wants(["", "vllm serve /m/llama-3 bench"])
    assert not s.wants(["qwen", "vllm serve qwen"])
    assert node.Selection().wants(["anything"])


def test_config_file_adds_to_the_flags(tmp_path):
    conf = tmp_path / "agent.conf"
    conf.write_text("# comment\ninclude Llama  # trailing\n--exclude=bench\ngrace 12.5\n\n")
    sel, grace = agent._settings(args(include=["Qwen"], config=str(conf)))
    assert grace == 12.5
    assert [p.pattern for p in sel.include] == ["Qwen", "Llama"]
    assert [p.pattern for p in sel.exclude] == ["bench"]
    sel, grace = agent._settings(args(grace=3.0))
    assert grace == 3.0 and not sel.include
    assert agent._settings(args())[1] == agent.GRACE_S


@pytest.mark.parametrize("text, why", [
    ("includ Llama\n", "unknown setting"),
    ("grace soon\n", "--config"),
    ("include 'open\n", ":1:"),
])
def test_bad_config_is_one_usage_error(tmp_path, text, why):
    conf = tmp_path / "agent.conf"
    conf.write_text(text)
    with pytest.raises(UsageError, match=why):
        agent._settings(args(config=str(conf)))


def test_missing_config_and_bad_pattern():
    with pytest.raises(UsageError, match="--config /nonexistent"):
        agent._settings(args(config="/nonexistent/agent.conf"))
    with pytest.raises(UsageError, match="not a regular expression"):
        agent._settings(args(include=["("]))


class FakeFollower(node.NodeFollower):
    """Command lines and parents from a table, not /proc."""

    def __init__(self, cmdlines, parents):
        super().__init__(node.Selection(), prometheus.model_name)
        self._cmdlines = dict(cmdlines)
        self.parent_of = dict(parents)
        self.candidates = set(cmdlines)


def test_labels_from_the_process_and_its_candidate_ancestors(monkeypatch):
    monkeypatch.setattr(node.discover, "comm", lambda pid: {3: "EngineCore_DP1"}.get(pid, "x"))
    f = FakeFollower({1: "vllm serve /models/llama --port 8001 --served-model-name chat",
                      2: "python -c from multiprocessing.spawn import spawn_main",
                      3: "python -c from multiprocessing.spawn import spawn_main",
                      9: "vllm serve other --data-parallel-rank 2"},
                     {2: 1, 3: 2, 1: 0, 9: 0})
    assert f.labels(3) == ("chat", "1", "8001")
    assert f.labels(2) == ("chat", "", "8001")
    assert f.labels(9) == ("other", "2", "")
    # an ancestor that is no candidate is not read
    f.candidates.discard(1)
    f._labels.clear()
    assert f.labels(2) == ("", "", "")
    assert f.texts(3)[1:] == [f._cmdlines[3], f._cmdlines[2]]
