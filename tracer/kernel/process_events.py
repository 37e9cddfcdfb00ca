"""Execs and new processes, node-wide, from two tracepoints (the agent).

Perf events on sched:sched_process_exec and task:task_newtask, one per CPU
each, whose raw records (the tracepoints' own fields) are read with bcc's
perf reader from libbcc_bpf: no BPF program, no compiler.  task_newtask
fires for every thread too; those (CLONE_THREAD) are dropped here, in the
callback.  probes/node.py decides what a new process is to the agent.
"""

import ctypes
import os
import re

from ..errors import EnvironmentProblem
from . import uprobes
from .bpf import LOST_CB, RAW_CB, libbcc_bpf
from .program import _online_cpus

CLONE_THREAD = 0x00010000
EXEC, FORK = 1, 2
# (kind, tracepoint, the field read: its pid)
TRACEPOINTS = ((EXEC, "sched/sched_process_exec", "pid"),
               (FORK, "task/task_newtask", "pid"))
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
_PERF_TYPE_TRACEPOINT = 2


def _tracepoint(name: str) -> tuple:
    """(id, {field: (offset, size)}) of a tracepoint, from tracefs."""
    for root in TRACEFS:
        try:
            with open(f"{root}/events/{name}/id") as f:
                tp_id = int(f.read())
            with open(f"{root}/events/{name}/format") as f:
                text = f.read()
        except OSError:
            continue
        fields = {}
        for m in re.finditer(r"field:[^;]*?(\w+)(?:\[\d*\])?;\s*offset:(\d+);\s*size:(\d+);",
                             text):
            fields[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        return tp_id, fields
    raise EnvironmentProblem(f"no tracepoint {name} in tracefs (mounted at "
                             f"{TRACEFS[0]}? `make setup` mounts it)")


class ProcessEvents:
    """Execs and new processes, node-wide: one perf event per CPU on each of
    TRACEPOINTS, whose raw records (the tracepoint's fields, no BPF
    program) are read with bcc's perf reader.  task_newtask fires for
    threads too: those (CLONE_THREAD) are dropped here."""

    def __init__(self, pages: int = 16):
        self.pending, self.lost = [], 0
        self._readers, self._callbacks = [], []
        lib = libbcc_bpf()
        try:
            for kind, name, field in TRACEPOINTS:
                tp_id, fields = _tracepoint(name)
                pid_at = fields[field][0]
                flags_at = fields["clone_flags"][0] if kind == FORK else None
                for cpu in _online_cpus():
                    fd = self._open(tp_id, cpu, name)

                    def raw(_cookie, data, size, kind=kind, pid_at=pid_at, flags_at=flags_at):
                        buf = ctypes.string_at(data, size)
                        if flags_at is not None and \
                                int.from_bytes(buf[flags_at:flags_at + 8], "little") & CLONE_THREAD:
                            return
                        self.pending.append((kind, int.from_bytes(buf[pid_at:pid_at + 4],
                                                                  "little")))

                    raw_fn = RAW_CB(raw)
                    lost_fn = LOST_CB(lambda _cookie, n: self._lost(n))
                    reader = lib.perf_reader_new(raw_fn, lost_fn, None, pages)
                    if not reader:
                        os.close(fd)
                        raise OSError(ctypes.get_errno(), "perf_reader_new")
                    self._readers.append(reader)  # perf_reader_free closes its fd
                    self._callbacks.append((raw_fn, lost_fn))
                    lib.perf_reader_set_fd(reader, fd)
                    if lib.perf_reader_mmap(reader) < 0:
                        raise OSError(ctypes.get_errno(), f"mapping the {name} buffer")
                    uprobes.enable(fd)
        except OSError as e:
            self.close()
            raise EnvironmentProblem(f"cannot follow execs and forks: {e.strerror or e}") \
                from None
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(tp_id, cpu, name) -> int:
        attr = uprobes._PerfEventAttr()
        attr.type = _PERF_TYPE_TRACEPOINT
        attr.size = ctypes.sizeof(attr)
        attr.config = tp_id
        attr.sample_type = uprobes._PERF_SAMPLE_RAW
        attr.sample_period = 1
        attr.wakeup_events = 1
        attr.flags = uprobes._ATTR_DISABLED
        fd = uprobes._libc.syscall(uprobes._SYS_perf_event_open, ctypes.byref(attr), -1, cpu,
                                   -1, uprobes._PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"perf_event_open of {name} on CPU {cpu}: {os.strerror(err)}")
        return fd

    def _lost(self, count):
        self.lost += count

    def take(self) -> list:
        """[(kind, pid)] since the last take, without waiting."""
        if self._readers:
            arr = (ctypes.c_void_p * len(self._readers))(*self._readers)
            libbcc_bpf().perf_reader_poll(len(self._readers), arr, 0)
        out, self.pending = self.pending, []
        return out

    def close(self):
        for reader in self._readers:
            libbcc_bpf().perf_reader_free(reader)
        self._readers, self._callbacks = [], []
