"""The traced target: start a command paused at its entry point, or watch an
existing pid, and notice when it exits."""

import errno
import os
import select
import shutil
import signal
import time

from ..errors import TargetError
from . import sdt


class Target:
    """A process we trace: exited() polls without blocking."""

    def __init__(self, pid: int, child: bool):
        self.pid, self.child = pid, child
        self.status = None  # exit status once known (children only)
        # readable once the process has exited: exited() polls it, and the
        # tracing loop sleeps on it (exit_fd).  A child's too: its status
        # still comes from waitpid
        self._pidfd = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            if not child:
                raise TargetError(f"no process with pid {pid}") from None
        except OSError:
            self._pidfd = None  # old kernel: fall back to kill(0), waitpid

    @property
    def exit_fd(self):
        """A descriptor that polls readable once the target has exited, or
        None (a kernel without pidfd_open)."""
        return self._pidfd

    def exited(self) -> bool:
        if self.child:
            if self.status is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.status = os.waitstatus_to_exitcode(status)
            return self.status is not None
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        try:
            os.kill(self.pid, 0)
            return False
        except ProcessLookupError:
            return True

    def end_child(self, grace: float = 5.0):
        """End a command we started, and everything it started: the command
        runs in its own process group (launch), and vLLM's engine and
        worker processes outlive their parent unless signalled themselves.
        A command that exited on its own gets `grace` seconds for the rest
        of its group to leave; then SIGTERM, then SIGKILL.  Reaps the
        command (no zombie left behind)."""
        if not self.child:
            return
        if self.exited() and self._group_gone(grace):
            return
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a stopped process acts on nothing else
        if not self._group_gone(grace):
            self._signal_group(signal.SIGKILL)
            self._group_gone(grace)
        if self.status is None:
            _, status = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(status)

    def _signal_group(self, sig):
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def _group_gone(self, timeout: float) -> bool:
        """Wait until no process is left in the command's group (reaping the
        command itself as it exits)."""
        deadline = time.monotonic() + timeout
        while True:
            self.exited()
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return True
            if time.monotonic() >= deadline:
                return False
            select.select([], [], [], 0.05)

    def close(self):
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def check_pid(pid: int):
    if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise TargetError(f"no process with pid {pid}")


def resolve_command(argv: list) -> str:
    exe = shutil.which(argv[0])
    if exe is None:
        if os.sep in argv[0] and os.path.exists(argv[0]):
            # a path that is there but cannot run: say why, as the shell does
            why = "is a directory" if os.path.isdir(argv[0]) else os.strerror(errno.EACCES)
            raise TargetError(f"cannot execute {argv[0]}: {why}")
        raise TargetError(f"command not found: {argv[0]}" + (
            f": {os.strerror(errno.ENOENT)}" if os.sep in argv[0] else ""))
    return os.path.realpath(exe)


def launch(argv: list, tracer, wait_for_entry=True, cpus=None) -> Target:
    """Fork argv held at a gate; with an ELF executable, have the BPF side
    stop it at its entry point (libraries mapped, no code of its own run) and
    return with it stopped.  The caller attaches, then sends SIGCONT.
    cpus: the CPUs the command may use (attach --cpu pins the tracer only)."""
    exe = resolve_command(argv)
    entry = sdt.entry_offset(exe) if wait_for_entry else None
    gate_r, gate_w = os.pipe()
    # the exec's errno, if it fails; closed by a successful exec (O_CLOEXEC),
    # so that the parent's read ends either way
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # child: wait for the gate, then become the command
        try:
            os.close(gate_w)
            os.close(err_r)
            os.setpgid(0, 0)  # its own process group: end_child ends all of it
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if os.read(gate_r, 2) == b"go":
                os.execv(exe, argv)
        except OSError as e:
            os.write(err_w, str(e.errno).encode())
        except BaseException:
            pass
        os._exit(127)
    os.close(gate_r)
    os.close(err_w)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first
    except OSError:
        pass
    target = Target(pid, child=True)
    entry_probe = None
    try:
        try:
            if entry is not None:
                entry_probe = tracer.stop_at_entry(pid, exe, entry)
            else:
                tracer.track(pid)
            os.write(gate_w, b"go")
        finally:
            os.close(gate_w)  # without "go" the child exits instead of exec
        failed = _read_all(err_r)
        if failed:  # a bad #! line, an unknown binary format, ...
            _, status = os.waitpid(pid, 0)
            target.status = os.waitstatus_to_exitcode(status)
            raise TargetError(f"cannot execute {argv[0]}: {os.strerror(int(failed))}")
        if entry_probe is not None:
            _, status = os.waitpid(pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                target.status = os.waitstatus_to_exitcode(status)
                raise TargetError(f"{argv[0]} exited (status {target.status}) before it started")
    except BaseException:
        if target.status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(err_r)
        if entry_probe is not None:
            entry_probe.close()
    return target


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 64):
        data += chunk
    return data
