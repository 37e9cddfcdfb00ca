"""tracer/prom.py's pure parts: the --prometheus value, the process role
and the model name read from a command line (no BPF, no root)."""

import pytest

from tracer.exporters import prometheus
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
    assert prometheus.parse_endpoint(text) == want


@pytest.mark.parametrize("text", ["abc", "0", "65536", "99999999", "-1", "1.5", "",
                                  "127.0.0.1:", "127.0.0.1:x", "::1:9472", "[::1]"])
def test_bad_endpoint_values(text):
    with pytest.raises(UsageError, match="--prometheus"):
        prometheus.parse_endpoint(text)


def test_default_port_is_none_of_the_neighbours():
    # vLLM and Dynamo's frontend, Dynamo's usual DYN_SYSTEM_PORT,
    # ebpf_exporter, Prometheus and its alertmanager/pushgateway, node_exporter
    assert prometheus.DEFAULT_PORT not in (8000, 8081, 9435, 9090, 9091, 9093, 9100)
    assert prometheus.DEFAULT_ADDR == "127.0.0.1"


@pytest.mark.parametrize("comm,want", [
    ("EngineCore_DP0", "engine_core"), ("VLLM::EngineCor", "engine_core"),
    ("VllmWorker-1", "worker"), ("VLLM::Worker_TP", "worker"),
    ("python3", "other"), ("kvsim", "other")])
def test_roles(comm, want):
    assert prometheus.role(comm) == want


@pytest.mark.parametrize("argv,want", [
    ("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model m/x --port 8000", "m/x"),
    ("vllm serve Qwen/Qwen3-0.6B --port 8000", "Qwen/Qwen3-0.6B"),
    ("/venv/bin/vllm serve /models/llama --served-model-name llama", "llama"),
    (["python", "scripts/vllm-workload.py", "--model=build/tiny-llama"], "build/tiny-llama"),
    ("tests/target/kvsim --workload beam", ""),
    ("python3 serve.py", ""),
])
def test_model_name(argv, want):
    assert prometheus.model_name(argv) == want


def test_lifecycle_metrics_from_a_plugin_process():
    """The plugin tier's series: blocks per event, blocks held (taken by
    alloc or hit more often than freed) and the request counters, from a
    hand-made aggregate whose answer is worked out here by hand."""
    import numpy as np
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from tracer.analysis.aggregate import Aggregate, Process

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
    exp = prometheus.Exporter()
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


# -- the residency histograms' live path (lifecycle.StreamTap, LiveResidency)

def _records(*recs):
    """Raw perf records, as the BPF program sends them: ("op", seq, ts_ns,
    op name, pid, [ids]) or ("chunk", seq, offset, [values])."""
    import numpy as np

    from tracer import abi
    from tracer.kernel import records

    out = []
    for r in recs:
        if r[0] == "op":
            _, seq, ts, op, pid, n = r
            e = np.zeros(1, dtype=records.EVENT)
            e["type"], e["seq"], e["ts_ns"], e["op"], e["pid"] = records.REC_OP, seq, ts, \
                abi.OPS[op], pid
            e["items"], e["chunks"] = n, 1 if n else 0
            out.append(e.tobytes())
        else:
            _, seq, offset, values = r
            h = np.zeros(1, dtype=records.CHUNK_HDR)
            h["type"], h["count"], h["seq"], h["offset"] = records.REC_CHUNK, len(values), seq, \
                offset
            out.append(h.tobytes() + np.array(values, dtype=np.int64).tobytes())
    return out


def _feed(tap, raw):
    import ctypes

    for rec in raw:
        buf = ctypes.create_string_buffer(rec, len(rec))
        tap.add(ctypes.addressof(buf), len(rec))


def test_generation_fill_buckets_by_hand():
    """Block size 24: ended generations of 1, 12, 13 and 24 tokens (the
    kernel's ended[] bins), in sixteenths of the block: 1/24 <= 1/16, 12/24
    <= 8/16, 13/24 <= 9/16 (13 x 16 = 208 <= 9 x 24 = 216), 24/24 <= 16/16.
    The second layer's counts are not added: every layer writes the same."""
    import numpy as np

    from tracer.analysis.aggregate import Layer, Process

    ended = np.zeros(2048, dtype=np.uint64)
    ended[[1, 12, 13, 24]] = [2, 1, 1, 3]
    layer = lambda n, fill: Layer(pid=7, layer=n, cache_id=n, index=n, op="reshape_and_cache",  # noqa: E731
                                  block_size=24, num_blocks=8, calls=0, slots=0, padding=0,
                                  out_of_range=0, writes=np.zeros(8, dtype=np.uint64),
                                  fill_ended=fill, fill_unseen=5 + n)
    p = Process(pid=7, comm="x", layers=[layer(0, ended), layer(1, ended * 7)])
    got = prometheus._generation_fill(p)
    want = {1: 2, 8: 3, 9: 4, 16: 7}
    cum, c = [], 0
    for k in range(1, 17):
        c = want.get(k, c)
        cum.append(c)
    assert [n for _, n in got["buckets"]] == cum + [7]
    assert got["buckets"][0][0] == "0.0625" and got["buckets"][-2][0] == "1.0"
    assert got["sum"] == pytest.approx((2 * 1 + 12 + 13 + 3 * 24) / 24)
    assert got["unseen"] == 5
    assert prometheus._generation_fill(Process(pid=8, comm="x")) is None


def test_stream_tap_keeps_block_ids_only_and_waits_for_late_op_records():
    """The tap keeps the block events' records and ids; a write's slot
    values are gone after the poll that saw its op record; a chunk whose
    op record comes a poll later is kept until then; one whose record never
    comes is dropped after EARLY_POLLS polls."""
    from tracer.analysis import lifecycle
    from tracer.kernel import records
    from tracer.trace import stream

    S = 10 ** 9
    tap = lifecycle.StreamTap()
    _feed(tap, _records(("chunk", 1, 0, [100, 101, 102]), ("op", 1, 1 * S, "reshape_and_cache", 7, 3),
                        ("chunk", 2, 0, [5, 6]), ("op", 2, 2 * S, "block_alloc", 7, 2),
                        ("chunk", 3, 0, [5]),  # its record comes with the next poll
                        ("chunk", 9, 0, [1, 2, 3])))  # its record never comes
    tap.poll()
    assert tap.pending_bytes == 0  # nothing of the stream held after a poll
    (first,) = tap.take_life()
    ops = stream.decode(first)
    assert ops.ops["seq"].tolist() == [2] and ops.values_of(0).tolist() == [5, 6]
    _feed(tap, _records(("op", 3, 3 * S, "block_hit", 7, 1)))
    tap.poll()
    ops = stream.decode(tap.take_life())
    assert ops.ops["seq"].tolist() == [3] and ops.ops["complete"].all()
    assert ops.values_of(0).tolist() == [5]
    assert [len(h) for _, h, _ in tap._early] == [records.CHUNK_HDR.itemsize]  # seq 9 waits
    for _ in range(lifecycle.EARLY_POLLS):
        tap.poll()
    assert tap._early == [] and tap.take_life() == []


def test_live_residency_holds_back_recent_events_and_matches_offline():
    """Events reach the histograms HOLD_S after they happened, in time order
    even when a later event is read first; the result equals report's
    offline residency() of the same events, bucket by bucket."""
    from tracer.analysis import lifecycle
    from tracer.trace import stream

    S = 10 ** 9
    raw = [("chunk", 1, 0, [5, 6]), ("op", 1, 0, "block_alloc", 7, 2),
           ("chunk", 2, 0, [5]), ("op", 2, S // 1000, "block_hit", 7, 1),    # 1 ms
           ("chunk", 3, 0, [5]), ("op", 3, 3 * S // 1000, "block_hit", 7, 1),  # gap 2 ms
           ("chunk", 5, 0, [5, 6]), ("op", 5, 2 * S, "block_alloc", 7, 2)]   # life 2 s
    tap = lifecycle.StreamTap()
    live = lifecycle.LiveResidency(tap)
    # the allocation at 2 s is read before the hit at 3 ms (another CPU)
    _feed(tap, _records(*raw[:4], *raw[6:]))
    live.tick(now_ns=2 * S, force=True)  # only the first two are old enough
    assert live.histograms(7)["reuse_gap"][0][-1] == ("+Inf", 0)
    _feed(tap, _records(*raw[4:6]))
    live.tick(now_ns=int(2.5 * S), force=True)  # still not the 2 s allocation
    h = live.histograms(7)
    assert h["reuse_gap"][0][-1] == ("+Inf", 1) and h["lifetime"][0][-1] == ("+Inf", 0)
    live.tick(now_ns=4 * S, force=True)
    h = live.histograms(7)
    tap2 = lifecycle.StreamTap()
    _feed(tap2, _records(*raw))
    tap2.poll()
    offline = lifecycle.residency(lifecycle.events(stream.decode(tap2.take_life())))
    for name in lifecycle.RESIDENCY:
        assert h[name][0] == lifecycle.histogram(offline[name]), name
        assert h[name][1] == pytest.approx(float(offline[name].sum())), name
    assert dict(h["lifetime"][0])[2] == 2 and dict(h["lifetime"][0])[1] == 0  # 5 and 6: 2 s
    assert dict(h["idle_before_evict"][0])[2] == 2 and dict(h["idle_before_evict"][0])[1] == 0
    assert dict(h["reuse_gap"][0])[0.002] == 1 and dict(h["reuse_gap"][0])[0.001] == 0
    assert live.histograms(8)["lifetime"][0][-1] == ("+Inf", 0)  # another process: zeros


@pytest.mark.parametrize("argv,streams", [
    (["-p", "1"], "block_ids"), (["-p", "1", "--prometheus"], "block_ids"),
    (["-p", "1", "-o", "/tmp/kvtrace-unit.kvt"], "all"),
    (["-p", "1", "-o", "/tmp/kvtrace-unit.kvt", "--prometheus"], "all")])
def test_index_stream_all_only_with_o(argv, streams):
    """Plain attach and --prometheus stream the plugin tier's events alone
    (its derived reads); only -o streams every value and takes the larger
    buffers."""
    from tracer import cli
    from tracer.commands import attach as cmd_attach

    args = cli.build_parser().parse_args(["attach", *argv])
    cmd_attach.validate(args)
    assert cmd_attach.index_stream(args) == streams
    assert (args.perf_pages == 64) is (streams != "all")
