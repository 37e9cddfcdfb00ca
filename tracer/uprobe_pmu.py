"""Uprobes through perf_event_open's `uprobe` PMU, with the kernel owning the
USDT semaphore (ref_ctr_offset).

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

from .errors import EnvironmentProblem, TargetError

_PMU_DIR = "/sys/bus/event_source/devices/uprobe"
_SYS_perf_event_open = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400
_PERF_EVENT_IOC_SET_BPF = 0x40042408  # _IOW('$', 8, __u32)
_ATTR_DISABLED = 1  # first bit of the flags word
_ATTR_WATERMARK = 1 << 14  # wakeup_events holds bytes (wakeup_watermark)
_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_BPF_OUTPUT, _PERF_SAMPLE_RAW = 1, 10, 1 << 10

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


class Uprobe:
    """One uprobe perf event with a BPF program attached. close() detaches."""

    def __init__(self, path: str, offset: int, pid: int, prog_fd: int,
                 ref_ctr_offset: int = 0):
        if _SYS_perf_event_open is None:
            raise EnvironmentProblem(f"unsupported architecture {platform.machine()}")
        self.path, self.offset, self.pid = path, offset, pid
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
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES):
                raise EnvironmentProblem(f"{where}: permission denied (needs root or CAP_PERFMON)")
            if err == errno.ESRCH:
                raise TargetError(f"{where}: process {pid} exited")
            if err == errno.ENOENT:
                raise TargetError(f"{where}: file is gone")
            raise EnvironmentProblem(f"{where}: perf_event_open: {os.strerror(err)}")
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
