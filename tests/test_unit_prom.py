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
