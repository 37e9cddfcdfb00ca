"""Shared helpers for the end-to-end tests: they run the real CLI, load real
BPF programs and trace real kvsim processes.  Expected values always come
from kvsim's own ground truth (--truth), never from the tracer's code."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile

ROOT = Path(__file__).resolve().parents[1]
KVSIM = ROOT / "tests" / "target" / "kvsim"
KVSIM_LIB = ROOT / "tests" / "target" / "libkvsim_ops.so"
WRITE_OPS = ("reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
             "cpu_attn_reshape_and_cache")
UPROBE_EVENTS = Path("/sys/kernel/tracing/uprobe_events")


def kvtrace_cmd(*args):
    return [sys.executable, "-m", "tracer.cli", *map(str, args)]


def run_kvtrace(*args, timeout=120, **kw):
    return subprocess.run(kvtrace_cmd(*args), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kw)


_pending = {}  # stream -> bytes read past the last line returned


def read_line(stream, needle, timeout):
    """Read lines from a pipe until one contains needle; all lines read.

    Reads the file descriptor itself: a buffered reader may hold several
    lines that select() no longer reports."""
    fd = stream.fileno()
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        buf = _pending.pop(stream, b"")
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            seen.append(line.decode(errors="replace") + "\n")
            if needle in seen[-1]:
                _pending[stream] = buf
                return seen
        _pending[stream] = buf
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            _pending[stream] = _pending.pop(stream, b"") + data
    raise AssertionError(f"no line with {needle!r} within {timeout}s; got {seen!r}")


class Kvsim:
    """A kvsim process started paused (--pause): attach first, then go()."""

    def __init__(self, tmp_path, workload="default", *extra, pause=True):
        self.truth_path = tmp_path / f"truth-{workload}-{time.monotonic_ns()}.json"
        argv = [str(KVSIM), "--workload", workload, "--truth", str(self.truth_path),
                "--quiet", *map(str, extra)]
        if pause:
            argv.append("--pause")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.pid = self.proc.pid
        if pause:
            read_line(self.proc.stderr, "paused", 10)

    def go(self):
        os.kill(self.pid, signal.SIGUSR1)

    def stop(self, timeout=60):
        """End a long --repeat run now (SIGUSR2: after the repetition in
        progress, truth written, KV bytes checked); its exit status."""
        os.kill(self.pid, signal.SIGUSR2)
        return self.wait(timeout)

    def wait(self, timeout=60):
        return self.proc.wait(timeout)

    def truth(self):
        return json.loads(self.truth_path.read_text())

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_one_line_error(r, code, *words):
    """A user-facing failure: exit `code`, nothing on stdout, one line on
    stderr that starts with the program's name and holds every word."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("kvtrace-bpf"), lines[0]
    assert r.stdout == "", r.stdout
    for w in words:
        assert w in lines[0], lines[0]


# -- running without privileges ---------------------------------------------
#
# Two ways, neither of which depends on where the checkout lies (a fresh
# clone under root's 0700 home, or a 0700 temporary folder, which uid 65534
# could not even enter):
# NOBODY: uid 65534 with one ambient capability, CAP_DAC_READ_SEARCH, so that
#   it reads the checkout and the venv wherever they are; it still lacks
#   CAP_BPF and CAP_PERFMON, which is what the tests are about.
# NO_READ_OVERRIDE: root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
#   (for it and anything it starts): file permissions bind it as they bind
#   any user, so a file it does not own and may not read is refused.
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
          "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]
NO_READ_OVERRIDE = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                    "--bounding-set=-dac_override,-dac_read_search", "--"]
NOBODY_UID = 65534


def run_as(prefix, *args, timeout=120):
    """The CLI run under prefix (NOBODY, NO_READ_OVERRIDE).  Where that user
    cannot even import the tracer the test FAILS: a skip would let CI pass
    without the check."""
    probe = subprocess.run([*prefix, sys.executable, "-c", "import tracer.cli"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.fail(f"cannot run the tracer as {' '.join(prefix)}: "
                    f"{probe.stderr.strip()[-300:]}")
    return subprocess.run([*prefix, *kvtrace_cmd(*args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def hang_report(pid, pipe=None):
    """Where a process that does not end is: each thread's state and kernel
    stack (root reads /proc/PID/task/TID/stack), and which processes hold
    `pipe` open, at either end (the test itself among them): a writer other
    than the process keeps communicate() waiting after the process ended."""
    lines = []
    try:
        with open(f"/proc/{pid}/stat") as f:
            lines.append(f"pid {pid}: {f.read().split(')')[-1].split()[0]}")
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/stat") as f:
                    state = f.read().split(")")[-1].split()[0]
                with open(f"{base}/wchan") as f:
                    wchan = f.read().strip()
                with open(f"{base}/stack") as f:
                    stack = " < ".join(x.split()[-1] for x in f.read().splitlines()[:12])
            except OSError as e:
                state, wchan, stack = "?", "?", str(e)
            lines.append(f"  thread {tid} {state} wchan={wchan}: {stack}")
    except OSError as e:
        lines.append(f"pid {pid}: {e}")
    if pipe is not None:
        try:
            inode = os.fstat(pipe.fileno()).st_ino
            holders = []
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                try:
                    for fd in os.listdir(f"/proc/{name}/fd"):
                        if os.readlink(f"/proc/{name}/fd/{fd}") == f"pipe:[{inode}]":
                            holders.append(name)
                            break
                except OSError:
                    continue
            lines.append(f"  its stderr pipe is held by pids {holders}")
        except (OSError, ValueError) as e:
            lines.append(f"  pipe holders unknown: {e}")
    return "\n".join(lines)


class Tracer:
    """`kvtrace-bpf attach` running in the background."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen(kvtrace_cmd("attach", *args), cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.early_err = ""

    def wait_attached(self, timeout=300):
        try:
            self.early_err = "".join(read_line(self.proc.stderr, "ready after", timeout))
        except AssertionError as e:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"tracer did not attach: {e}\n{out}{err}") from None

    def finish(self, timeout=300):
        """(exit code, stdout, all of stderr).  A tracer still running after
        timeout is asked where it is (SIGQUIT: faulthandler's stacks), then
        killed, and the test fails with its stderr's end."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = hang_report(self.proc.pid, self.proc.stderr)
            self.proc.send_signal(signal.SIGQUIT)
            time.sleep(3)
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"tracer still running {timeout}s on; {where}\n"
                                 f"its stderr ends:\n{(self.early_err + err)[-6000:]}") from None
        fd_rest = _pending.pop(self.proc.stderr, b"").decode(errors="replace")
        return self.proc.returncode, out, self.early_err + fd_rest + err

    def kill(self):
        """Cleanup after a failed test: no tracer is left running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def readelf_probes(path=KVSIM_LIB) -> list:
    """[(provider, name)] of the USDT notes of path, as binutils' `readelf -n`
    lists them: the counts the tests expect come from the binary itself, not
    from a number written here nor from the tracer's own reader."""
    out = subprocess.run(["readelf", "-n", str(path)], check=True, capture_output=True,
                         text=True).stdout
    probes = re.findall(r"Provider: (\S+)\s+Name: (\S+)", out)
    assert probes, f"readelf found no USDT notes in {path}"
    return probes


def kvsim_truth(tmp_path, workload="default", *extra) -> dict:
    """kvsim's ground truth for a workload from an untraced run of its own:
    the layer and block counts a test needs before (or without) tracing."""
    path = tmp_path / f"truth-untraced-{workload}-{time.monotonic_ns()}.json"
    subprocess.run([str(KVSIM), "--workload", workload, "--truth", str(path), "--quiet",
                    *map(str, extra)], check=True, timeout=120)
    return json.loads(path.read_text())


def kvsim_ops_log(path, leader=None):
    """kvsim's --ops-log: [(op, cache_id, values, swap flags)] in firing order,
    one per op fired while its probe was enabled (complete lines only: a
    killed kvsim may leave half of one).

    kvsim logs the read probe (block_table: cache_id is the group id) at
    every layer, the tracer reads it at one layer a step, its group's leader:
    `leader` (the layer's cache id, from the trace's groups), or by default
    the first layer logged, which is the tracer's when it attached before
    kvsim ran (--pause)."""
    from tracer import abi

    text = Path(path).read_text()
    out = []
    for line in text[:text.rfind("\n") + 1].splitlines():
        name, cache_id, *values = line.split()
        if name == "block_table":
            layer, *values = values
            if leader is None:
                leader = int(layer)
            if int(layer) != leader:
                continue
        name, _, direction = name.partition(":")
        flags = {"": 0, "out": abi.EV_SWAP_OUT, "in": abi.EV_SWAP_IN}[direction]
        out.append((name, int(cache_id), np.array(values, np.int64), flags))
    return out


def assert_log_covers(op_ids, fired):
    """Every kind of op the tracer saw is one kvsim's --ops-log logs (a
    probe added to kvsim without its log_op() would make every comparison
    with the log wrong, so say that instead)."""
    from tracer import abi

    missing = {abi.OP_NAMES.get(int(x), str(x)) for x in np.unique(op_ids)} - \
        {name for name, *_ in fired}
    assert not missing, (f"kvsim's --ops-log has no {sorted(missing)}: call log_op() at "
                         "their probe sites in tests/target/kvsim_ops.c")


def semaphore_values(pid, lib=KVSIM_LIB):
    """The vllm_*_semaphore counters in a live process, read from its memory.

    Found through the library's symbol table (not the stapsdt notes the
    tracer uses) and the process's mapping of the library."""
    with open(lib, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        syms = {s.name: s["st_value"] for s in symtab.iter_symbols()
                if s.name.startswith("vllm_") and s.name.endswith("_semaphore")}
        first_vaddr = min(seg["p_vaddr"] for seg in elf.iter_segments()
                          if seg["p_type"] == "PT_LOAD")
    real = os.path.realpath(lib)
    with open(f"/proc/{pid}/maps") as f:
        starts = [int(line.split("-")[0], 16) for line in f
                  if line.rstrip().endswith(real) and int(line.split()[2], 16) == 0]
    assert starts, f"{lib} not mapped in {pid}"
    base = starts[0] - first_vaddr
    values = {}
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for name, vaddr in syms.items():
            mem.seek(base + vaddr)
            values[name[len("vllm_"):-len("_semaphore")]] = int.from_bytes(mem.read(2), "little")
    assert len(values) == len(readelf_probes(lib)), values
    return values


def code_differences(pid, path=KVSIM_LIB):
    """Offsets where the executable mappings of `path` in pid differ from the
    file: a uprobe is an int3 the kernel writes into the target's code, so
    none may be left once every tracer has gone.  Reads only, through
    /proc/PID/mem, and compares with the file on disk (not the tracer)."""
    real = os.path.realpath(path)
    diffs = []
    with open(f"/proc/{pid}/maps") as maps, open(real, "rb") as f, \
            open(f"/proc/{pid}/mem", "rb") as mem:
        code = [line.split() for line in maps if line.rstrip().endswith(real)]
        code = [c for c in code if "x" in c[1]]
        assert code, f"{real}: no executable mapping in {pid}"
        for c in code:
            lo, hi = (int(x, 16) for x in c[0].split("-"))
            off = int(c[2], 16)
            f.seek(off)
            want = f.read(hi - lo)
            mem.seek(lo)
            got = mem.read(len(want))
            if got != want:
                where = np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))
                diffs += [off + int(i) for i in where]
    return diffs


def code_byte(pid, path, offset):
    """The byte at file offset `offset` of `path` as mapped in pid (read only)."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                off = int(parts[2], 16)
                if off <= offset < off + hi - lo:
                    with open(f"/proc/{pid}/mem", "rb") as mem:
                        mem.seek(lo + offset - off)
                        return mem.read(1)[0]
    raise AssertionError(f"{path}+{offset:#x} not mapped in {pid}")


def unused_pid():
    """A pid no process has: above the default pid_max (4194304)'s busy range."""
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def uprobe_events():
    return UPROBE_EVENTS.read_text() if UPROBE_EVENTS.exists() else ""


def dense(pairs, n):
    out = [0] * n
    for block, count in pairs:
        assert 0 <= block < n, f"block {block} outside 0..{n - 1}"
        out[block] = count
    return out


def assert_matches_truth(doc, truth):
    """Every exact count of a --json aggregate against kvsim's ground truth."""
    assert doc["exact"] is True, doc["inexact_reasons"]
    assert [p["pid"] for p in doc["processes"]] == [truth["pid"]]
    proc = doc["processes"][0]
    n = truth["num_blocks"]
    got_layers = {l["cache_id"]: l for l in proc["layers"]}
    assert sorted(got_layers) == sorted(l["cache_id"] for l in truth["layers"])
    for want in truth["layers"]:
        got = got_layers[want["cache_id"]]
        assert got["block_size"] == truth["block_size"]
        assert got["num_blocks"] == n
        assert dense(got["writes"], n) == want["writes"], f"layer {want['layer']}"
    assert dense(proc["blocks"]["tokens"], n) == truth["token_writes"]
    for kind in ("copy_src", "copy_dst", "swap_out", "swap_in"):
        assert dense(proc["blocks"][kind], n) == truth[kind], kind
    zero = {"calls": 0, "items": 0, "slots": 0, "padding": 0, "bytes": 0}
    for op, want in truth["ops"].items():
        got = doc["ops"].get(op, zero)
        assert got["calls"] == want["calls"], op
        assert got["slots"] == want["slots"], op
        assert got["padding"] == want["padding"], op
        # write ops carry no byte count: null, not 0 (docs/json-schema.md)
        assert got["bytes"] == (None if op in WRITE_OPS and op in doc["ops"] else
                                want["bytes"]), op
        if op not in WRITE_OPS:
            assert got["items"] == want["pairs"], op
    # slots written: the write ops' (block_table's "slots" are blocks read)
    writes = [o for op, o in doc["ops"].items() if op in WRITE_OPS]
    assert sum(o["slots"] for o in writes) == truth["slots_written"]
    assert sum(o["padding"] for o in writes) == truth["padding_skipped"]


def truth_records(truth):
    """Per-op records the tracer sends for kvsim's run when nothing is lost:
    one per write, copy or swap call, one per step for the block table,
    which every layer passes but the tracer reads once per step and group
    (bpf/kvtrace_probes.h), and one per lifecycle probe call (the plugin
    tier's; a truth from before it has none)."""
    life = truth.get("lifecycle", {}).get("calls", {})
    return (sum(o["calls"] for o in truth["ops"].values()) + truth["reads"]["steps"] +
            sum(life.values()))


def assert_reads_match_truth(doc, truth):
    """The vllm:block_table counts of a --json aggregate against kvsim's
    "reads" truth (tests/target/kvsim.c, write_reads): kvsim's layers share
    one block table, so one group, read once per step."""
    want = truth["reads"]
    (proc,) = doc["processes"]
    (got,) = proc["groups"]
    n = truth["num_blocks"]
    assert got["group_id"] == want["group_id"]
    assert (got["block_size"], got["num_blocks"]) == (want["block_size"], n)
    for k in ("steps", "requests", "tokens", "reads", "distinct", "held_tokens",
              "null_entries"):
        assert got[k] == want[k], k
    assert got["layer_calls"] == want["steps"] * want["layers"]
    assert (got["out_of_range"], got["truncated"], got["read_errors"]) == (0, 0, 0)
    assert dense(got["reads_per_block"], n) == dense(want["per_block"], n)
    # both count steps from the process's first: the tracer must have been
    # attached before kvsim's first step
    assert dense(got["last_read_step"], n) == dense(want["last_step"], n)
    # the op totals: one call per step, items = reads, slots = the live
    # sets, padding = null entries (tokens are the group's, above)
    op = doc["ops"]["block_table"]
    assert (op["calls"], op["items"], op["slots"], op["padding"]) == (
        want["steps"], want["reads"], want["distinct"], want["null_entries"])


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """A TMPDIR of the suite's own for every process it starts, removed at
    the end (tracer.files.private_tmpdir: the suite's vLLMs left over a
    hundred files in /tmp a run).  pytest's own directory is fixed first,
    so it stays where --basetemp or the real TMPDIR put it."""
    from tracer import files

    tmp_path_factory.getbasetemp()
    with files.private_tmpdir("kvtrace-tests") as path:
        yield path


@pytest.fixture(scope="session")
def bpf_env():
    if os.geteuid() != 0:
        pytest.fail("end-to-end tests load BPF programs into the kernel: run as root "
                    "(sudo make test)")
    assert KVSIM.exists(), "kvsim is not built: run make setup"


@pytest.fixture
def no_leftovers(bpf_env):
    """Nothing of ours stays registered after a test."""
    before = uprobe_events()
    yield
    assert uprobe_events() == before
    assert "kvsim" not in uprobe_events()


# -- a tiny model for real vLLM on the CPU -----------------------------------

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def make_tiny_model(tmp_path_factory, *extra):
    """A tiny random Llama (scripts/make-tiny-model.py, with its options
    `extra`) in a directory of its own: real vLLM runs it on the CPU."""
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM CPU environment is missing: run make setup")
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([VLLM_PYTHON, ROOT / "scripts" / "make-tiny-model.py", path,
                    *map(str, extra)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, bpf_env):
    return make_tiny_model(tmp_path_factory)


# -- the index stream (tracer/trace/stream.py), in-process -----------------------

def trace_stream(tmp_path, workload, *extra, perf_pages=256):
    """Trace one paused kvsim through the Tracer API with the index stream on.
    Returns (OpStream, the final map snapshot, kvsim's ground truth)."""
    from tracer.probes import discover
    from tracer.trace import stream
    from tracer.kernel.session import Tracer

    sim = Kvsim(tmp_path, workload, *extra)
    tracer = None
    try:
        tracer = Tracer(index_stream=True, perf_pages=perf_pages)
        tracer.attach(sim.pid, discover.process_probe_files(sim.pid))
        sim.go()
        batches = []
        while sim.proc.poll() is None:
            tracer.poll(50)
            batches.append(tracer.stream.take())
        tracer.detach()
        tracer.drain()
        batches.append(tracer.stream.take())
        assert sim.wait() == 0
        raw = tracer.read_maps()
    finally:
        if tracer is not None:
            tracer.close()
        sim.kill()
    return stream.decode(batches), raw, sim.truth()


# a trace file's first bytes (tracer/trace/tracefile.py MAGIC), written here
# so that a change there cannot make this fixture find no trace at all
TRACE_MAGIC = b"KVTRACE\0"
_CHECKED = set()


def _traces_written_since(dirs, since):
    for d in dirs:
        for path in Path(d).rglob("*"):
            try:
                if path.is_symlink() or not path.is_file() or path.stat().st_mtime < since:
                    continue
                with open(path, "rb") as f:
                    if f.read(len(TRACE_MAGIC)) != TRACE_MAGIC:
                        continue
            except OSError:
                continue  # gone meanwhile, or not ours to read (a fifo, a socket)
            st = path.stat()
            key = (str(path), st.st_mtime_ns, st.st_size)
            if key not in _CHECKED:
                _CHECKED.add(key)
                yield path


@pytest.fixture(autouse=True)
def invariants_of_every_recording(request, tmp_path_factory, private_tmpdir):
    """Every trace file an end-to-end test writes (any file with a trace's
    magic under the suite's temporary directories, written during the test,
    by the test or its module's fixtures) passes `report --check`: the
    figures of its report agree with each other (tracer/analysis/
    invariants.py).  A file report cannot read even with --partial (the
    error tests' damaged ones) has no figures to check: report says so on
    stderr and prints no check line."""
    if not request.module.__name__.startswith(("test_e2e_", "test_kvsim_truth")):
        yield
        return
    since = time.time() - 1
    yield
    for path in _traces_written_since((tmp_path_factory.getbasetemp(), private_tmpdir), since):
        r = run_kvtrace("report", path, "--check", "--partial", timeout=600)
        fails = [line for line in r.stdout.splitlines() if not line.startswith("ok ")]
        assert not fails and r.returncode in (0, 4), \
            f"report --check {path}: rc {r.returncode}\n{r.stdout}{r.stderr[-2000:]}"
        assert r.returncode == 0 or (not r.stdout and "kvtrace-bpf:" in r.stderr), r.stderr


def listening_sockets(pid) -> set:
    """(address, port) of every TCP socket process pid listens on, read
    from the kernel's tables (/proc/PID/net/tcp, tcp6) for the socket
    inodes among its fds: the address it actually bound, which a connect to
    127.0.0.1 cannot tell from 0.0.0.0."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: TCP_LISTEN
                    continue
                addr_hex, port_hex = local.split(":")
                raw = bytes.fromhex(addr_hex)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                out.add((str(ipaddress.ip_address(raw)), int(port_hex, 16)))
    return out
