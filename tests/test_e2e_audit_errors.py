"""audit-kv-events' user mistakes: one line each, the exit code of
docs/exit-codes.md, no traceback.  No vLLM needed: kvsim stands for a
process with probes but no kvtrace plugin, `sleep` for one that is not vLLM,
and a ZMQ publisher of the test's own for vLLM's."""

import subprocess

import msgspec
import pytest
import zmq

from conftest import ROOT, run_kvtrace
from test_e2e_kv_events import free_port, write_capture

pytestmark = pytest.mark.usefixtures("no_leftovers")


def one_line(r, code, needle, after_tracing=False):
    """The error is one line; a live audit's tracing says what it traced
    before it (as record does)."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    if after_tracing:
        assert any("ready after" in line for line in lines), r.stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("kvtrace-bpf: "), r.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture
def publisher():
    """A bound ZMQ PUB that never publishes: reachable, no events."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def test_usage_errors():
    for argv, needle in [
            (("--kv-events", "tcp://127.0.0.1:1"), "give exactly one of -p PID"),
            (("-p", "1"), "give --kv-events ENDPOINT"),
            (("-p", "1", "--kv-events", "udp://x:1"), "must be tcp://HOST:PORT"),
            (("-p", "1", "--kv-events", "tcp://127.0.0.1"), "must be tcp://HOST:PORT"),
            (("--trace", "x.kvt"), "--trace and --kv-events-file go together"),
            (("--trace", "x.kvt", "--kv-events-file", "y", "-p", "1"), "give -p/-- CMD")]:
        one_line(run_kvtrace("audit-kv-events", *argv), 1, needle)


def test_endpoint_unreachable():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = run_kvtrace("audit-kv-events", "-p", sleeper.pid, "--kv-events",
                        f"tcp://127.0.0.1:{free_port()}")
    finally:
        sleeper.kill()
        sleeper.wait()
    one_line(r, 3, "cannot connect to tcp://127.0.0.1:")


def test_pid_not_vllm(publisher):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = run_kvtrace("audit-kv-events", "-p", sleeper.pid, "--kv-events", publisher)
    finally:
        sleeper.kill()
        sleeper.wait()
    one_line(r, 3, "is not vLLM")


def test_no_events_then_no_plugin(tmp_path, publisher):
    """The publisher sends nothing: the live audit of kvsim says no events
    came.  kvsim's default workload has no prefix caching (no block_cache,
    block_hit or block_evict, as stock vLLM without the plugin): offline,
    with a capture, the audit says the recording has no plugin tier."""
    trace = tmp_path / "kvsim.kvt"
    r = run_kvtrace("audit-kv-events", "--kv-events", publisher, "-o", trace, "--",
                    ROOT / "tests/target/kvsim", "--workload", "default", timeout=300)
    one_line(r, 3, f"no KV events came from {publisher}", after_tracing=True)
    assert trace.stat().st_size > 0
    cap = tmp_path / "ev.frames"
    removed = {"type": "BlockRemoved", "block_hashes": [b"\1" * 32], "medium": "GPU"}
    write_capture(cap, [(b"", (0).to_bytes(8, "big"),
                         msgspec.msgpack.encode([1.0, [removed], 0]))])
    r = run_kvtrace("audit-kv-events", "--trace", trace, "--kv-events-file", cap)
    one_line(r, 3, "no block_cache, block_hit or block_evict of the kvtrace plugin")
    r = run_kvtrace("audit-kv-events", "--trace", trace, "--kv-events-file", tmp_path / "no")
    one_line(r, 4, "No such file")
