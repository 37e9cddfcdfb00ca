"""tracer/prom.py's pure parts: the --prometheus value, the process role
and the model name read from a command line (no BPF, no root)."""

import pytest

from tracer import prom
from tracer.errors import UsageError


@pytest.mark.parametrize("text,want", [
    (None, ("127.0.0.1", 9472)),
    ("9100", ("127.0.0.1", 9100)),
    (":9100", ("127.0.0.1", 9100)),
    ("0.0.0.0:1", ("0.0.0.0", 1)),
    ("10.1.2.3:65535", ("10.1.2.3", 65535)),
    ("[::1]:9472", ("::1", 9472)),
    ("localhost:9472", ("localhost", 9472)),
])
def test_endpoint_values(text, want):
    assert prom.parse_endpoint(text) == want


@pytest.mark.parametrize("text", ["abc", "0", "65536", "99999999", "-1", "1.5", "",
                                  "127.0.0.1:", "127.0.0.1:x", "::1:9472", "[::1]"])
def test_bad_endpoint_values(text):
    with pytest.raises(UsageError, match="--prometheus"):
        prom.parse_endpoint(text)


def test_default_port_is_none_of_the_neighbours():
    # vLLM and Dynamo's frontend, Dynamo's usual DYN_SYSTEM_PORT,
    # ebpf_exporter, Prometheus and its alertmanager/pushgateway, node_exporter
    assert prom.DEFAULT_PORT not in (8000, 8081, 9435, 9090, 9091, 9093, 9100)
    assert prom.DEFAULT_ADDR == "127.0.0.1"


@pytest.mark.parametrize("comm,want", [
    ("EngineCore_DP0", "engine_core"), ("VLLM::EngineCor", "engine_core"),
    ("VllmWorker-1", "worker"), ("VLLM::Worker_TP", "worker"),
    ("python3", "other"), ("kvsim", "other")])
def test_roles(comm, want):
    assert prom.role(comm) == want


@pytest.mark.parametrize("argv,want", [
    ("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model m/x --port 8000", "m/x"),
    ("vllm serve Qwen/Qwen3-0.6B --port 8000", "Qwen/Qwen3-0.6B"),
    ("/venv/bin/vllm serve /models/llama --served-model-name llama", "llama"),
    (["python", "scripts/vllm-workload.py", "--model=build/tiny-llama"], "build/tiny-llama"),
    ("tests/target/kvsim --workload beam", ""),
    ("python3 serve.py", ""),
])
def test_model_name(argv, want):
    assert prom.model_name(argv) == want


def test_lifecycle_metrics_from_a_plugin_process():
    """The plugin tier's series: blocks per event, blocks held (taken by
    alloc or hit more often than freed) and the request counters, from a
    hand-made aggregate whose answer is worked out here by hand."""
    import numpy as np
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from tracer.aggregate import Aggregate, Process

    z = dict(calls=0, items=0, slots=0, padding=0, bytes=0, truncated=0, read_errors=0,
             out_of_range=0)
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    # blocks 1..4: 1 allocated and freed; 2 allocated, hit once, freed once
    # (still held); 3 allocated (held); 4 hit only, from before attach (held)
    p = Process(pid=7, comm="EngineCore_DP0", tier="plugin",
                life={"alloc": u(0, 1, 1, 1, 0), "hit": u(0, 0, 1, 0, 1),
                      "cache": u(0, 1, 1, 0, 0), "free": u(0, 1, 1, 0, 0),
                      "evict": u(0, 0, 0, 0, 0)},
                ops={"request": {**z, "calls": 3}, "req_finish": {**z, "calls": 1},
                     "req_preempt": {**z, "calls": 2, "items": 40}})
    agg = Aggregate(time=1.0, processes={7: p}, log2={}, globals={}, records=0, lost=0)
    exp = prom.Exporter()
    exp.publish(agg)
    reg = CollectorRegistry()
    reg.register(exp)
    text = generate_latest(reg).decode()

    from prometheus_client.parser import text_string_to_metric_families
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(name, **extra):
        return samples[(name, tuple(sorted({"pid": "7", "role": "engine_core",
                                            **extra}.items())))]

    assert value("kvtrace_block_events_total", event="alloc") == 3
    assert value("kvtrace_block_events_total", event="hit") == 2
    assert value("kvtrace_block_events_total", event="free") == 2
    assert value("kvtrace_blocks_held") == 3
    assert value("kvtrace_requests_total") == 3
    assert value("kvtrace_requests_finished_total") == 1
    assert value("kvtrace_preemptions_total") == 2
    assert value("kvtrace_recomputed_tokens_total") == 40
