"""User stack addresses to `function [module]`, through bcc's symbolizer in a
child process.

Why a child: bcc 0.26's symbolizer closes a file descriptor it never
opened.  `ProcSyms::ModulePath` leaves its `fd_` uninitialized on one path
(the `/tmp/perf-PID.map` it tries for every process) and its destructor
closes whatever number is there (iovisor/bcc#5193, fixed in bcc 0.33;
Debian 12 ships 0.26).  In the tracer that number was stderr: the run's
messages, its summary included, were lost.  It could as well be a map or
the perf event that holds a probe.  So the symbolizer runs in a process that
holds nothing of the tracer's.  A number it closes there costs at most
that process; then the rest of the stacks come out as `[unknown]`.

The protocol, one line each way: `PID ADDR` (ADDR in hex), answered by a
JSON list [name or null, module or null].  The first request for a pid
builds its symbol cache: bcc reads /proc/PID/maps then and keeps it, so a
tracer asks once while the target lives (session.Tracer.add_probes).
"""

import atexit
import ctypes
import fcntl
import json
import os
import subprocess
import sys

from .. import abi
from .bpf import Symbol, libbcc_bpf


class Symbolizer:
    """The tracer's side: one child, started on the first lookup."""

    def __init__(self):
        self._child = None
        self._dead = False
        atexit.register(self.close)

    def sym(self, addr: int, pid: int, show_module: bool = False) -> bytes:
        """A user address as `function [module]`, demangled, or `[unknown]`:
        what bcc's BPF.sym gives."""
        name, module = self._ask(pid, addr)
        label = name.encode(errors="surrogateescape") if name else b"[unknown]"
        if show_module and module is not None:
            label += b" [%s]" % os.path.basename(module.encode(errors="surrogateescape"))
        return label

    def _ask(self, pid: int, addr: int):
        if self._dead:
            return None, None
        try:
            if self._child is None:
                self._child = subprocess.Popen(
                    [sys.executable, "-m", "tracer.kernel.symbolize"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                    # its own session: the Ctrl-C that stops a trace must not
                    # stop it before the summary's stacks are named
                    start_new_session=True,
                    env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                        [str(abi.BPF_DIR.parent)] +
                        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
            self._child.stdin.write(f"{pid} {addr:x}\n")
            self._child.stdin.flush()
            line = self._child.stdout.readline()
            name, module = json.loads(line)
            return name, module
        except (OSError, ValueError):  # it died: what is left stays unnamed
            self._dead = True
            self.close()
            return None, None

    def close(self):
        child, self._child = self._child, None
        if child is not None:
            try:
                child.stdin.close()  # end of input: it exits
            except OSError:
                pass
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _serve(requests, replies) -> int:
    lib = libbcc_bpf()
    caches = {}
    for line in requests:
        pid_s, addr_s = line.split()
        pid, addr = int(pid_s), int(addr_s, 16)
        cache = caches.get(pid)
        if cache is None:
            cache = caches[pid] = lib.bcc_symcache_new(pid, None)
        sym, name, module = Symbol(), None, None
        if lib.bcc_symcache_resolve(cache, addr, ctypes.byref(sym)) == 0:
            name = sym.demangle_name  # a copy: freed next
            lib.bcc_symbol_free_demangle_name(ctypes.byref(sym))
            module = ctypes.cast(sym.module, ctypes.c_char_p).value
        elif sym.module and sym.offset:  # in a known file, but no symbol
            module = ctypes.cast(sym.module, ctypes.c_char_p).value
        replies.write(json.dumps([None if name is None else name.decode(errors="surrogateescape"),
                                  None if module is None else
                                  module.decode(errors="surrogateescape")]) + "\n")
        replies.flush()
    return 0


def _main() -> int:
    # The requests and replies move to numbers far above what bcc's stray
    # close is likely to hold (a small one, from the heap), and 0-2 point
    # at /dev/null: what it closes there is nothing.
    rfd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 512)
    wfd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 512)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    with os.fdopen(rfd, "r") as requests, os.fdopen(wfd, "w") as replies:
        return _serve(requests, replies)


if __name__ == "__main__":
    sys.exit(_main())
