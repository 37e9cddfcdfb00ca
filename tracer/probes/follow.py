"""Follow a process tree: find the processes that run vLLM's cache ops.

vLLM runs the model in child processes (EngineCore, then its workers), not in
the process the user started, and starts them after that process.  The
follower scans the tree under the root (the PID given, or the command
started) and attaches to every process in it that maps a file with probe
sites, including ones started or libraries loaded after attach.

Scanning /proc, not a fork tracepoint: a new process can only be attached
once it has mapped vLLM's library, which /proc/PID/maps shows and a fork
event does not.  The window between the mapping and the next scan (a
fraction of a second) is not traced; vLLM maps its library while it loads
the model, seconds before it serves.  docs/stock-vllm.md says so.
"""

import os
import time

from ..errors import TargetError
from . import discover, torch_layout


def children_map() -> dict:
    """{ppid: [pid]} of every process now running."""
    kids = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rindex(b")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(name))
    return kids


def last_pid():
    """The pid the kernel gave last, to a process or a thread (the fifth
    field of /proc/loadavg); None if unreadable."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[4])
    except (OSError, IndexError, ValueError):
        return None


def exec_code_kb(pid: int) -> tuple:
    """(VmExe, VmLib) of /proc/PID/status: the kB of executable file code
    the process maps.  A probe site is code, so a library with sites that
    is mapped (dlopen) or a program exec'd changes it; data and anonymous
    mappings do not.  A JIT's executable anonymous pages do, which only
    costs a needless read of the maps."""
    sizes = dict.fromkeys((b"VmExe", b"VmLib"))
    for line in discover.read_proc(pid, "status").splitlines():
        key = line.split(b":", 1)[0]
        if key in sizes:
            sizes[key] = int(line.split()[1])
    return sizes[b"VmExe"], sizes[b"VmLib"]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cuda_graph_warning(mapped_paths, cmdlines) -> str:
    """A warning if the process runs CUDA and may replay CUDA graphs: graph
    replay runs no host code, so no probe fires for the cache writes in it.
    vLLM captures graphs unless told --enforce-eager (piecewise graphs keep
    the KV-cache write outside the graph: docs/fork.md)."""
    if not any(os.path.basename(p).startswith("libcuda.so") for p in mapped_paths):
        return ""
    if any("--enforce-eager" in c or "enforce_eager" in c for c in cmdlines):
        return ""
    return ("it uses CUDA: cache writes replayed from full CUDA graphs run no host code "
            "and are not seen; run vLLM with --enforce-eager (or piecewise graphs) for "
            "full coverage")


class Follower:
    """Attach a Tracer to every process of the tree under `root` that has
    probe sites, as they appear."""

    def __init__(self, root: int, calls_only: bool = False):
        self.root = root
        self.calls_only = calls_only  # stock uprobes: never read tensors
        self.probe_cache = {}  # each mapped file is parsed once per run
        self.discoveries = {}  # libc10.so path -> torch_layout.Discovery
        self.parent_of = {}
        self.refused = set()  # pids beyond the tracer's process limit
        self._maps_seen = {}  # pid -> (files it maps, its probe files, its libc10.so)
        self._code_sizes = {}  # pid -> exec_code_kb(pid) when its maps were last read
        self.changed_at = time.monotonic()  # last time the tree or a maps changed
        self.notices = []  # lines for the user, taken by the caller
        # pid -> the kvtrace vLLM plugin's install outcome there, once read
        self.plugin_status = {}
        self._tree = []  # the tree's pids, root first, as last listed
        self._tree_last_pid = None  # last_pid() before that listing

    def tree(self) -> list:
        """The pids of the tree under the root, root first.  Listed again
        from /proc (1.6 ms with vLLM running here) only when a process or
        thread was created since the last listing: without one the tree can
        only have lost processes, which the caller finds gone."""
        newest = last_pid()  # before the listing: a fork after it is seen next time
        if newest is not None and newest == self._tree_last_pid:
            return self._tree
        kids = children_map()
        tree, todo = [], [self.root]
        while todo:
            pid = todo.pop(0)
            tree.append(pid)
            for kid in kids.get(pid, ()):
                self.parent_of.setdefault(kid, pid)
                todo.append(kid)
        self._tree, self._tree_last_pid = tree, newest
        return tree

    def scan(self) -> dict:
        """{pid: {path: [Probe]}} for the processes of the tree with probe
        sites.  Starts a tensor-layout discovery for each new torch seen
        with stock sites, in the background."""
        found = {}
        visited = self.tree()
        for pid in visited:
            try:
                files = self._files(pid)
            except TargetError:
                continue  # gone meanwhile
            if files:
                found[pid] = files
                if not self.calls_only and any(p.stock for ps in files.values() for p in ps):
                    self._discovery(pid)
            if pid not in self.plugin_status:
                self._read_plugin_status(pid)
        for pid in set(self._maps_seen).difference(visited):
            del self._maps_seen[pid]  # exited, or left the tree
            self._code_sizes.pop(pid, None)
            self.plugin_status.pop(pid, None)
        return found

    def _read_plugin_status(self, pid: int):
        """The plugin's line in pid, once its status object is mapped and the
        line set (read again each scan until then: the plugin maps the
        object, then sets it); a notice for the user unless it is a tested
        release."""
        seen = self._maps_seen.get(pid)
        if seen is None or not any(discover.is_plugin_status_object(p) for p in seen[0]):
            return
        try:
            line = discover.plugin_status(pid)
        except TargetError:
            return  # gone meanwhile
        if line is None:
            return
        self.plugin_status[pid] = line
        if not line.startswith("tested ") or "; not exact here: " in line:
            self.notices.append(f"pid {pid} ({discover.comm(pid)}): kvtrace vLLM plugin: "
                                f"{line}")

    def _files(self, pid: int) -> dict:
        """process_probe_files(pid), re-computed only when the set of files
        the process maps changed (anonymous mappings come and go all the
        time).  /proc/PID/maps itself is read only when the process's
        executable mappings changed in size (exec_code_kb): the kernel
        formats vLLM's 700-800 lines in about 4 ms a process, 14 ms a scan
        of its tree, where the status line takes 0.1 ms."""
        code = exec_code_kb(pid)  # before the maps: a change after is seen next scan
        last = self._maps_seen.get(pid)
        if last is not None and code == self._code_sizes.get(pid):
            return last[1]
        self._code_sizes[pid] = code
        maps = discover.read_maps(pid)
        paths = frozenset(m.path for m in maps)
        last = self._maps_seen.get(pid)
        if last is not None and last[0] == paths:
            return last[1]
        self.changed_at = time.monotonic()  # a new process, or new files mapped
        files = discover.process_probe_files(pid, cache=self.probe_cache, maps=maps)
        self._maps_seen[pid] = (paths, files, torch_layout.torch_library(pid, maps))
        return files

    def _discovery(self, pid: int):
        """The tensor-layout discovery for pid's torch (one per libc10.so),
        started if new; None if pid maps no torch.  Uses what scan() read."""
        lib = self._maps_seen[pid][2]
        if lib is None:
            return None
        if lib not in self.discoveries:
            self.discoveries[lib] = torch_layout.Discovery(pid, lib).start()
        return self.discoveries[lib]

    def step(self, tracer, wait: bool = False) -> list:
        """Attach to what scan() finds.  Processes whose tensor layout is
        still being discovered wait for the next step, unless `wait`.
        Returns the pids that got new probes."""
        attached = []
        # a command launched under the tracer is tracked from fork, when its
        # comm is still the tracer's; the processes without probes (vLLM's
        # API server) are never attach()ed, which reads it again: it is
        # read here, once a step, so every process is named by what it runs
        for pid, proc in tracer.procs.items():
            name = discover.comm(pid)
            if name != "?":
                proc.comm = name
        for pid, files in self.scan().items():
            if pid in self.refused:
                continue
            layout = None
            # new to the user: launch() tracks a command before it has probes
            new = pid not in tracer.procs or not tracer.procs[pid].uprobes
            stock = any(p.stock for ps in files.values() for p in ps)
            if stock and self.calls_only:
                if new:
                    self.notices.append(f"pid {pid}: --calls-only: counting calls only, "
                                        "no per-block counts")
            elif stock:
                disc = self._discovery(pid)
                if disc is not None and not wait and not disc.done():
                    continue
                layout = disc.result() if disc is not None else None
                if layout is None and new:
                    why = disc.error if disc is not None else "no torch mapped"
                    self.notices.append(
                        f"pid {pid}: tensor layout unknown ({why}): counting calls "
                        "only, no per-block counts")
            try:
                added = tracer.attach(pid, files, tensor_layout=layout)
            except TargetError as e:
                if "at once" in str(e):
                    self.refused.add(pid)
                    self.notices.append(f"pid {pid}: not traced: {e}")
                continue
            proc = tracer.procs[pid]
            proc.plugin_status = self.plugin_status.get(pid)
            if new:
                proc.parent = self.parent_of.get(pid, 0)
                self._warn_cuda_graphs(pid)
            if added:
                attached.append(pid)
                names = ", ".join(os.path.basename(f) for f in files)
                how = {"plugin": "plugin USDT probes", "usdt": "USDT probes",
                       "uprobe": "stock uprobes"}.get(proc.tier, "")
                extra = ""
                if layout is not None:
                    extra = f", torch {layout.torch} tensor layout"
                self.notices.append(
                    f"{'tracing' if new else 'more probes in'} pid {pid} ({proc.comm}): "
                    f"{added} {how} in {names}{extra}")
        return attached

    def _warn_cuda_graphs(self, pid: int):
        paths = self._maps_seen[pid][0]
        chain, p = [], pid
        while p and len(chain) < 16:  # the process and its ancestors up to the root
            chain.append(cmdline(p))
            p = self.parent_of.get(p, 0) if p != self.root else 0
        warning = cuda_graph_warning(paths, chain)
        if warning:
            self.notices.append(f"pid {pid}: {warning}")

    def take_notices(self) -> list:
        out, self.notices = self.notices, []
        return out

    def close(self):
        for d in self.discoveries.values():
            d.cancel()
