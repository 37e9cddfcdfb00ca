"""vLLM's own KV event stream, decoded (docs/kv-events.md).

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'`) publishes, once per engine step that changed its prefix
cache, a ZMQ multipart message (topic, seq as 8 bytes big-endian, payload).
The payload is msgpack of vllm/distributed/kv_events.py's msgspec types:
KVEventBatch, an array-like struct [ts, events, data_parallel_rank], whose
events are tagged structs (maps with a "type" key): BlockStored,
BlockRemoved, AllBlocksCleared.

The structs below are the same schema cut to the fields the audit needs:
msgspec skips every other field of the payload without building it, so a
BlockStored's token_ids (the prompt) are never decoded, kept or printed
(docs/safety.md).  vLLM itself is never imported.
"""

import struct
import threading
from dataclasses import dataclass
from typing import Optional, Union

import msgspec

from ..errors import DataError


class _Event(msgspec.Struct, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list
    parent_block_hash: Union[bytes, int, None] = None
    block_size: int = 0
    medium: Optional[str] = None
    group_idx: Optional[int] = None


class BlockRemoved(_Event):
    block_hashes: list
    medium: Optional[str] = None
    group_idx: Optional[int] = None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_decoder = msgspec.msgpack.Decoder(_Batch)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass
class Event:
    """One event of a batch: kind (STORED, REMOVED, CLEARED), the KV-cache
    group, the 64-bit content hashes (as the plugin's probes give them:
    hash64), the medium ("GPU" for vLLM's own pool)."""
    kind: str
    group: int
    hashes: list
    medium: Optional[str]


@dataclass
class Batch:
    seq: int
    ts: float
    events: list
    rank: Optional[int] = None


def hash64(h) -> int:
    """The plugin's 64-bit content hash of an event's block hash (plugin/
    kvtrace_vllm/hooks.py _content_hash).  vLLM publishes either its int
    form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default): the hash's
    last 8 bytes, big-endian, which is the plugin's hash itself; or the
    hash's bytes (=0), of which the same 8 bytes are taken."""
    if isinstance(h, int):
        return h & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(bytes(h[-8:]), "big")


def decode(seq: int, payload: bytes) -> Batch:
    """One message's payload; a DataError if it is not a KVEventBatch."""
    try:
        b = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DataError(f"KV event message {seq} is not vLLM's KVEventBatch: {e}") from None
    out = []
    for e in b.events:
        if isinstance(e, AllBlocksCleared):
            out.append(Event(CLEARED, 0, [], None))
        else:
            out.append(Event(STORED if isinstance(e, BlockStored) else REMOVED,
                             e.group_idx or 0, [hash64(h) for h in e.block_hashes], e.medium))
    return Batch(seq, b.ts, out, b.data_parallel_rank)


def from_frames(frames) -> Batch:
    """A multipart message (topic, seq, payload) -> Batch."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise DataError(f"not a KV event message: {len(frames)} frames")
    return decode(int.from_bytes(frames[1], "big", signed=True), frames[2])


def read_capture(path: str) -> list:
    """Batches of a capture file: the messages as they came off the socket,
    each of its three frames prefixed by its length (4 bytes, big-endian)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    frames, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise DataError(f"{path}: truncated at byte {at}")
        (n,) = struct.unpack_from(">I", data, at)
        if at + 4 + n > len(data):
            raise DataError(f"{path}: truncated at byte {at}")
        frames.append(data[at + 4:at + 4 + n])
        at += 4 + n
    if len(frames) % 3:
        raise DataError(f"{path}: {len(frames)} frames, not whole messages of 3")
    return [from_frames(frames[i:i + 3]) for i in range(0, len(frames), 3)]


class Subscriber:
    """A ZMQ SUB socket on vLLM's publisher, read in a thread: every batch
    decoded as it comes (the payload's bytes dropped at once)."""

    def __init__(self, endpoint: str, topic: str = ""):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # the auditor keeps up or lags; never drops
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self.batches = []
        self.error = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self):
        poller = self._zmq.Poller()
        poller.register(self._sock, self._zmq.POLLIN)
        try:
            while True:
                if not poller.poll(100):
                    if self._stop.is_set():
                        return
                    continue
                self.batches.append(from_frames(self._sock.recv_multipart()))
        except Exception as e:  # noqa: BLE001 - reported by close()
            self.error = e

    def close(self) -> list:
        """Stop after what has arrived; the batches, in arrival order."""
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()
        if self.error is not None:
            raise self.error
        return self.batches
