"""The perf buffer's records as they come: the BPF program's two record
kinds (bpf/kvtrace.h), and `Collector`, the perf callback's end, which
sorts them into flat byte arrays and nothing more, so the callback stays
cheap.  trace/stream.py decodes what it collected.
"""

import ctypes
from dataclasses import dataclass

from .. import abi

EVENT = abi.struct_dtype("kvtrace_event")
CHUNK_HDR = abi.struct_dtype("kvtrace_chunk_hdr")
REC_OP = abi.RECORD_TYPES["op"]
REC_CHUNK = abi.RECORD_TYPES["chunk"]


@dataclass
class RawBatch:
    """Records as they came, in three flat byte strings."""

    ops: bytes  # struct kvtrace_event records (bytes or bytearray)
    chunk_hdrs: bytes  # struct kvtrace_chunk_hdr records
    values: bytes  # every chunk's int64 values, in chunk order
    values_at: int = None  # a trace file's: where values lie in it (a byte offset)

    @property
    def empty(self) -> bool:
        return not (self.ops or self.chunk_hdrs)


class Collector:
    """The perf-buffer callback's end: raw records into flat byte arrays."""

    def __init__(self):
        self.op_records = 0
        self.chunk_records = 0
        self.unknown_records = 0
        self._ops, self._hdrs, self._values = bytearray(), bytearray(), bytearray()

    def add(self, data: int, size: int) -> int:
        """One raw record (address and size, as bcc hands them over).
        Returns its type."""
        rtype = ctypes.c_uint32.from_address(data).value
        if rtype == REC_OP and size >= EVENT.itemsize:
            self._ops += ctypes.string_at(data, EVENT.itemsize)
            self.op_records += 1
        elif rtype == REC_CHUNK and size >= CHUNK_HDR.itemsize:
            count = ctypes.c_uint32.from_address(data + 4).value
            if count == 0:  # the end of an array of a multiple of 512 values
                return rtype
            if count <= abi.RECORD_VALUES and size >= CHUNK_HDR.itemsize + 8 * count:
                self._hdrs += ctypes.string_at(data, CHUNK_HDR.itemsize)
                self._values += ctypes.string_at(data + CHUNK_HDR.itemsize, 8 * count)
                self.chunk_records += 1
            else:
                self.unknown_records += 1
        else:
            self.unknown_records += 1
        return rtype

    @property
    def pending_bytes(self) -> int:
        return len(self._ops) + len(self._hdrs) + len(self._values)

    def take(self) -> RawBatch:
        """Everything collected since the last take() (handed over, not copied)."""
        batch = RawBatch(self._ops, self._hdrs, self._values)
        self._ops, self._hdrs, self._values = bytearray(), bytearray(), bytearray()
        return batch
