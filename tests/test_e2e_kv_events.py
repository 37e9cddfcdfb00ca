"""`audit-kv-events` on real vLLM (CPU): its KV event stream (ZMQ) against
what its scheduler did (the kvtrace plugin's block_cache and block_evict).

One vLLM run, with prefix caching and a 16-block cache that forces
evictions.  The test puts a ZMQ proxy of its own between vLLM's publisher
and the auditor: it forwards every message but one event (the run's first
BlockRemoved), and keeps the messages as they came.  The auditor runs live
on the proxy's stream and keeps its recording (-o); then, offline, the same
recording is audited against the untouched messages and against them with
one BlockRemoved sent twice.

Expected values never come from the tracer:

- the event dropped or duplicated is the proxy's own choice, named by its
  seq, its place and its hash bytes;
- on the untouched stream, the counts of stored and removed hashes are
  vLLM's own events', decoded here with msgspec alone; and vLLM's real
  discrepancies are replayed here from its own events: with no event lost
  (no seq gap) and no reuse announcements (kv_cache_report_mode is not
  "full"), each BlockStored is one physical copy cached and each
  BlockRemoved one evicted, so a BlockStored while the hash's copies are
  > 0 is a second copy (stored_again), and a BlockRemoved that leaves
  copies > 0 is a removal while another copy lives.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time

import msgspec
import pytest
import zmq

from conftest import ROOT, Tracer, kvtrace_cmd, run_kvtrace

pytestmark = pytest.mark.vllm

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
# four 200-token prompts, twice, in a 16-block cache (15 usable) of 32-token
# blocks: each needs 7 blocks, so round two finds some of round one's blocks
# evicted (capacity) and recomputes them.  The prompts share their first 64
# tokens (2 blocks): later requests hit them (vLLM caches a block when it
# allocates it, so even the two that run together share one copy)
REQUESTS = "200:4,200:4,200:4,200:4"
SHARED = 64


class Audit(Tracer):
    """`kvtrace-bpf audit-kv-events` in the background."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(kvtrace_cmd("audit-kv-events", *args), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.early_err = ""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def h64(h) -> str:
    """vLLM's 64-bit int form of a block hash (kv_cache_utils.py,
    maybe_convert_block_hash: the hash as a big-endian number, its low 64
    bits), as the audit prints hashes; an int is that form already."""
    if isinstance(h, bytes):
        h = int.from_bytes(h, "big") & (2**64 - 1)
    return f"{h:016x}"


class Proxy:
    """SUB on vLLM's publisher, PUB to the auditor: every message forwarded
    as it came, but for the first BlockRemoved event of the run, dropped
    from its batch (re-encoded with msgspec, as vLLM encodes)."""

    def __init__(self, upstream, downstream):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(downstream)
        self.messages = []  # (topic, seq bytes, payload) as vLLM sent them
        self.dropped = None  # (seq, place in the batch, the event)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            self.messages.append((topic, seq, payload))
            if self.dropped is None:
                ts, events, *rest = msgspec.msgpack.decode(payload)
                for i, e in enumerate(events):
                    if e["type"] == "BlockRemoved":
                        self.dropped = (int.from_bytes(seq, "big"), i, e)
                        payload = msgspec.msgpack.encode([ts, events[:i] + events[i + 1:],
                                                          *rest])
                        break
            self.pub.send_multipart((topic, seq, payload))

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


def write_capture(path, messages):
    """The auditor's capture format: each frame prefixed by its length."""
    with open(path, "wb") as f:
        for frames in messages:
            for fr in frames:
                f.write(len(fr).to_bytes(4, "big") + fr)


def vllm_replay(messages):
    """vLLM's own events replayed as copies per hash (see the docstring):
    (stored hashes, removed hashes, stored_again, removed_while_resident),
    the last two as sets of (seq, hash)."""
    copies, stored, removed, again, while_res = {}, 0, 0, set(), set()
    for _, seq, payload in messages:
        seq = int.from_bytes(seq, "big")
        for e in msgspec.msgpack.decode(payload)[1]:
            assert e["type"] != "AllBlocksCleared"
            assert e.get("medium") == "GPU", e.get("medium")
            for h in e["block_hashes"]:
                key = (e.get("group_idx") or 0, h64(h))
                if e["type"] == "BlockStored":
                    stored += 1
                    if copies.get(key, 0) > 0:
                        again.add((seq, h64(h)))
                    copies[key] = copies.get(key, 0) + 1
                else:
                    removed += 1
                    copies[key] = copies.get(key, 0) - 1
                    if copies[key] > 0:
                        while_res.add((seq, h64(h)))
    return stored, removed, again, while_res


def audit_offline(tmp_path, trace, messages, name):
    cap = tmp_path / f"{name}.frames"
    write_capture(cap, messages)
    r = run_kvtrace("audit-kv-events", "--trace", trace, "--kv-events-file", cap,
                    "--json", "-", "--limit", 10000)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def run_audited(argv, log, int_hashes, events, *audit_args, relay_from=None):
    """Runs the workload argv (its output in log) with the plugin, vLLM's
    hashes in their int form or as bytes, and audits it from the moment it
    is ready to its end on the publisher events, through a Proxy of the
    test's own from relay_from when given: (the Proxy or None, the audit's
    stdout)."""
    env = dict(os.environ, VLLM_PLUGINS="kvtrace",
               VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if int_hashes else "0")
    with open(log, "w") as f:
        wl = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                              start_new_session=True)
    audit = proxy = None
    try:
        deadline = time.monotonic() + 300
        while f"READY {wl.pid}" not in log.read_text():
            assert wl.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        if relay_from is not None:
            proxy = Proxy(relay_from, events)
        audit = Audit("-p", wl.pid, "--kv-events", events, *audit_args)
        audit.wait_attached(timeout=180)
        os.kill(wl.pid, signal.SIGUSR1)
        assert wl.wait(300) == 0, log.read_text()[-3000:]
        rc, stdout, err = audit.finish(timeout=300)
        assert rc == 0, err[-3000:]
        return proxy, stdout
    finally:
        if audit is not None:
            audit.kill()
        if proxy is not None:
            proxy.close()
        try:
            os.killpg(wl.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wl.wait()


def test_audit_kv_events_real_vllm(tmp_path, tiny_model, no_leftovers):
    port_vllm, port_audit = free_port(), free_port()
    out, log = tmp_path / "generated.json", tmp_path / "vllm.log"
    argv = [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(tiny_model),
            "--requests", REQUESTS, "--block-size", "32", "--out", str(out), "--wait",
            "--prefix-caching", "on", "--repeat", "2", "--num-gpu-blocks", "16",
            "--max-model-len", "256", "--shared-prefix", str(SHARED),
            "--kv-events-port", str(port_vllm)]
    # vLLM's hashes in its default int form (the other run has them as bytes)
    trace, js = tmp_path / "run.kvt", tmp_path / "audit.json"
    proxy, stdout = run_audited(argv, log, True, f"tcp://127.0.0.1:{port_audit}",
                                "-o", trace, "--json", js, "--limit", 10000,
                                relay_from=f"tcp://127.0.0.1:{port_vllm}")
    messages = proxy.messages
    stored, removed, again, while_res = vllm_replay(messages)
    assert removed > 0, "vLLM evicted nothing: the cache is too large"
    seqs = [int.from_bytes(m[1], "big") for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "the proxy lost a message"

    # the untouched stream: every event matched; vLLM's own discrepancies named
    clean = audit_offline(tmp_path, trace, messages, "clean")
    assert clean["matched"]["stored"] == stored and clean["matched"]["removed"] == removed
    assert clean["counts"]["missing"] == clean["counts"]["extra"] == 0, clean
    assert clean["counts"]["reuse_as_new"] == 0
    assert clean["edge"] == {"truth": 0, "stream": 0}
    assert {(x["seq"], x["hash"]) for x in clean["stored_again"]} == again
    assert {(x["seq"], x["hash"]) for x in clean["removed_while_resident"]} == while_res
    assert clean["clean"] == (not while_res)
    assert clean["drift"]["ghost"] == 0 and clean["drift"]["final_ghost"] == 0

    # live, through the proxy: exactly the dropped event is missing
    seq, place, event = proxy.dropped
    live = json.loads(js.read_text())
    (miss,) = live["missing"]
    assert (miss["kind"], miss["hash"]) == ("removed", h64(event["block_hashes"][0]))
    assert miss["near_seq"] == seq
    assert live["counts"]["extra"] == 0 and live["counts"]["reuse_as_new"] == 0
    # the indexer kept the dropped hash: a ghost
    assert live["drift"]["ghost"] >= 1
    assert "DISCREPANCIES" in stdout and "missing: 1" in stdout

    # offline: one BlockRemoved sent twice is exactly one extra event
    k = next(k for k, (_, _, p) in enumerate(messages)
             if any(e["type"] == "BlockRemoved" for e in msgspec.msgpack.decode(p)[1]))
    topic, sq, payload = messages[k]
    ts, events, *rest = msgspec.msgpack.decode(payload)
    i = next(i for i, e in enumerate(events) if e["type"] == "BlockRemoved")
    twice = messages[:k] + [(topic, sq, msgspec.msgpack.encode(
        [ts, events[:i + 1] + [events[i]] + events[i + 1:], *rest]))] + messages[k + 1:]
    dup = audit_offline(tmp_path, trace, twice, "dup")
    (x,) = dup["extra"]
    assert (x["kind"], x["hash"], x["seq"]) == \
        ("removed", h64(events[i]["block_hashes"][0]), int.from_bytes(sq, "big"))
    assert x["index"] in (i, i + 1)
    assert dup["counts"]["missing"] == 0 and dup["counts"]["reuse_as_new"] == 0


def test_audit_names_hits_announced_as_stored(tmp_path, tiny_model, no_leftovers):
    """kv_cache_report_mode="full": vLLM announces each request's prefix-cache
    hits as a BlockStored of hashes already stored (PR #51699).  The audit,
    live on vLLM's own publisher, names each as reuse_as_new: as many as
    vLLM's own per-request num_cached_tokens say it hit, in blocks.  A cache
    large enough that no request waits for blocks (a waiting request is
    looked up, and announces, again at each step) nor is evicted."""
    port = free_port()
    out, log = tmp_path / "generated.json", tmp_path / "vllm.log"
    # four 100-token prompts sharing 64 tokens (2 blocks), twice: in round
    # one the last three hit the first's 2 shared blocks, in round two
    # every request hits its own 3 full blocks of round one
    argv = [str(VLLM_PYTHON), str(WORKLOAD), "--model", str(tiny_model),
            "--requests", "100:2,100:2,100:2,100:2", "--block-size", "32", "--out", str(out),
            "--wait", "--prefix-caching", "on", "--repeat", "2", "--shared-prefix", "64",
            "--report-mode", "full", "--kv-events-port", str(port)]
    js = tmp_path / "audit.json"
    _, stdout = run_audited(argv, log, False, f"tcp://127.0.0.1:{port}",
                            "--json", js, "--limit", 10000)
    generated = json.loads(out.read_text())
    hits = sum(r["num_cached_tokens"] for r in generated["requests"]) // 32
    assert hits == 3 * 2 + 4 * 3, generated["requests"]  # as the run was built
    a = json.loads(js.read_text())
    assert a["counts"]["reuse_as_new"] == hits, a["counts"]
    assert a["counts"]["missing"] == a["counts"]["extra"] == 0, a
    assert a["counts"]["stored_again"] == 0 and a["truth"]["evicted"] == 0
    assert not a["clean"] and "reuse_as_new: 18" in stdout
    # each announced hash was resident, in the block that holds it
    assert all(x["resident_in"] for x in a["reuse_as_new"])
