"""Uprobes with the kernel owning the USDT semaphore (ref_ctr_offset): one
BPF uprobe_multi link per traced file and process (Linux 6.6+), or, where the
kernel has none, one perf_event_open `uprobe` PMU event per probe.

Why links first: a perf event opened for one process is in that task's perf
context, and the scheduler switches every such event out and in at each of
its context switches, hit or not.  A vLLM engine core switches thousands of
times a second; with its 10 plugin probes that was 0.14 us more per switch
here, and closing each event took the kernel about 100 ms (an RCU grace
period under a lock).  A link has no perf event: no cost at a context switch,
and one close for all its probes (docs/design.md, "One link per file").

Why not bcc's attach_uprobe / USDT class: those register text entries in
tracefs and, for USDT semaphores, write the target's memory themselves; a
tracer killed with SIGKILL then leaves the semaphores on for good.  Here the
kernel increments the semaphore when the event opens and decrements it when
the file descriptor closes, whatever way this process dies, and nothing is
ever written to tracefs or to the target.

The perf buffer's events (bpf_output_event) are opened here too: the
tracer's other perf_event_open, with the same attribute structure.
"""

import ctypes
import errno
import fcntl
import os
import platform
import re
import struct

from ..errors import EnvironmentProblem, TargetError
from .bpf import BPF_TRACE_UPROBE_MULTI, bpf_syscall, trivial_program

_PMU_DIR = "/sys/bus/event_source/devices/uprobe"
_SYS_perf_event_open = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400
_PERF_EVENT_IOC_SET_BPF = 0x40042408  # _IOW('$', 8, __u32)
_ATTR_DISABLED = 1  # first bit of the flags word
_ATTR_WATERMARK = 1 << 14  # wakeup_events holds bytes (wakeup_watermark)
_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_BPF_OUTPUT, _PERF_SAMPLE_RAW = 1, 10, 1 << 10

_BPF_LINK_CREATE = 28
# what a kernel without uprobe_multi links answers BPF_LINK_CREATE
_NO_MULTI = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, 524)  # 524: ENOTSUPP

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _PerfEventAttr(ctypes.Structure):
    # struct perf_event_attr up to PERF_ATTR_SIZE_VER5 (112 bytes)
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # uprobe_path
        ("config2", ctypes.c_uint64),  # probe_offset
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
    ]


def _pmu_format_shift(name: str) -> int:
    """Bit position of a uprobe PMU format field, e.g. 'config:32-63' -> 32."""
    try:
        with open(os.path.join(_PMU_DIR, "format", name)) as f:
            m = re.fullmatch(r"config:(\d+)(-\d+)?", f.read().strip())
    except FileNotFoundError:
        m = None
    if not m:
        raise EnvironmentProblem(
            f"this kernel's uprobe PMU has no '{name}' field "
            "(USDT semaphores through perf_event_open need Linux >= 4.20)")
    return int(m.group(1))


def pmu_type() -> int:
    try:
        with open(os.path.join(_PMU_DIR, "type")) as f:
            return int(f.read())
    except FileNotFoundError:
        raise EnvironmentProblem(
            "kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe): "
            "needs CONFIG_UPROBE_EVENTS") from None


def bpf_output_event(cpu: int, wakeup_events: int = 1, wakeup_bytes: int = 0) -> int:
    """A perf event for BPF_PERF_OUTPUT records on one CPU, as bcc's
    bpf_open_perf_buffer_opts() opens it, but with the choice of when the
    reader is woken: after every wakeup_events records, or, with
    wakeup_bytes > 0, whenever that many bytes were written since the last
    wake-up (perf's watermark, which bcc cannot set).  Each wake-up is an
    irq_work and an IPI: in a VM, exits to the hypervisor (docs/bench.md).
    The caller owns the fd, disabled until PERF_EVENT_IOC_ENABLE."""
    attr = _PerfEventAttr()
    attr.type = _PERF_TYPE_SOFTWARE
    attr.size = ctypes.sizeof(_PerfEventAttr)
    attr.config = _PERF_COUNT_SW_BPF_OUTPUT
    attr.sample_type = _PERF_SAMPLE_RAW
    attr.sample_period = 1
    attr.flags = _ATTR_DISABLED | (_ATTR_WATERMARK if wakeup_bytes > 0 else 0)
    attr.wakeup_events = wakeup_bytes if wakeup_bytes > 0 else wakeup_events
    fd = _libc.syscall(_SYS_perf_event_open, ctypes.byref(attr), -1, cpu, -1,
                       _PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open for the perf buffer on CPU {cpu}: "
                           f"{os.strerror(err)}")
    return fd


def enable(fd: int):
    fcntl.ioctl(fd, _PERF_EVENT_IOC_ENABLE, 0)


class NoUprobeMulti(Exception):
    """This kernel made no uprobe_multi link (the session says what to do:
    its programs, loaded for links, go on no perf event)."""


class UprobeLink:
    """Uprobes at `offsets` of one file, in one process (its every thread),
    with one BPF program: a BPF_TRACE_UPROBE_MULTI link, which the program
    must have been loaded for (the session loads every program so where it
    links).  The kernel owns each probe's semaphore (ref_ctr_offsets), as for
    a perf event.  close() detaches them all.  Raises NoUprobeMulti where the
    kernel makes no such link."""

    def __init__(self, path: str, offsets: list, pid: int, prog_fd: int,
                 ref_ctr_offsets: list, cookies=None):
        self.path, self.offsets, self.pid = path, tuple(offsets), pid
        n = len(offsets)
        path_buf = ctypes.create_string_buffer(os.fsencode(path))
        offs = (ctypes.c_uint64 * n)(*offsets)
        refs = (ctypes.c_uint64 * n)(*ref_ctr_offsets)
        # each probe's bpf_get_attach_cookie(): the program's row for it
        cooks = (ctypes.c_uint64 * n)(*cookies) if cookies else None
        attr = ctypes.create_string_buffer(64)  # union bpf_attr, link_create's part
        struct.pack_into("<IIIIQQQQIII", attr, 0, prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0,
                         ctypes.addressof(path_buf), ctypes.addressof(offs),
                         ctypes.addressof(refs) if any(ref_ctr_offsets) else 0,
                         ctypes.addressof(cooks) if cooks else 0, n, 0, pid)
        # (an architecture without a known bpf() number: ENOSYS, so perf events,
        # which say it is unsupported)
        fd = bpf_syscall(_BPF_LINK_CREATE, attr)
        if fd < 0:
            err = ctypes.get_errno()
            if err in _NO_MULTI:
                raise NoUprobeMulti(os.strerror(err))
            _raise_attach_error(err, f"{n} uprobes in {path} in pid {pid}", pid,
                                "BPF_LINK_CREATE")
        self.fd = fd

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def trial_link(attach_type: int) -> tuple:
    """(True, "") if this kernel makes a uprobe_multi link, else (False, why):
    one on this process's own program entry point, which it has run past,
    with a two-instruction program of that attach type, closed at once
    (`doctor`)."""
    from ..probes import sdt  # ELF parsing: only `doctor` needs it here
    if attach_type != BPF_TRACE_UPROBE_MULTI:
        return False, "the kernel refused a program of its attach type"
    exe = os.path.realpath("/proc/self/exe")
    offset = sdt.entry_offset(exe)
    if offset is None:
        return False, f"no entry point in {exe}"
    prog_fd = trivial_program(attach_type)
    if prog_fd < 0:
        return False, os.strerror(ctypes.get_errno())
    try:
        UprobeLink(exe, [offset], os.getpid(), prog_fd, [0]).close()
        return True, ""
    except NoUprobeMulti as e:
        return False, str(e)
    finally:
        os.close(prog_fd)


def _raise_attach_error(err: int, where: str, pid: int, call: str):
    if err in (errno.EPERM, errno.EACCES):
        raise EnvironmentProblem(f"{where}: permission denied (needs root or CAP_PERFMON)")
    if err == errno.ESRCH:
        raise TargetError(f"{where}: process {pid} exited")
    if err == errno.ENOENT:
        raise TargetError(f"{where}: file is gone")
    raise EnvironmentProblem(f"{where}: {call}: {os.strerror(err)}")


class Uprobe:
    """One uprobe perf event with a BPF program attached. close() detaches."""

    def __init__(self, path: str, offset: int, pid: int, prog_fd: int,
                 ref_ctr_offset: int = 0):
        if _SYS_perf_event_open is None:
            raise EnvironmentProblem(f"unsupported architecture {platform.machine()}")
        self.path, self.offsets, self.pid = path, (offset,), pid
        where = f"uprobe {path}:{offset:#x} in pid {pid}"
        path_buf = ctypes.create_string_buffer(os.fsencode(path))
        attr = _PerfEventAttr()
        attr.type = pmu_type()
        attr.size = ctypes.sizeof(_PerfEventAttr)
        attr.config = ref_ctr_offset << _pmu_format_shift("ref_ctr_offset") if ref_ctr_offset else 0
        attr.sample_period = 1
        attr.wakeup_events = 1
        attr.flags = _ATTR_DISABLED
        attr.config1 = ctypes.addressof(path_buf)
        attr.config2 = offset
        fd = _libc.syscall(_SYS_perf_event_open, ctypes.byref(attr), pid, -1, -1,
                           _PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            _raise_attach_error(ctypes.get_errno(), where, pid, "perf_event_open")
        self.fd = fd
        try:
            fcntl.ioctl(fd, _PERF_EVENT_IOC_SET_BPF, prog_fd)
            enable(fd)
        except OSError as e:
            self.close()
            raise EnvironmentProblem(f"cannot attach BPF program to {where}: {e.strerror}") from None

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
