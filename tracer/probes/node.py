"""Find every traceable vLLM process on the node, as they start (the agent).

attach follows one process tree (follow.Follower).  The agent follows the
node: its candidates are the processes that may become traceable, and
follow.Follower's scan (maps read only when a process's code changed,
tensor-layout discovery, the plugin's status) runs over them instead of
one tree.  A process is a candidate when

  - its command line names vLLM (`vllm serve`, `python -m vllm...`, a
    script of that name), or it maps a file with kvtrace probes within
    PROBATION_S of its exec (a kvtrace build of vLLM, kvsim), or
  - its parent is a candidate (vLLM's engine core and workers: forked, or
    spawned with an interpreter whose command line says nothing of vLLM).

New processes are seen from two tracepoints, not a poll of /proc
(kernel/process_events.py): each exec and each new process (not thread)
comes to on_events(), which the agent's loop calls after each poll.  A candidate is scanned at once and
then at every scan until it exits: vLLM maps its library while it imports,
seconds after the exec.  /proc is listed once, when the agent starts (and
at a reload), for what runs already.

A process that runs vLLM but whose command line does not say so, and that
descends from none that does, is found once it maps a file with kvtrace
probes at an exec, or at the next full listing (SIGHUP): `--include`
cannot add it, since it is not a candidate.
"""

import os
import re
import shlex
import time

from .. import abi
from ..errors import TargetError
from . import discover, follow, probe_cache

# files whose parse the agent keeps, past which it keeps only its candidates'
CACHE_BOUND = 1024
# how long a process that exec'd is scanned for probe sites, when nothing
# else makes it a candidate: its dynamic loader maps its libraries after
# the exec event
PROBATION_S = 2.0

FORK = 2  # kernel/process_events.py's kinds: (EXEC, FORK) = (1, 2)


def ppid(pid: int) -> int:
    try:
        stat = discover.read_proc(pid, "stat")
    except TargetError:
        return 0
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def names_vllm(cmdline: str) -> bool:
    return "vllm" in cmdline.lower()


def _option(argv: list, flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return ""


def _argv(cmdline: str) -> list:
    try:
        return shlex.split(cmdline)
    except ValueError:
        return cmdline.split()


class Selection:
    """--include / --exclude: regular expressions matched (search) against
    a process's model name and its command line, and its ancestors' up to
    the first that is no candidate.  A process is traced when it matches an
    --include (or none is given) and no --exclude."""

    def __init__(self, include=(), exclude=()):
        self.include = [re.compile(p) for p in include]
        self.exclude = [re.compile(p) for p in exclude]

    def wants(self, texts: list) -> bool:
        def hit(pats):
            return any(p.search(t) for p in pats for t in texts if t)
        if self.include and not hit(self.include):
            return False
        return not hit(self.exclude)


class NodeFollower(follow.Follower):
    """follow.Follower over the node's candidates instead of one tree."""

    def __init__(self, selection: Selection, model_name, calls_only: bool = False):
        super().__init__(0, calls_only=calls_only)
        self.selection = selection
        self.model_name = model_name  # argv -> the model vLLM serves, or ''
        self.candidates = set()
        self.probation = {}  # pid -> until when an exec'd process is scanned
        self.passed = set()  # candidates --include/--exclude left out, once said
        self._cmdlines = {}  # pid -> its command line, read once
        self._labels = {}  # pid -> (model name, engine index, port)

    # -- the candidates ----------------------------------------------------

    def cmdline(self, pid: int) -> str:
        if pid not in self._cmdlines:
            self._cmdlines[pid] = follow.cmdline(pid)
        return self._cmdlines[pid]

    def list_all(self):
        """Every process running now that is a candidate (the start, a reload)."""
        kids = follow.children_map()
        todo = [(0, pid) for pid in kids.get(0, [])]
        while todo:
            parent, pid = todo.pop()
            if parent in self.candidates or pid in self.candidates or \
                    self._is_candidate(pid):
                self.parent_of[pid] = parent
                self.candidates.add(pid)
            else:
                self.forget(pid)
            todo.extend((pid, kid) for kid in kids.get(pid, ()))

    def _is_candidate(self, pid: int) -> bool:
        if pid == os.getpid():
            return False
        if names_vllm(self.cmdline(pid)):
            return True
        try:
            return bool(self._files(pid))
        except TargetError:
            return False

    def on_events(self, events: list) -> bool:
        """Execs and new processes: True when a candidate is new."""
        new = False
        # What is kept of a process is kept only while it is a candidate:
        # the node's other processes come and go by the thousand
        for kind, pid in events:
            if kind == FORK:
                parent = ppid(pid)  # 0: gone already
                if parent in self.candidates:
                    self.parent_of[pid] = parent
                    self.candidates.add(pid)
                    new = True
                continue
            # an exec: a new command line, maybe a new program with probes
            was = pid in self.candidates
            self.forget(pid)
            parent = ppid(pid)
            if was or parent in self.candidates or self._is_candidate(pid):
                self.parent_of[pid] = parent
                self.candidates.add(pid)
            else:
                # the exec tracepoint fires before the dynamic loader maps
                # the program's libraries: a library with probes (kvsim's)
                # shows in the maps a moment later
                self.parent_of[pid] = parent
                self.probation[pid] = time.monotonic() + PROBATION_S
            new = True
        return new

    def forget(self, pid: int):
        """pid exited: nothing of it stays (memory bounded across exits)."""
        self.candidates.discard(pid)
        self.probation.pop(pid, None)
        self.passed.discard(pid)
        self.refused.discard(pid)
        for d in (self._cmdlines, self._labels, self.parent_of, self._maps_seen,
                  self._code_sizes, self.plugin_status):
            d.pop(pid, None)

    def prune(self):
        """Candidates that exited before they had probes; and the caches of
        files parsed, once they hold more than CACHE_BOUND files, cut to
        those the candidates map: every exec on the node may add its files
        (a busy node's temporary libraries, test runs), where attach only
        ever sees one tree's."""
        for pid in [p for p in self.candidates if not os.path.exists(f"/proc/{p}")]:
            self.forget(pid)
        known = probe_cache.known(abi.PROVIDER)["files"]
        if len(self.probe_cache) > CACHE_BOUND or len(known) > CACHE_BOUND:
            keep = {path for pid in self.candidates
                    for path in self._maps_seen.get(pid, (frozenset(),))[0]}
            self.probe_cache = {k: v for k, v in self.probe_cache.items() if k[0] in keep}
            kept = {i for i in known if i.split("|", 1)[0] in keep}
            known.clear()
            known.update(kept)

    # -- follow.Follower's hooks -------------------------------------------

    def tree(self) -> list:
        return sorted(p for p in self.candidates.union(self.probation) if p not in self.passed)

    def scan(self) -> dict:
        found = super().scan()
        now = time.monotonic()
        for pid, until in list(self.probation.items()):
            if pid in found:  # its libraries came, with probes
                del self.probation[pid]
                self.candidates.add(pid)
            elif now >= until or not os.path.exists(f"/proc/{pid}"):
                self.forget(pid)
        for pid in list(found):
            if not self.selection.wants(self.texts(pid)):
                del found[pid]
                if pid not in self.passed:
                    self.passed.add(pid)
                    self.notices.append(f"pid {pid} ({discover.comm(pid)}): left out by "
                                        "--include/--exclude")
        return found

    # -- what the metrics say of a process ---------------------------------

    def chain(self, pid: int) -> list:
        """pid and its candidate ancestors, pid first."""
        out, p = [], pid
        while p and p not in out and len(out) < 16:
            out.append(p)
            p = self.parent_of.get(p, 0)
            if p not in self.candidates:
                break
        return out

    def texts(self, pid: int) -> list:
        chain = self.chain(pid)
        model = self.labels(pid)[0]
        return [model] + [self.cmdline(p) for p in chain]

    def labels(self, pid: int) -> tuple:
        """(model_name, engine, port) of pid: vLLM's --served-model-name or
        --model (or `vllm serve MODEL`) and --port from its command line or
        an ancestor's; the engine index from vLLM's process name
        (EngineCore_DP<n>: data parallel) or --data-parallel-rank.  Each
        '' where vLLM does not say."""
        if pid not in self._labels:
            model = port = engine = ""
            for p in self.chain(pid):
                argv = _argv(self.cmdline(p))
                model = model or self.model_name(argv)
                port = port or _option(argv, "--port")
                engine = engine or _option(argv, "--data-parallel-rank")
            if not port.isdigit():
                port = ""
            self._labels[pid] = (model, engine, port)
        model, engine, port = self._labels[pid]
        if not engine:
            # vLLM names its engine process after it started: read until found
            m = re.search(r"_DP(\d+)", discover.comm(pid))
            if m:
                engine = m.group(1)
                self._labels[pid] = (model, engine, port)
        return model, engine, port
