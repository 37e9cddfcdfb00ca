"""Load the BPF program, attach it to probe sites, poll, read, detach.

Attaching goes through one uprobe_multi link per traced file (or the uprobe
PMU's perf events where the kernel has no such link: uprobes.py), so the
kernel owns the USDT semaphores; program.py loads the program bcc compiled once
(cached) and owns the maps and the perf buffer.  Reading the exact counters
is a snapshot of the maps (aggregate.py turns it into histograms); the perf
buffer only carries the per-op stream, and what it loses is counted, not
guessed.
"""

import ctypes
import mmap
import os
import select
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from .. import abi
from ..errors import EnvironmentProblem, TargetError
from ..probes import catalog, discover
from . import bpf, program, records, uprobes
from .uprobes import NoUprobeMulti, Uprobe, UprobeLink

# The capabilities tracing involves (linux/capability.h), by CapEff bit
CAPABILITIES = {"CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}


def effective_capabilities() -> set:
    """The names of the CAPABILITIES this process has in effect (CapEff)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    return {name for name, bit in CAPABILITIES.items() if caps >> bit & 1}


def missing_privileges(caps: set = None) -> list:
    """The capabilities this process lacks to trace, [] if none.  Tracing
    needs CAP_BPF + CAP_PERFMON, or CAP_SYS_ADMIN: what root normally has.
    By capability, not uid: root without them (a locked-down container,
    setpriv) cannot load BPF either.  (`doctor` reports the same.)"""
    caps = effective_capabilities() if caps is None else caps
    if "CAP_SYS_ADMIN" in caps:
        return []
    return [name for name in ("CAP_BPF", "CAP_PERFMON") if name not in caps]


def check_privileges():
    missing = missing_privileges()
    if missing:
        raise EnvironmentProblem(
            f"tracing needs root (or CAP_BPF and CAP_PERFMON; this process lacks "
            f"{' and '.join(missing)}): run it with sudo")


def check_kernel_headers() -> str:
    """bcc compiles at run time against the running kernel's headers.
    Returns where they are."""
    release = os.uname().release
    build = f"/lib/modules/{release}/build"
    include = os.path.join(build, "include")
    if os.path.isdir(include):
        return include
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):  # CONFIG_IKHEADERS
        return "/sys/kernel/kheaders.tar.xz"
    raise EnvironmentProblem(
        f"no kernel headers for {release} ({build} is missing): run `make setup`, "
        "which links Debian's linux-headers there")


def _import_bcc():
    try:
        import bcc  # the distribution's python3-bpfcc, not PyPI's "bcc"
    except ImportError as e:
        raise EnvironmentProblem(
            f"bcc is not importable ({e}): install python3-bpfcc and use a venv "
            "made with --system-site-packages (`make setup` does both)") from None
    return bcc


# The per-op stream's transport (bpf/kvtrace.bpf.c submit_record): "perf",
# the per-CPU perf buffer, or "ring", one BPF ring buffer for all CPUs.  The
# default is the measured better one: docs/bench.md.
TRANSPORTS = ("perf", "ring")
# processes traced at once: the target and its descendants with probes
DEFAULT_MAX_PROCS = abi.DEFAULT_MAX_PROCS
DEFAULT_TRANSPORT = "perf"
# When the reader is woken (each wake-up is an IPI, an exit to the
# hypervisor in a VM: docs/bench.md).  WAKE_BY_FILL, the default: the perf
# buffer wakes it once a quarter of a CPU's buffer is waiting; the ring
# buffer once per RING_WAKEUP_EVERY op records.  N > 0: once per N op
# records.  Whatever did not wake it is read at every poll's timeout.
WAKE_BY_FILL = 0
# bcc's perf reader reads a CPU's buffer until it finds it empty, re-reading
# its head after every record: a target that writes records faster than the
# callback takes them keeps poll() from returning while that lasts, and
# under a flood for ever (record to a full disk never saw its write fail,
# and held gigabytes after a minute).  So a poll
# that has run DURING_POLL_EVERY_S past its timeout asks the tracing loop
# (Tracer.during_poll) every _SHED_CHECK_EVERY records whether to stop
# (Ctrl-C, a failed write), and once IN_POLL_WRITE_BYTES wait for the
# consumer, lets it write them first: a burst is held, as it was, and only
# a flood is written from inside.  Once it says stop, or MAX_PENDING_BYTES
# wait, the rest of what that poll reads is shed: counted as lost
# (read_globals), as the kernel counts what it could not send, and cheap
# enough to empty the buffer so that poll() returns.
DURING_POLL_EVERY_S = 0.2
IN_POLL_WRITE_BYTES = 1 << 30
MAX_PENDING_BYTES = 4 << 30
_SHED_CHECK_EVERY = 1024  # records between looks at the clock
DEFAULT_WAKEUP_EVERY = WAKE_BY_FILL
# words of a process's life_pages row: 64 marks and the sink (bpf/kvtrace.h)
LIFE_PAGE_WORDS = 128
RING_WAKEUP_EVERY = 64


def ring_pages(perf_pages: int) -> int:
    """The ring buffer gets the memory the perf buffer would have had in
    all (perf_pages on every CPU), rounded up to a power of two pages."""
    pages = perf_pages * (os.cpu_count() or 1)
    return 1 << (pages - 1).bit_length()


@dataclass
class TracedProcess:
    pid: int
    index: int  # row group in block_moves
    comm: str
    uprobes: list = field(default_factory=list)  # UprobeLink or Uprobe, open now
    probe_files: dict = field(default_factory=dict)  # path -> [Probe], ever seen
    attached: set = field(default_factory=set)  # paths whose uprobes are open now
    skipped: list = field(default_factory=list)  # (probe, reason)
    calls_only: bool = False  # stock uprobes without a tensor layout
    parent: int = 0  # the traced process it descends from (0: the root)
    # the kvtrace vLLM plugin's install outcome in it (discover.plugin_status)
    plugin_status: str = None
    # (path, probe name) found and left unattached on purpose (held_back())
    held_back: set = field(default_factory=set)

    @property
    def tier(self) -> str:
        """Which probe source serves this process: 'plugin' (the kvtrace
        vLLM plugin's scheduler probes, plugin/), 'usdt' (a kvtrace build of
        vLLM, or kvsim), 'uprobe' (stock vLLM), or 'none' yet."""
        return tier_of([p for ps in self.probe_files.values() for p in ps])

    @property
    def probed_ops(self) -> list:
        """The op names of its probe files, less the probes it skipped
        (unmapped, undecodable): what attach and record write as the
        process's probed_ops (aggregate.Process.probed_ops)."""
        skipped = [probe for probe, _ in self.skipped]
        return sorted({probe.name for probes in self.probe_files.values() for probe in probes
                       if probe.name in abi.OPS and probe not in skipped
                       and (probe.path, probe.name) not in self.held_back})


def tier_of(probes) -> str:
    """The tier a process's probes offer (docs/tiers.md): 'plugin' when the
    plugin's scheduler probes are among them (and the fork's op probes may
    be too), 'usdt' for op probes compiled in, 'uprobe' for stock sites."""
    if not probes:
        return "none"
    if any(p.name in abi.PLUGIN_OPS and not p.stock for p in probes):
        return "plugin"
    return "uprobe" if all(p.stock for p in probes) else "usdt"


# The plugin's whole tables (block_table, with step_reqs naming their rows):
# in a probe file that fires step_rows and no op of its own (the plugin's
# scheduler probes, plugin/), attached only with --verify-rows.  The plugin
# builds a step's table only while block_table is attached, at 13-21 ns an
# entry (docs/design.md, "Row deltas: step_rows"); step_rows carries the
# same rows as deltas.  A file with op probes (the fork, kvsim) fires its
# block_table from the ops themselves: its own tier, always attached.
VERIFY_ROWS_OPS = frozenset(("block_table", "step_reqs"))


def held_back(probes, verify_rows: bool) -> frozenset:
    """The probe names of one file left unattached (VERIFY_ROWS_OPS)."""
    names = {p.name for p in probes}
    if verify_rows or "step_rows" not in names or names & set(abi.WRITE_OPS):
        return frozenset()
    return VERIFY_ROWS_OPS & names


class RowMap:
    """The rows of an mmapable BPF array map of u64 rows, each mapped
    read-only when first asked for: rows[i] is a numpy view of row i, of
    `shape` (the first words of a row of `row_bytes`).  Mapping a row maps
    its pages only, so the tracer's RSS holds the rows in use, not the
    map's size."""

    def __init__(self, map_fd: int, rows: int, shape: tuple, row_bytes: int = None):
        self.fd, self.rows, self.shape = map_fd, rows, shape
        self.row_bytes = row_bytes or 8 * int(np.prod(shape))
        self._mmaps, self._views = {}, {}  # row -> its mmap, its view

    def __len__(self):
        return self.rows

    def __getitem__(self, row: int) -> np.ndarray:
        if not 0 <= row < self.rows:
            raise IndexError(row)
        if row not in self._views:
            # an mmap's offset is in whole pages; a row need not start on one
            start = row * self.row_bytes
            first = start - start % mmap.PAGESIZE
            m = mmap.mmap(self.fd, start + self.row_bytes - first, mmap.MAP_SHARED,
                          mmap.PROT_READ, offset=first)
            view = np.frombuffer(m, dtype=np.uint64, count=int(np.prod(self.shape)),
                                 offset=start - first).reshape(self.shape)
            self._mmaps[row], self._views[row] = m, view
        return self._views[row]

    def close(self):
        # the views first: an mmap with live views cannot close
        self._views.clear()
        mmaps, self._mmaps = self._mmaps, {}
        for m in mmaps.values():
            m.close()


class Tracer:
    """One BPF program instance tracing a set of processes."""

    def __init__(self, max_blocks: int = abi.DEFAULT_MAX_BLOCKS,
                 max_caches: int = abi.DEFAULT_MAX_CACHES,
                 max_procs: int = DEFAULT_MAX_PROCS, max_groups: int = abi.DEFAULT_MAX_GROUPS,
                 stacks: bool = False, stack_buckets: int = abi.STACK_BUCKETS,
                 perf_pages: int = 64, index_stream=None,
                 transport: str = DEFAULT_TRANSPORT, wakeup_every: int = DEFAULT_WAKEUP_EVERY,
                 collector: records.Collector = None, gen_fill: bool = False,
                 op_records: bool = None, verify_rows: bool = False,
                 reuse_rows: bool = False):
        check_privileges()
        discover.check_arch()
        if max_blocks & (max_blocks - 1):
            max_blocks = 1 << max_blocks.bit_length()  # the BPF side masks
        self.max_blocks, self.max_caches, self.max_procs = max_blocks, max_caches, max_procs
        self.max_groups = max_groups
        self.verify_rows = verify_rows  # attach the plugin's tables too (held_back())
        cflags = [f"-I{abi.BPF_DIR}", f"-DKVTRACE_MAX_BLOCKS={max_blocks}",
                  f"-DKVTRACE_MAX_CACHES={max_caches}", f"-DKVTRACE_MAX_PROCS={max_procs}",
                  f"-DKVTRACE_MAX_GROUPS={max_groups}"]
        if stacks:
            cflags.append("-DKVTRACE_WITH_STACKS")
            if stack_buckets != abi.STACK_BUCKETS:  # the default: the header's, same cache entry
                cflags.append(f"-DKVTRACE_STACK_BUCKETS={stack_buckets}")
        # the block generations' fill (--prometheus): a stage run more per write op
        self.gen_fill = gen_fill
        if gen_fill:
            cflags.append("-DKVTRACE_WITH_GEN_FILL")
        # the agent's: rows of processes that exited are used again (release.py)
        self.reuse_rows = reuse_rows
        if reuse_rows:
            cflags.append("-DKVTRACE_WITH_INDEX_REUSE")
        if index_stream == "block_ids":  # the block events' ids only (--prometheus)
            cflags.append("-DKVTRACE_WITH_BLOCK_ID_STREAM")
        elif index_stream:  # every op's values (record, attach -o); off costs nothing
            cflags.append("-DKVTRACE_WITH_INDEX_STREAM")
        # A record per op goes with a stream, whose consumer needs it; without
        # one, every count comes from the maps and nothing would read it
        # (bpf/kvtrace.bpf.c OP_RECORDS).  op_records=True keeps them anyway:
        # bench/run.py's carrying-capacity row measures what the transports
        # carry.
        self.op_records = bool(index_stream) if op_records is None else bool(op_records)
        # the block-id stream alone: only the plugin tier's ops send records
        self.plugin_records_only = index_stream == "block_ids"
        if self.op_records and not index_stream:
            cflags.append("-DKVTRACE_WITH_OP_RECORDS")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}")
        self.transport = transport
        if transport == "ring":
            wakeup_every = wakeup_every or RING_WAKEUP_EVERY
            cflags.append(f"-DKVTRACE_RINGBUF={ring_pages(perf_pages)}")
            cflags.append(f"-DKVTRACE_WAKEUP_EVERY={wakeup_every}")
        self.wakeup_every = wakeup_every
        # collector: the stream's consumer side, if not a plain Collector
        # (attach --prometheus: lifecycle.StreamTap)
        self.stream = (collector or records.Collector()) if index_stream else None
        self.stacks = stacks
        self._collided_stacks = {}  # stack id -> frames, from collided_stacks
        # one uprobe_multi link per file and process, where the kernel has
        # them; KVTRACE_PERF_UPROBES=1 attaches as on older kernels, one perf
        # event per probe (tests).  Decided before the load: a program
        # loaded for links goes on links only (program.attach_type())
        self.use_links = (program.attach_type() == uprobes.BPF_TRACE_UPROBE_MULTI
                          and os.environ.get("KVTRACE_PERF_UPROBES", "") in ("", "0"))
        self.attach_kind = uprobes.BPF_TRACE_UPROBE_MULTI if self.use_links else 0
        if self.use_links:
            # a link gives each probe a cookie: its row in `sites`, found
            # without a hash lookup (bpf/kvtrace.h)
            cflags.append("-DKVTRACE_SITE_COOKIES")
        t0 = time.monotonic()
        # compiled once per program text, kernel and bcc (tracer/program.py);
        # a compile needs the kernel headers, a cached program does not
        try:
            self.bpf, self.program_source = program.load(cflags, self.attach_kind,
                                                         check_kernel_headers)
        except OSError as e:
            raise EnvironmentProblem(f"the kernel refused the BPF program: {e}") from None
        self.compile_seconds = time.monotonic() - t0
        try:
            stages = self.bpf["stages"]
            for name, idx in abi.STAGES.items():
                fn = self.bpf.load_func(f"kvtrace_stage_{name}")
                stages[ctypes.c_int(idx)] = ctypes.c_int(fn.fd)
            self.site_prog = self.bpf.load_func("kvtrace_site_hit")
            self.entry_prog = self.bpf.load_func("kvtrace_stop_at_entry")
        except (OSError, KeyError) as e:
            raise EnvironmentProblem(f"the kernel refused the BPF program: {e}") from None
        self.load_seconds = time.monotonic() - t0
        # KVTRACE_EMPTY_PROGRAM=1 puts a program that does nothing on every
        # probe in its place: the same sites, links and semaphores (so the
        # plugin still builds its step's tables), nothing counted.  What any
        # program at these sites costs the target, whatever it does: the
        # floor under the tracer's own figure in bench/run.py's vLLM row
        self.empty_prog_fd = -1
        if os.environ.get("KVTRACE_EMPTY_PROGRAM", "") not in ("", "0"):
            self.empty_prog_fd = bpf.trivial_program(self.attach_kind,
                                                         b"kvtrace_empty")
            if self.empty_prog_fd < 0:
                raise EnvironmentProblem("the kernel refused the empty program: "
                                         + os.strerror(ctypes.get_errno()))

        # the counter maps, read in place (BPF_F_MMAPABLE arrays of u64).
        # The per-block ones are mapped a row at a time, when a row is first
        # read: the kernel allocates a map whole at load, and an mmap of it
        # puts every page in the tracer's RSS at once, so mapping them whole
        # would make the tracer's RSS the defaults' size (131072 blocks x 80
        # layers x 16 processes: about 260 MiB) for the smallest target
        # (docs/design.md, "Sized for the largest single-GPU caches")
        self._maps = []
        # reads: one row per (process, KV-cache group), and a sink row,
        # never read (bpf/kvtrace.h struct kvtrace_read_row: (reads,
        # last_step) per block)
        self.reads = RowMap(self.bpf["block_reads"].map_fd, max_groups, (max_blocks, 2))
        self.writes = RowMap(self.bpf["block_writes"].map_fd, max_caches, (max_blocks,))
        self.moves = RowMap(self.bpf["block_moves"].map_fd, max_procs,
                            (len(abi.MOVES), max_blocks))
        # block generations' fill per cache (struct kvtrace_fill_row): the
        # u64 head of each row, ended[] by fill then ended_unseen and skipped
        self.fill = None
        if gen_fill:
            self.fill = RowMap(self.bpf["block_fill"].map_fd, max_caches,
                               (abi.FILL_BINS + 2,), row_bytes=abi.fill_row_bytes(max_blocks))
        # every op's totals per (proc index, op), and its items' log2
        # histogram per op (struct kvtrace_op_stats: u64 fields)
        self.op_stat_fields = [name for name, _ in self.bpf["op_stats"].Leaf._fields_]
        self.op_stats = self._map_u64("op_stats",
                                      (max_procs, abi.NR_OPS, len(self.op_stat_fields)))
        self.op_log2 = self._map_u64("op_log2", (abi.NR_OPS, abi.LOG2_SLOTS))
        # each cache's write-op totals, row = its index (struct kvtrace_cache_stats)
        self.cache_stat_fields = [name for name, _ in self.bpf["cache_stats"].Leaf._fields_]
        self.cache_stats = self._map_u64("cache_stats",
                                         (abi.CACHE_ENTRIES, len(self.cache_stat_fields)))
        # the plugin tier's lifecycle events per block (enum kvtrace_life)
        self.life = RowMap(self.bpf["block_life"].map_fd, max_procs, (len(abi.LIFE), max_blocks))
        # per process, which 64ths of the block range its lifecycle rows
        # count in (bpf/kvtrace.bpf.c life_pages): where read_maps(used_only)
        # looks for a row's last counted entry
        self.life_page = max(1, max_blocks // 64)
        self.life_pages = self._map_u64("life_pages", (max_procs, LIFE_PAGE_WORDS))

        self.records = 0
        # records shed by a poll that ran past its budget: op records, and
        # chunk records (the index stream's), as the kernel's two counts
        self.shed = {"records_lost": 0, "chunks_lost": 0}
        self._shedding, self._poll_until, self._since_check = False, float("inf"), 0
        # during_poll(write): called from inside a long poll (see
        # DURING_POLL_EVERY_S); write: the records waiting should be taken
        # now.  True: stop, shed the rest of that poll
        self.during_poll = None
        # Records that did not wake the reader (wakeup_every != 1) are read
        # by the consume after each poll
        if not self.op_records:  # nothing is sent: no buffer to map or poll
            self._poll_fns = None
        elif transport == "ring":  # losses: only the in-kernel count (globals)
            self.bpf.open_ring_buffer("events",
                                      lambda ctx, data, size: self._record(0, data, size))
            self._poll_fns = (self.bpf.ring_buffer_poll, self.bpf.ring_buffer_consume)
        else:
            self.bpf.open_perf_buffer(
                "events", self._record, page_cnt=perf_pages, lost_cb=self._lost,
                wakeup_events=wakeup_every,
                wakeup_bytes=0 if wakeup_every else perf_pages * mmap.PAGESIZE // 4)
            self._poll_fns = (self.bpf.perf_buffer_poll, self.bpf.perf_buffer_consume)
        self.procs = {}  # pid -> TracedProcess
        self.site_rows = {}  # (pid, address) -> its row in `sites`
        # rows of `sites` and process indices handed back by release.forget
        # (the agent); without it, never reused
        self.free_site_rows = []
        self.started = time.monotonic()

    def _map_u64(self, name: str, shape: tuple, words: int = None) -> np.ndarray:
        """A read-only numpy view of an mmapable array map, as u64 of this
        shape; `words` maps more than the view shows (a sink row)."""
        count = int(np.prod(shape))
        m = mmap.mmap(self.bpf[name].map_fd, (words or count) * 8, mmap.MAP_SHARED,
                      mmap.PROT_READ)
        self._maps.append(m)
        return np.frombuffer(m, dtype=np.uint64, count=count).reshape(shape)

    # -- the per-op stream -------------------------------------------------

    def _record(self, cpu, data, size):
        # Without the index stream the op records are only counted (the
        # exact counts come from maps).  With it, the collector keeps them
        # raw; its consumer (record, attach -o) takes them and decodes
        # with tracer/stream.py.
        self._since_check += 1
        if self._since_check >= _SHED_CHECK_EVERY and not self._shedding:
            self._since_check = 0
            if self.stream is not None and self.stream.pending_bytes > MAX_PENDING_BYTES:
                self._shedding = True
            elif self.during_poll is not None and time.monotonic() > self._poll_until:
                self._shedding = bool(self.during_poll(
                    self.stream is not None and self.stream.pending_bytes > IN_POLL_WRITE_BYTES))
        if self._shedding:
            op = ctypes.c_uint32.from_address(data).value == records.REC_OP
            self.shed["records_lost" if op else "chunks_lost"] += 1
        elif self.stream is None or self.stream.add(data, size) == records.REC_OP:
            self.records += 1

    def _lost(self, count):
        # op records lost are counted in-kernel where they are dropped
        # (globals records_lost); without this callback bcc prints a line
        # per loss on stderr
        pass

    @property
    def polls_records(self) -> bool:
        """Whether poll() reads op records (it then returns as they come).
        With the block-id stream alone, only once a process with the
        plugin tier's probes is traced: no other op sends a record, and a
        tracer of the op tiers sleeps as it would without a stream."""
        if self._poll_fns is None:
            return False
        return not self.plugin_records_only or \
            any(p.tier == "plugin" for p in self.procs.values())

    def poll(self, timeout_ms: int, wake_fds=()):
        """Read the op records waiting, waiting up to timeout_ms for them.
        Without records, sleep that long, or until one of wake_fds (the
        target's exit, a signal) is readable."""
        if not self.polls_records:
            if timeout_ms > 0:
                select.select(wake_fds, [], [], timeout_ms / 1000)
            return
        poll, consume = self._poll_fns
        self._shedding = False
        self._poll_until = time.monotonic() + timeout_ms / 1000 + DURING_POLL_EVERY_S
        try:
            poll(timeout_ms)
            if self.wakeup_every != 1:
                consume()
        finally:
            self._poll_until = float("inf")

    def _received(self) -> int:
        return self.records + (self.stream.chunk_records if self.stream else 0) + \
            sum(self.shed.values())

    def drain(self):
        """Read every record still buffered (after detach, none can come)."""
        while True:
            before = self._received()
            self.poll(0)
            if self._received() == before:
                return

    # -- processes and probes ----------------------------------------------

    def track(self, pid: int) -> TracedProcess:
        """Add pid to the traced set (before any of its probes can fire)."""
        if pid in self.procs:
            return self.procs[pid]
        if len(self.procs) >= self.max_procs:
            raise TargetError(f"cannot trace more than {self.max_procs} processes at once")
        used = {p.index for p in self.procs.values()}
        proc = TracedProcess(pid, min(set(range(self.max_procs)) - used), discover.comm(pid))
        table = self.bpf["traced_pids"]
        value = table.Leaf()
        value.index = proc.index
        table[table.Key(pid)] = value
        self.procs[pid] = proc
        return proc

    def attach(self, pid: int, files: dict, tensor_layout=None) -> int:
        """Attach to every known probe in `files` not yet attached in pid.
        Stock uprobes read tensors with `tensor_layout` (torch_layout.py);
        without one they count calls only.  Returns the number of new
        uprobes."""
        proc = self.track(pid)
        proc.comm = discover.comm(pid)  # it may have exec'd since track()
        if all(path in proc.attached for path in files):
            return 0  # called on every scan: nothing new, no need to read the maps
        maps = discover.read_maps(pid)
        sites, memos = self.bpf["sites"], self.bpf["cache_memo"]
        site_index = None if self.use_links else self.bpf["site_index"]  # cookies on links
        added = 0
        for path, probes in files.items():
            if path in proc.attached:
                continue
            proc.attached.add(path)
            if path in proc.probe_files:  # attached again after detach()
                proc.skipped = [(p, why) for p, why in proc.skipped if p.path != path]
            proc.probe_files[path] = probes
            # (offset, semaphore offset, cookie, address) of the probes to attach
            live = []
            held = held_back(probes, self.verify_rows)
            for probe in probes:
                if probe.name in held:  # the plugin's tables: --verify-rows only
                    proc.held_back.add((path, probe.name))
                    continue
                if probe.name not in abi.OPS:
                    proc.skipped.append((probe, "unknown probe name"))
                    continue
                if probe.arg_error or len(probe.arg_specs) > abi.MAX_ARGS:
                    proc.skipped.append((probe, probe.arg_error or "too many arguments"))
                    continue
                ip = discover.runtime_address(maps, path, probe.offset)
                if ip is None:
                    proc.skipped.append((probe, "not mapped"))
                    continue
                specs = probe.arg_specs
                if probe.stock and tensor_layout is None:
                    specs = catalog.arg_specs(probe.recipe, calls_only=True)
                    proc.calls_only = True
                row = self.site_rows.get((pid, ip))
                if row is None:
                    row = self.free_site_rows.pop() if self.free_site_rows else \
                        len(self.site_rows)
                if row >= abi.MAX_SITES:
                    proc.skipped.append((probe, f"more than {abi.MAX_SITES} probe sites"))
                    continue
                self.site_rows[(pid, ip)] = row
                site = sites.Leaf()
                site.op = abi.OPS[probe.name]
                site.nargs = len(specs)
                site.proc = proc.index
                site.pid = pid
                if tensor_layout is not None:
                    for name, _ in site.tensor._fields_:
                        if not name.startswith("pad"):
                            setattr(site.tensor, name, getattr(tensor_layout, name))
                for i, spec in enumerate(specs):
                    site.args[i].kind = spec.kind
                    site.args[i].reg_off = spec.reg_off
                    site.args[i].val_off = spec.val_off
                    site.args[i].is_signed = spec.is_signed
                    site.args[i].bitshift = spec.bitshift
                # the site is described before its uprobe exists: no hit
                # can arrive that the program cannot decode.  Its memo is
                # emptied: a pid can be reused, and the caches with it
                memos[ctypes.c_int(row)] = memos.Leaf()
                sites[ctypes.c_int(row)] = site
                if site_index is not None:
                    key = site_index.Key()
                    key.pid, key.ip = pid, ip
                    site_index[key] = ctypes.c_uint32(row)
                live.append((probe.offset, probe.sem_offset, row + 1, ip))
            if not live:
                continue
            proc.uprobes.extend(self._open_uprobes(path, pid, live))
            if self.stacks and added == 0:
                # bcc reads /proc/PID/maps on a pid's first lookup and
                # keeps it: look once now, while the target lives, so
                # stacks still resolve after it exits
                self.bpf.sym(live[0][3], pid)
            added += len(live)
        return added

    def _open_uprobes(self, path: str, pid: int, live: list) -> list:
        """The uprobes at `live` (offset, semaphore offset, cookie, address) of one
        file in pid: one uprobe_multi link, or one perf event each where the
        kernel makes no such link (uprobes.py says why links first)."""
        prog = self.site_prog.fd if self.empty_prog_fd < 0 else self.empty_prog_fd
        if self.use_links:
            return [self._link(path, [p[0] for p in live], pid, prog,
                               [p[1] for p in live], [p[2] for p in live])]
        return [Uprobe(path, p[0], pid, prog, ref_ctr_offset=p[1]) for p in live]

    def _link(self, path: str, offsets: list, pid: int, prog: int, sems: list,
              cookies=None) -> UprobeLink:
        try:
            return UprobeLink(path, offsets, pid, prog, sems, cookies)
        except NoUprobeMulti as e:
            # the programs were loaded for links, and this kernel refuses
            # them on perf events: no quiet fallback is left
            raise EnvironmentProblem(
                f"the kernel refused a uprobe_multi link on {path} ({e}): "
                "KVTRACE_PERF_UPROBES=1 attaches one perf event per probe") from None

    def stop_at_entry(self, pid: int, exe: str, entry_offset: int):
        """A uprobe that SIGSTOPs pid at its program's entry point, attached
        as the session's probes are (a link or a perf event); close() it."""
        self.track(pid)
        if self.use_links:
            return self._link(exe, [entry_offset], pid, self.entry_prog.fd, [0])
        return Uprobe(exe, entry_offset, pid, self.entry_prog.fd)

    def detach(self):
        """Close every uprobe: the kernel removes them and drops the semaphores.
        The counts stay, and attach() may attach again (windows of tracing).

        A link's close takes the kernel about 30 ms here, whatever its
        number of probes; a perf event's about 100 ms each (the kernel
        waits for an RCU grace period under a lock for each one, so closing
        in parallel threads was measured no faster: docs/safety.md)."""
        for proc in self.procs.values():
            for up in proc.uprobes:
                up.close()
            proc.uprobes.clear()
            proc.attached.clear()

    def close(self):
        self.detach()
        # numpy views first: an mmap with live views cannot close
        for rows in (self.writes, self.moves, self.reads, self.life, self.fill):
            if rows is not None:
                rows.close()
        self.writes = self.moves = self.reads = self.life = self.fill = None
        self.op_stats = self.op_log2 = self.cache_stats = self.life_pages = None
        for m in self._maps:
            m.close()
        if self.empty_prog_fd >= 0:
            os.close(self.empty_prog_fd)
            self.empty_prog_fd = -1
        self.bpf.cleanup()

    # -- reading -------------------------------------------------------------

    def prog_misses(self) -> int:
        """Probe hits the kernel did not run our program for.

        The kernel runs one tracing program per CPU at a time; a uprobe hit
        while another runs there (this one preempted, or any other tracer's)
        is skipped and counted in the program's recursion_misses (5.12+).
        Each one is an op the counts lack, so it is reported, not hidden."""
        try:
            info = bpf.obj_info(self.site_prog.fd, bpf.PROG_INFO_SIZE)
        except OSError:
            return 0
        return struct.unpack_from("<Q", info, bpf.PROG_INFO_RECURSION_MISSES)[0]

    def read_globals(self) -> dict:
        table = self.bpf["globals"]
        out = {name: int(table[ctypes.c_int(i)].value) for name, i in abi.GLOBALS.items()}
        for name, n in self.shed.items():  # lost in user space: the same loss to a reader
            out[name] += n
        return out

    def read_maps(self, used_only: bool = False) -> dict:
        """A raw, consistent-enough copy of every counter map, which
        aggregate.Aggregate.from_maps turns into per-block histograms.
        Its time is when the reading began: every op that ended before it
        is in every count read, while an op during the read may be in the
        counts read last (op_stats, globals) and not in those read first
        (caches, groups).  Stamped at the end, a scraper that waits for a
        snapshot taken after a target's last op could get one whose caches
        were read before that op (a short kvsim run fits in one read).

        used_only: copy of each per-block row only what from_maps keeps of
        it (a cache's and a group's first num_blocks entries, a process's
        moves up to its layers' largest num_blocks, its lifecycle rows up
        to their last non-zero entry) instead of the whole row, for the
        same Aggregate.  The agent's refresh: at the default sizes a
        row is 1 to 5 MiB whatever the target's pool, and copying each
        engine's whole rows every refresh (16 MiB for a two-layer kvsim)
        left the agent's heap as large as those copies' peak."""
        started = time.monotonic()

        def first(row, n):  # the first n entries of a row's last axis; all if n <= 0
            return (row[..., :n] if n > 0 else row).copy()
        caches = []
        for k, v in self.bpf["caches"].items():
            totals = self.cache_stats[v.index] if v.index < len(self.cache_stats) else \
                np.zeros(len(self.cache_stat_fields), np.uint64)
            caches.append(dict(pid=k.pid, cache_id=k.cache_id, index=v.index,
                               op=abi.OP_NAMES.get(v.op, str(v.op)),
                               block_size=v.block_size, num_blocks=v.num_blocks,
                               **{f: int(n) for f, n in zip(self.cache_stat_fields,
                                                            totals.tolist())}))
        for c in caches:
            if c["index"] < self.max_caches:
                c["writes"] = first(self.writes[c["index"]],
                                   int(c["num_blocks"]) if used_only else 0)
                if self.fill is not None:
                    head = self.fill[c["index"]].copy()
                    c["fill_ended"] = head[:abi.FILL_BINS]
                    c["fill_unseen"], c["fill_skipped"] = int(head[-2]), int(head[-1])
        groups = []
        for k, v in self.bpf["groups"].items():
            g = dict(pid=k.pid, group_id=k.group_id,
                     **{name: int(getattr(v, name)) for name, _ in v._fields_
                        if not name.startswith("pad")})
            if g["index"] < self.max_groups:
                row = self.reads[g["index"]]
                if used_only and g["num_blocks"] > 0:
                    row = row[:g["num_blocks"]]
                g["reads_per_block"] = row[:, 0].copy()
                g["last_read_step"] = row[:, 1].copy()
                # block 0, the null block, is never counted: the table stage
                # sends the entries it does not count there and stamps them
                g["last_read_step"][0] = 0
            groups.append(g)
        # ops a process never called have no entry, as the hashes had none
        op_stats = {}
        for pid, p in self.procs.items():
            rows = self.op_stats[p.index].copy()
            calls = rows[:, self.op_stat_fields.index("calls")]
            for op in np.flatnonzero(calls).tolist():
                op_stats[(pid, abi.OP_NAMES[op])] = dict(
                    zip(self.op_stat_fields, (int(x) for x in rows[op])))
        log2 = {}
        hist = self.op_log2.copy()
        for op, slot in zip(*(a.tolist() for a in np.nonzero(hist))):
            log2.setdefault(abi.OP_NAMES[op], {})[slot] = int(hist[op, slot])
        # processes without probe sites (a launched command that only
        # starts vLLM) can have no counts: they are not shown
        moves, life = {}, {}
        for pid, p in self.procs.items():
            if not p.probe_files:
                continue
            length = used = 0
            if used_only:
                # from_maps cuts moves to the layers' largest num_blocks,
                # and each lifecycle row to its last non-zero entry
                length = max([int(c["num_blocks"]) for c in caches if c["pid"] == pid] + [0])
                used = self._life_used(p.index)
            moves[pid] = first(self.moves[p.index], length)
            life[pid] = first(self.life[p.index], used)
        requests = []
        for k, v in self.bpf["requests"].items():
            r = {name: int(getattr(v, name)) for name, _ in v._fields_
                 if name not in ("pad", "id", "blocks")}
            r["blocks"] = dict(zip(abi.LIFE, (int(b) for b in v.blocks)))
            r["id"] = bytes(v.id[:min(v.id_len, abi.REQ_ID_LEN)]).decode(errors="replace")
            requests.append(dict(pid=k.pid, req=k.req, **r))
        stacks = []
        if self.stacks:
            for k, v in self.bpf["stack_weights"].items():
                stacks.append((k.pid, k.stack_id, abi.OP_NAMES.get(k.op, str(k.op)),
                               k.cache_index, v.value))
        glob = self.read_globals()
        glob["missed_hits"] = self.prog_misses()
        if self.empty_prog_fd >= 0:
            glob["empty_program"] = 1  # aggregate.py: nothing was counted
        return dict(time=started, caches=caches, groups=groups, op_stats=op_stats,
                    log2=log2,
                    moves=moves, life=life, requests=requests, stacks=stacks, globals=glob,
                    records=self.records,
                    # op records only, counted where they were dropped: the
                    # lost callback also hears of the stream's chunk records
                    lost=glob["records_lost"])

    def _life_used(self, index: int) -> int:
        """The length of process `index`'s lifecycle rows up to their last
        non-zero entry (1 if none): found in the highest 64th of the block
        range the kernel marked (life_pages), so a refresh scans one 64th
        of the rows, not all of them.  The mark is set after the count and
        before the op ends: an op that ended before this read is found.
        Where the 64th shows no count (an op in progress on a machine that
        orders stores less than x86), the whole rows are scanned."""
        rows = self.life[index]
        marked = np.flatnonzero(self.life_pages[index][:64])
        if len(marked):
            lo = int(marked[-1]) * self.life_page
            nz = np.flatnonzero(rows[:, lo:lo + self.life_page].any(axis=0))
            if len(nz):
                return lo + int(nz[-1]) + 1
        nz = np.flatnonzero(rows.any(axis=0))
        return int(nz[-1]) + 1 if len(nz) else 1

    def stack_frames(self, stack_id: int, pid: int) -> list:
        """Symbolized user frames of a stack, outermost first."""
        if stack_id < 0:
            return []
        if stack_id >= abi.STACK_COLLIDED:  # refused by the stack map (bpf/kvtrace.h)
            if stack_id not in self._collided_stacks:
                self._collided_stacks = {
                    v.value: list(program.stack_ips(k.ip))
                    for k, v in self.bpf["collided_stacks"].items()}
            addrs = self._collided_stacks.get(stack_id, [])
        else:
            try:
                addrs = list(self.bpf["stacks"].walk(stack_id))
            except KeyError:
                return []
        frames = []
        for addr in reversed(addrs):
            frames.append(self.bpf.sym(addr, pid, show_module=True).decode(errors="replace"))
        return frames
