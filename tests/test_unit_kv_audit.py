"""The KV-event audit's comparison (tracer/analysis/kv_audit.py) on
hand-worked streams, and the decoding of vLLM's msgpack (trace/kv_events.py)
on payloads built here to vLLM's schema (vllm/distributed/kv_events.py)."""

from types import SimpleNamespace as NS

import msgspec
import pytest

from tracer.analysis import kv_audit as ka
from tracer.errors import DataError
from tracer.trace import kv_events

S, R = ka.STORED, ka.REMOVED


def T(kind, h, block, req=1, group=0, ts_ns=0):
    return ka.Truth(kind, group, h, block, req, ts_ns)


def batch(seq, *events, ts=0.0):
    return NS(seq=seq, ts=ts, events=[NS(kind=k, group=0, hashes=list(hs), medium="GPU")
                                      for k, *hs in events])


def run(truth, batches, **kw):
    said, facts = ka.stream_items(batches)
    return ka.audit(truth, said, facts, **kw)


# a request caches 3 blocks, another evicts two of them
TRUTH = [T(S, 1, 10), T(S, 2, 11), T(S, 3, 12), T(R, 1, 10, 2), T(S, 4, 10, 2),
         T(R, 2, 11, 2), T(S, 5, 11, 2)]
STREAM = [batch(0, (S, 1, 2, 3)), batch(1, (R, 1), (S, 4), (R, 2), (S, 5))]


def test_a_truthful_stream_is_clean():
    a = run(TRUTH, STREAM)
    assert a["clean"] and a["matched"] == {S: 5, R: 2, "cleared": 0}
    assert a["counts"] == dict.fromkeys(a["counts"], 0)
    assert a["drift"]["ghost"] == a["drift"]["unseen"] == 0
    assert (a["drift"]["final_ghost"], a["drift"]["final_unseen"]) == (0, 0)


def test_a_dropped_removal_is_missing_and_leaves_a_ghost():
    stream = [batch(0, (S, 1, 2, 3)), batch(1, (R, 1), (S, 4), (S, 5))]
    a = run(TRUTH, stream)
    assert not a["clean"]
    assert a["counts"]["missing"] == 1 and a["counts"]["extra"] == 0
    (m,) = a["missing"]
    assert (m["kind"], m["hash"], m["block"]) == (R, f"{2:016x}", 11)
    # the indexer still believes hash 2: one ghost from then on
    assert a["drift"]["ghost"] == 1 and a["drift"]["final_ghost"] == 1


def test_a_duplicated_store_is_extra():
    stream = [batch(0, (S, 1, 2, 3)), batch(1, (R, 1), (S, 4), (S, 4), (R, 2), (S, 5))]
    a = run(TRUTH, stream)
    assert a["counts"]["missing"] == 0
    # hash 4 is resident when the copy of its event comes: reuse_as_new, the
    # one finding that names a stored event for a resident hash with no new copy
    assert a["counts"]["extra"] + a["counts"]["reuse_as_new"] == 1
    (x,) = a["extra"] + a["reuse_as_new"]
    assert (x["hash"], x["seq"]) == (f"{4:016x}", 1)


def test_an_event_that_never_happened_is_extra():
    stream = [batch(0, (S, 1, 2, 3)), batch(1, (R, 1), (S, 4), (R, 7), (R, 2), (S, 5))]
    a = run(TRUTH, stream)
    assert a["counts"]["extra"] == 1 and a["extra"][0]["hash"] == f"{7:016x}"
    assert a["counts"]["missing"] == 0


def test_removal_while_another_copy_lives():
    # two requests computed hash 1 into blocks 10 and 20; 10 is evicted
    truth = [T(S, 1, 10), T(S, 9, 11), T(S, 1, 20, 2), T(R, 1, 10, 3), T(S, 8, 10, 3)]
    stream = [batch(0, (S, 1, 9)), batch(1, (S, 1)), batch(2, (R, 1), (S, 8))]
    a = run(truth, stream)
    assert a["counts"]["stored_again"] == 1 and a["stored_again"][0]["also_in"] == [10]
    (r,) = a["removed_while_resident"]
    assert (r["hash"], r["block"], r["still_in"], r["seq"]) == (f"{1:016x}", 10, [20], 2)
    # the indexer dropped hash 1, which block 20 still holds
    assert a["drift"]["unseen"] == 1 and a["drift"]["final_unseen"] == 1
    assert not a["clean"]


def test_reuse_announced_as_new():
    # kv_cache_report_mode="full": a hit on hashes 1, 2 re-announced as stored
    truth = [T(S, 1, 10), T(S, 2, 11), T(S, 3, 12), T(S, 4, 13, 2)]
    stream = [batch(0, (S, 1, 2, 3)), batch(1, (S, 1, 2), (S, 4))]
    a = run(truth, stream)
    assert [x["hash"] for x in a["reuse_as_new"]] == [f"{1:016x}", f"{2:016x}"]
    assert a["reuse_as_new"][0]["resident_in"] == [10]
    assert a["counts"]["extra"] == a["counts"]["missing"] == 0


def test_reordered_inside_a_step_is_matched():
    stream = [batch(0, (S, 1, 2, 3)), batch(1, (S, 4), (R, 1), (R, 2), (S, 5))]
    a = run(TRUTH, stream)
    assert a["counts"]["missing"] == a["counts"]["extra"] == 0
    assert a["matched"][S] + a["matched"][R] == len(TRUTH)


def test_a_lost_message_is_a_seq_gap():
    stream = [batch(0, (S, 1, 2, 3)), batch(2, (R, 1), (S, 4), (R, 2), (S, 5))]
    a = run(TRUTH, stream + [batch(3, (S, 6))])
    assert a["stream"]["seq_gaps"] == [[1, 1]] and not a["clean"]


def test_cleared_covers_the_reset_evictions():
    truth = [T(S, 1, 10), T(S, 2, 11), T(S, 3, 12), T(R, 1, 10, 0), T(R, 2, 11, 0),
             T(R, 3, 12, 0), T(S, 4, 10)]
    stream = [batch(0, (S, 1, 2, 3)), batch(1, ("cleared",)), batch(2, (S, 4))]
    a = run(truth, stream)
    assert a["clean"] and a["cleared_evictions"] == 3
    assert a["drift"]["final_ghost"] == a["drift"]["final_unseen"] == 0


def test_edges_are_not_judged():
    # the tracer attached after the stream's first batch
    stream = [batch(-1, (S, 7))] + STREAM
    a = run(TRUTH, [NS(seq=b.seq + 1, ts=0.0, events=b.events) for b in stream])
    assert a["clean"] and a["edge"] == {"truth": 0, "stream": 1}


def test_the_end_is_judged_but_for_what_lies_past_either_side():
    # wall clock = trace clock + 100 s; each batch published 1 ms after its step
    truth = [T(S, 1, 10, ts_ns=1_000), T(S, 2, 11, ts_ns=2_000_000_000),
             T(S, 3, 12, ts_ns=3_000_000_000), T(S, 4, 13, ts_ns=9_000_000_000)]
    stream = [batch(0, (S, 1), ts=100.001), batch(1, (S, 2), ts=102.001),
              batch(2, (S, 7), ts=103.001), batch(3, (S, 8), ts=104.001)]
    a = run(truth, stream, trace_end_ns=3_500_000_000)
    # hash 3 was never announced though batches came after it: missing; hash
    # 7 came while tracing: extra; hash 8 was published after the recording
    # ended and hash 4 cached after the last batch came: neither is judged
    assert [m["hash"] for m in a["missing"]] == [f"{3:016x}"]
    assert [x["hash"] for x in a["extra"]] == [f"{7:016x}"]
    assert a["edge"] == {"truth": 1, "stream": 1}
    # without the clocks, all of it is judged
    a = run([T(t.kind, t.hash, t.block) for t in truth],
            [NS(seq=b.seq, ts=0.0, events=b.events) for b in stream])
    assert a["counts"]["missing"] == 2 and a["counts"]["extra"] == 2


# -- decoding, to vLLM's wire format ----------------------------------------

def payload(events, ts=1.5, rank=0):
    """A KVEventBatch as vLLM's msgspec encodes it: an array [ts, events,
    rank], each event a map tagged by "type" (omit_defaults)."""
    return msgspec.msgpack.encode([ts, events, rank])


def test_decode_takes_the_first_8_bytes_little_endian_and_no_tokens():
    h = bytes(range(32))
    p = payload([{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                  "token_ids": [5, 6, 7], "block_size": 16, "lora_id": None,
                  "medium": "GPU", "lora_name": None, "group_idx": 1},
                 {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
                 {"type": "AllBlocksCleared"}])
    b = kv_events.decode(4, p)
    assert b.seq == 4 and b.ts == 1.5
    st, rm, cl = b.events
    assert (st.kind, st.group, st.hashes) == ("stored", 1, [int.from_bytes(h[-8:], "big")])
    assert (rm.kind, rm.group) == ("removed", 0) and cl.kind == "cleared"
    assert not hasattr(st, "token_ids")


def test_int_hashes_are_the_bytes_last_8_big_endian():
    """vLLM's int form of a hash (maybe_convert_block_hash) and its bytes
    decode to the same key, the plugin's (hooks.py _content_hash)."""
    h = bytes(range(1, 33))
    as_int = int.from_bytes(h, "big") & (2**64 - 1)
    p = payload([{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
                 {"type": "BlockRemoved", "block_hashes": [as_int], "medium": "GPU"}])
    a, b = kv_events.decode(0, p).events
    assert a.hashes == b.hashes == [0x191A1B1C1D1E1F20]


def test_a_capture_file_and_its_damage(tmp_path):
    p = payload([{"type": "BlockRemoved", "block_hashes": [b"\1" * 32], "medium": "GPU"}])
    frames = [b"", (7).to_bytes(8, "big"), p]
    data = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    f = tmp_path / "ev.frames"
    f.write_bytes(data)
    (b,) = kv_events.read_capture(str(f))
    assert b.seq == 7 and b.events[0].hashes == [int.from_bytes(b"\1" * 8, "big")]
    f.write_bytes(data[:-3])
    with pytest.raises(DataError, match="truncated"):
        kv_events.read_capture(str(f))
    f.write_bytes(data[:4] + (7).to_bytes(4, "big") + b"\0" * 7 + data[16:])
    with pytest.raises(DataError, match="not a KV event message"):
        kv_events.read_capture(str(f))
