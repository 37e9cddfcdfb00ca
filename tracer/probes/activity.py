"""What the target is doing while no probe of it has fired yet.

vLLM takes from seconds to minutes before its first cache op: its processes
import torch and vLLM one after another, load the model, warm up, then wait
for a request.  A live view that says only "(no ops yet)" all that time
reads as a tracer that sees nothing.  So, until the first op, each refresh
looks at the traced tree in /proc (each process's CPU time, and whether any
maps a probe site yet) and at the last line of the target's log, where the
tracer can read it: the file that `-- CMD`'s output goes to, or, for `-p`,
a regular file that the process's stdout or stderr points at (vLLM says
there what it is doing: "Starting to load model", "init engine ...").
Only the log's last line is read, and only before the first op.
"""

import os

# Below this share of one CPU over the last look, the tree is idle: vLLM's
# worker, waiting for a request, naps and wakes for about 2% of a CPU.
IDLE_SHARE = 0.10
TAIL_BYTES = 4096
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int):
    """utime + stime of pid, in clock ticks; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def log_of(pid: int):
    """The regular file that pid's stderr, or else its stdout, writes to;
    None for a terminal, a pipe or nothing."""
    for fd in (2, 1):
        try:
            path = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if path.startswith("/") and os.path.isfile(path):
            return path
    return None


def last_line(path: str) -> str:
    """The last non-empty line of the file's last TAIL_BYTES; '' if none
    or unreadable.  vLLM ends progress lines with \\r: the last part counts."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            tail = f.read(TAIL_BYTES)
    except OSError:
        return ""
    for line in reversed(tail.replace(b"\r", b"\n").split(b"\n")):
        text = line.decode(errors="replace").strip()
        if text:
            return " ".join(text.split())
    return ""


def describe(busiest, share: float, probed: bool, nprocs: int, log_line: str,
             width: int = 120) -> str:
    """The words: busiest is (pid, comm) of the process that used the most
    CPU time since the last look (or None), share that use in CPUs, probed
    whether any process of the tree has probe sites placed; the log line is
    cut to the width."""
    if not probed:
        what = (f"starting: no probe site mapped yet in its {nprocs} "
                f"process{'es' if nprocs != 1 else ''}")
    elif share < IDLE_SHARE:
        what = "idle, probes placed: waiting for its first step"
    else:
        what = "busy, probes placed: loading the model or warming up"
    if share >= IDLE_SHARE and busiest is not None:
        what += f"; {share:.0%} of a CPU, most in pid {busiest[0]} ({busiest[1]})"
    else:
        what += f"; {share:.0%} of a CPU"
    text = f"target {what}"
    if log_line:
        head = "its log's last line: "
        room = max(10, width - len(head))
        if len(log_line) > room:
            log_line = log_line[:room - 1] + "…"
        text += "\n" + head + log_line
    return text


class Activity:
    """Looks at a tree at each call of line(), comparing with the last."""

    def __init__(self, log_path=None):
        self.log_path = log_path  # -- CMD's output file; else the root's, per look
        self._ticks = {}  # pid -> cpu_ticks at the last look
        self._at = None  # when that was (time.monotonic())

    def line(self, pids, comm_of, probed: bool, now: float, width: int = 120) -> str:
        """pids: the tree, root first; comm_of: pid -> its name; now:
        time.monotonic().  '' at the first look (nothing to compare yet)."""
        ticks = {pid: t for pid in pids if (t := cpu_ticks(pid)) is not None}
        used = {pid: t - self._ticks[pid] for pid, t in ticks.items() if pid in self._ticks}
        elapsed = now - self._at if self._at is not None else 0.0
        self._ticks, self._at = ticks, now
        if elapsed <= 0:
            return ""
        share, busiest = 0.0, None
        if used:
            share = sum(used.values()) / CLK_TCK / elapsed
            top = max(used, key=used.get)
            busiest = (top, comm_of(top))
        log = self.log_path or (log_of(pids[0]) if pids else None)
        return describe(busiest, share, probed, len(ticks), last_line(log) if log else "",
                        width)
