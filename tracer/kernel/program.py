"""The BPF program, compiled once: bcc's output cached, loaded without LLVM.

bcc compiles bpf/kvtrace.bpf.c with clang and LLVM at run time: about 2 s on
an idle machine (most of it LLVM's optimizer), and the process
that does it keeps ~60 MB of LLVM resident.  The program's text depends only
on its cflags (limits, stacks, index stream, transport), never on the target:
probe sites are data in the `sites` map.  So the compile is done once per
program text, kernel and bcc, in a short-lived child process
(`python -m tracer.kernel.program`), which writes what bcc produced:

- every map's spec as the kernel took it (type, key and value size, entries,
  flags) and bcc's JSON description of its key and value types;
- every program's instructions, with each reference to a map (an ld_imm64
  whose src_reg is BPF_PSEUDO_MAP_FD and whose imm is the child's map fd)
  turned into the map's index, and the bpf_loop() callbacks it names
  appended to it (bcc leaves a reference to another function unrelocated:
  link_callbacks does it, and the loader gives the kernel the BTF function
  info that a program with callbacks needs).

A tracer then creates the maps through libbcc_bpf, bcc's loader library (bpf.py),
which links no LLVM, writes its own fds into those instructions and loads the
programs itself (BPF_PROG_LOAD), each with the attach type of the way the
session attaches it: the one uprobe_multi links need (attach_type()), or 0
for perf events.  Why a cache of bcc's output and not a prebuilt
libbpf object: docs/design.md, "Compile once".

The entries live in the tracer's cache directory (cache.py), which only its
owner can write: what is in them is loaded into the kernel.  A missing,
stale, corrupt or refused entry is compiled again; without a usable cache
directory the compile still runs in a child, into a private temporary
directory.
"""

import base64
import ctypes
import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from .. import abi, cache
from ..errors import EnvironmentProblem
from . import symbolize, uprobes
from .bpf import (BPF_TRACE_UPROBE_MULTI, FUNC_BTF, LOST_CB, PROG_INFO_SIZE,
                  PROG_INFO_VERIFIED_INSNS, RAW_CB, RINGBUF_CB, libbcc_bpf, load_btf,
                  load_prog, map_info, obj_info, oserror, trivial_program)

FORMAT = 3  # bump when the cache entry's layout changes (2: verified_insns, 3: subprogs)
BPF_PSEUDO_MAP_FD = 1
BPF_PSEUDO_FUNC = 4
_MOV64_X = 0xbf  # BPF_ALU64 | BPF_MOV | BPF_X: dst = src
_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots

# bcc's names for C scalar types in its JSON type descriptions, as its own
# Python module decodes them (bcc/__init__.py, BPF.str2ctype)
_CTYPES = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "unsigned char": ctypes.c_ubyte,
    "signed char": ctypes.c_byte, "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort, "int": ctypes.c_int, "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long, "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2,
}


def _desc(text: bytes):
    """bcc's JSON description of a map's key or leaf; None for a keyless
    map (a queue), which bcc describes with an empty string."""
    return json.loads(text) if text else None


def _key_type(desc):
    return None if desc is None else decode_type(desc)


def decode_type(desc):
    """A ctypes type from bcc's JSON description of a C type: a scalar's
    name, or [name, [[field, type], [field, type, [n]] (array),
    [field, type, bits]], "struct" | "union" | "struct_packed"].  The same
    decoding as bcc's BPF._decode_table_type, which cannot be imported
    without loading LLVM (bcc's module loads libbcc at import)."""
    if isinstance(desc, str):
        try:
            return _CTYPES[desc]
        except KeyError:
            raise ValueError(f"unknown C type {desc!r}") from None
    name, members = desc[0], desc[1]
    kind = desc[2] if len(desc) > 2 else "struct"
    fields, anonymous = [], []
    for m in members:
        if len(m) == 2:
            fields.append((m[0], decode_type(m[1])))
        elif len(m) == 3 and isinstance(m[2], list):
            fields.append((m[0], decode_type(m[1]) * m[2][0]))
        elif len(m) == 3 and isinstance(m[2], int):
            fields.append((m[0], decode_type(m[1]), m[2]))
        elif len(m) == 3 and m[2] in ("struct", "union", "struct_packed"):
            field_name = m[0] or f"__anon{len(anonymous)}"
            if not m[0]:
                anonymous.append(field_name)
            fields.append((field_name, decode_type(m)))
        else:
            raise ValueError(f"cannot decode member {m!r}")
    base = ctypes.Union if kind == "union" else ctypes.Structure
    body = dict(_anonymous_=anonymous, _fields_=fields)
    if kind == "struct_packed":
        body["_pack_"] = 1
    return type(str(name), (base,), body)


_attach_type = None


def attach_type() -> int:
    """The expected_attach_type a program needs for a uprobe_multi link
    (uprobes.UprobeLink): BPF_TRACE_UPROBE_MULTI where the kernel takes
    it, else 0.  Decided once per process, by loading a two-instruction
    program.  A program loaded so goes on links only: this VM's 6.18.44
    kernel refuses it on a perf event (PERF_EVENT_IOC_SET_BPF: EINVAL,
    seen 2026-12-02; the same version took it before), so every program
    of a session is loaded for the one way it attaches (session.py), the
    tail-called stages included: since 6.17 the kernel refuses a tail call
    between programs of different attach types."""
    global _attach_type
    if _attach_type is None:
        fd = trivial_program(BPF_TRACE_UPROBE_MULTI)
        if fd >= 0:
            os.close(fd)
        _attach_type = BPF_TRACE_UPROBE_MULTI if fd >= 0 else 0
    return _attach_type


def _verifier_says(load) -> str:
    """The verifier's last words on a program it refused: `load(log)` loads
    it again with a log (the kernel keeps the log's end when it is long)."""
    log = ctypes.create_string_buffer(1 << 20)
    load(log)
    lines = [line for line in log.value.decode(errors="replace").splitlines()
             if line.strip() and not line.startswith("processed ")]
    return lines[-1].strip() if lines else ""


def trial_callback_load() -> int:
    """Load a kprobe program that passes a callback to bpf_loop(), as the
    table stage does, through the same linker and loader, and close it: 0,
    or the errno the kernel answered (`doctor`)."""
    def insn(code, regs=0, imm=0):
        return struct.pack("<BBhi", code, regs, 0, imm)

    mov_k, exit_ = 0xB7, 0x95
    marker = insn(_LD_IMM64, 2, 1) + insn(0, 0, abi.CALLBACK_MARK)  # r2 = callback 1
    main = (insn(mov_k, 1, 1) + marker + insn(mov_k, 3) + insn(mov_k, 4)
            + insn(0x85, 0, 181) + insn(mov_k) + insn(exit_))  # bpf_loop(1, cb, 0, 0)
    insns, subprogs = link_callbacks(main, {1: insn(mov_k) + insn(exit_)})
    buf = ctypes.create_string_buffer(insns, len(insns))
    try:
        btf_fd = load_btf(FUNC_BTF)
    except OSError as e:
        return e.errno
    try:
        fd = load_prog(b"kvtrace_doctor", buf, len(insns), b"GPL", 0, btf_fd, subprogs)
        if fd < 0:
            return ctypes.get_errno()
        os.close(fd)
        return 0
    finally:
        os.close(btf_fd)


def _instructions(insns: bytes):
    """(index, code, regs, imm) of each instruction of a program; an ld_imm64
    takes two slots, and its second half is no instruction."""
    at = 0
    while at < len(insns) // 8:
        code, regs, _off, imm = struct.unpack_from("<BBhi", insns, at * 8)
        yield at, code, regs, imm
        at += 2 if code == _LD_IMM64 else 1


def link_callbacks(insns: bytes, callbacks: dict) -> tuple:
    """(instructions, subprogs): a program's instructions with each
    callback it names by marker (KVTRACE_CALLBACK() in bpf/kvtrace.bpf.c)
    appended once, and the marker turned into a BPF_PSEUDO_FUNC load of it
    (imm: the callback's first instruction, counted from the one after the
    load, as for a call).  callbacks: id -> the callback's instructions."""
    out = bytearray(insns)
    starts = {}
    for at, code, regs, imm in _instructions(insns):
        if code != _LD_IMM64 or regs >> 4 != 0 or \
                struct.unpack_from("<I", insns, at * 8 + 12)[0] != abi.CALLBACK_MARK:
            continue
        if imm not in callbacks:
            raise ValueError(f"instruction {at} names callback {imm}, which is not compiled")
        if imm not in starts:
            starts[imm] = len(out) // 8
            out += callbacks[imm]
        struct.pack_into("<BBhi", out, at * 8, _LD_IMM64,
                         BPF_PSEUDO_FUNC << 4 | regs & 0x0F, 0, starts[imm] - at - 1)
        struct.pack_into("<BBhi", out, at * 8 + 8, 0, 0, 0, 0)
    return bytes(out), sorted(starts.values())


def check_callback(name: str, insns: bytes):
    """A callback takes its state from r2 as it is on entry
    (KVTRACE_CALLBACK_STATE): before that move, the compiler may only have
    set other registers (`r0 = 1` for an early return, say), with no jump,
    call or write of r2 between, or r2 may no longer be bpf_loop()'s."""
    at = 0
    for at, code, regs, _imm in _instructions(insns[:16 * 8]):
        if code == _MOV64_X and regs >> 4 == 2:
            return
        jumps = code & 0x07 in (0x05, 0x06)  # BPF_JMP, BPF_JMP32: calls, exits too
        writes = code & 0x07 in (0x00, 0x01, 0x04, 0x07)  # LD, LDX, ALU, ALU64: dst
        if jumps or (writes and regs & 0x0F == 2):
            break
    raise ValueError(f"{name} does not start by taking r2 (instruction {at} is "
                     f"{insns[at * 8:at * 8 + 8].hex()})")


class Map:
    """One BPF map: typed lookups, updates and iteration (bcc's Table API,
    as much of it as the tracer uses)."""

    def __init__(self, name: str, fd: int, key_type, leaf_type):
        self.name, self.map_fd = name, fd
        self.Key, self.Leaf = key_type, leaf_type

    def __getitem__(self, key):
        leaf = self.Leaf()
        if libbcc_bpf().bpf_lookup_elem(self.map_fd, ctypes.byref(key), ctypes.byref(leaf)) < 0:
            raise KeyError(key)
        return leaf

    def __setitem__(self, key, leaf):
        if libbcc_bpf().bpf_update_elem(self.map_fd, ctypes.byref(key), ctypes.byref(leaf), 0) < 0:
            raise oserror(f"updating map {self.name}")

    def __delitem__(self, key):
        if libbcc_bpf().bpf_delete_elem(self.map_fd, ctypes.byref(key)) < 0:
            raise KeyError(key)

    def keys(self):
        lib, prev, keys = libbcc_bpf(), None, []
        while True:
            key = self.Key()
            if lib.bpf_get_next_key(self.map_fd, prev, ctypes.byref(key)) < 0:
                return keys
            keys.append(key)
            prev = ctypes.byref(key)

    def items(self):
        """(key, value) pairs; a key deleted while we walk is left out."""
        out = []
        for key in self.keys():
            try:
                out.append((key, self[key]))
            except KeyError:
                pass
        return out

    # a queue map's (BPF_QUEUE: no key)
    def push(self, leaf):
        if libbcc_bpf().bpf_update_elem(self.map_fd, None, ctypes.byref(leaf), 0) < 0:
            raise oserror(f"pushing to map {self.name}")

    def pop(self):
        leaf = self.Leaf()
        if libbcc_bpf().bpf_lookup_and_delete(self.map_fd, None, ctypes.byref(leaf)) < 0:
            raise KeyError(f"{self.name} is empty")
        return leaf

    def walk(self, stack_id: int):
        """The addresses of a stack-trace map's entry, innermost first."""
        return stack_ips(self[self.Key(stack_id)].ip)


def stack_ips(ips):
    """A stack's addresses, innermost first: the array's entries up to its
    first 0 (the kernel's stack map and collided_stacks both pad with 0)."""
    for ip in ips:
        if not ip:
            return
        yield ip


class ProgramFd:
    def __init__(self, name: str, fd: int):
        self.name, self.fd = name, fd


def _online_cpus() -> list:
    with open("/sys/devices/system/cpu/online") as f:
        text = f.read().strip()
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


class LoadedProgram:
    """The maps and programs of one cached compile, in the kernel."""

    def __init__(self, entry: dict, kind: int):
        lib = libbcc_bpf()
        self.maps, self._fds, self._progs = {}, [], {}
        self._readers, self._ringbuf, self._callbacks = [], None, []
        try:
            fds = []
            for spec in entry["maps"]:
                fd = lib.bcc_create_map(spec["type"], spec["name"][:15].encode(),
                                        spec["key_size"], spec["value_size"],
                                        spec["max_entries"], spec["flags"])
                if fd < 0:
                    raise oserror(f"creating map {spec['name']}")
                self._fds.append(fd)
                fds.append(fd)
                self.maps[spec["name"]] = Map(spec["name"], fd, _key_type(spec["key"]),
                                              decode_type(spec["leaf"]))
                self.maps[spec["name"]].max_entries = spec["max_entries"]
            license_ = entry["license"].encode()

            btf_fd = None
            if any(prog.get("subprogs") for prog in entry["progs"]):
                btf_fd = load_btf(FUNC_BTF)
                self._fds.append(btf_fd)

            def load_one(prog):
                insns = bytearray(base64.b64decode(prog["insns"]))
                for at, map_index in prog["map_refs"]:
                    struct.pack_into("<i", insns, at * 8 + 4, fds[map_index])
                buf = (ctypes.c_char * len(insns)).from_buffer(insns)
                name = prog["name"][:15].encode()

                def load(log=None):
                    return load_prog(name, buf, len(insns), license_, entry["kern_version"],
                                      btf_fd, prog.get("subprogs") or [], log, 1, kind)
                fd = load()
                if fd < 0:
                    error = oserror(f"loading {prog['name']}")
                    why = _verifier_says(load)
                    return prog["name"], fd, OSError(error.errno, f"{error.strerror}"
                                                     + (f" (the verifier: {why})"
                                                        if why else ""))
                return prog["name"], fd, None

            # The verifier is most of the load and runs in each bpf() call
            # with the GIL released: one thread per CPU loads the programs
            # side by side, the costliest to verify first (the table stage
            # is a third of the whole), so that no CPU is left with it at the
            # end while the others idle
            order = sorted(entry["progs"], key=lambda p: -p.get("verified_insns", 0))
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                loaded = list(pool.map(load_one, order))
            for name, fd, _ in loaded:
                if fd >= 0:
                    self._fds.append(fd)
                    self._progs[name] = ProgramFd(name, fd)
            for _, _, error in loaded:
                if error is not None:
                    raise error
        except BaseException:
            self.cleanup()
            raise

    def __getitem__(self, name: str) -> Map:
        return self.maps[name]

    def load_func(self, name) -> ProgramFd:
        name = name.decode() if isinstance(name, bytes) else name
        try:
            return self._progs[name]
        except KeyError:
            raise KeyError(f"no program {name} in the BPF object") from None

    # -- the per-op stream: perf buffer or ring buffer ------------------------

    def open_perf_buffer(self, map_name: str, callback, page_cnt: int, lost_cb,
                         wakeup_events: int = 1, wakeup_bytes: int = 0):
        """A bcc perf reader per CPU on an event that this opens itself
        (uprobes.bpf_output_event): bcc's own opener cannot wake the
        reader by the bytes waiting, only per so many records."""
        lib, table = libbcc_bpf(), self.maps[map_name]
        for cpu in _online_cpus():
            def raw(_cookie, data, size, cpu=cpu):
                callback(cpu, data, size)
            raw_fn, lost_fn = RAW_CB(raw), LOST_CB(lambda _cookie, n: lost_cb(n))
            reader = lib.perf_reader_new(raw_fn, lost_fn, None, page_cnt)
            if not reader:
                raise oserror(f"opening the perf buffer on CPU {cpu}")
            self._readers.append(reader)  # perf_reader_free closes its fd too
            self._callbacks.append((raw_fn, lost_fn))  # alive as long as the reader
            fd = uprobes.bpf_output_event(cpu, wakeup_events, wakeup_bytes)
            lib.perf_reader_set_fd(reader, fd)
            if lib.perf_reader_mmap(reader) < 0:
                raise oserror(f"mapping the perf buffer on CPU {cpu}")
            uprobes.enable(fd)
            table[ctypes.c_int(cpu)] = ctypes.c_int(fd)

    def open_ring_buffer(self, map_name: str, callback):
        def raw(_ctx, data, size):
            callback(_ctx, data, size)
            return 0
        fn = RINGBUF_CB(raw)
        self._ringbuf = libbcc_bpf().bpf_new_ringbuf(self.maps[map_name].map_fd, fn, None)
        if not self._ringbuf:
            raise oserror("opening the ring buffer")
        self._callbacks.append(fn)

    def _reader_array(self):
        return (ctypes.c_void_p * len(self._readers))(*self._readers)

    def perf_buffer_poll(self, timeout_ms: int = -1):
        libbcc_bpf().perf_reader_poll(len(self._readers), self._reader_array(), timeout_ms)

    def perf_buffer_consume(self):
        libbcc_bpf().perf_reader_consume(len(self._readers), self._reader_array())

    def ring_buffer_poll(self, timeout_ms: int = -1):
        libbcc_bpf().bpf_poll_ringbuf(self._ringbuf, timeout_ms)

    def ring_buffer_consume(self):
        libbcc_bpf().bpf_consume_ringbuf(self._ringbuf)

    _symbolizer = None  # one for the process: bcc's, in a child (tracer/symbolize.py)

    @classmethod
    def sym(cls, addr: int, pid: int, show_module: bool = False) -> bytes:
        """A user address as `function [module]`, demangled, or `[unknown]`:
        what bcc's BPF.sym gives, through the same symbolizer in libbcc_bpf
        (bcc's Python module would load LLVM), run in a child process."""
        if LoadedProgram._symbolizer is None:
            LoadedProgram._symbolizer = symbolize.Symbolizer()
        return LoadedProgram._symbolizer.sym(addr, pid, show_module)

    def cleanup(self):
        lib = libbcc_bpf()
        for reader in self._readers:
            lib.perf_reader_free(reader)
        self._readers = []
        if self._ringbuf:
            lib.bpf_free_ringbuf(self._ringbuf)
            self._ringbuf = None
        self._callbacks = []
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError as e:
                # Already closed by someone else: seen at exit after -o,
                # when bcc's symbolizer still ran in this process and closed
                # a number it never opened (tracer/symbolize.py says why it
                # now runs in a child).  Exiting cleanly matters more here
                # than the traceback.
                if e.errno != errno.EBADF:
                    raise
        self._fds, self._progs = [], {}


# -- the cache -----------------------------------------------------------------

def _loader_identity() -> str:
    """bcc's installed build (path, size, mtime of libbcc_bpf, shipped in
    the same package as the compiler): a new bcc compiles anew."""
    libbcc_bpf()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libbcc_bpf.so" in path:
                st = os.stat(path)
                return f"{path}:{st.st_size}:{st.st_mtime_ns}"
    return "unknown"


def _program_text_hash() -> str:
    """sha256 over every file of bpf/ (name and bytes): the program's text."""
    h = hashlib.sha256()
    for path in sorted(abi.BPF_DIR.iterdir()):
        if path.is_file():
            data = path.read_bytes()
            h.update(f"{path.name}:{len(data)}:".encode() + data)
    return h.hexdigest()


def _portable_cflags(cflags: list) -> list:
    """The cflags without include paths: those name where bpf/ lies on the
    machine that compiled, which says nothing about the program's text (its
    hash does)."""
    return [flag for flag in cflags if not flag.startswith("-I")]


def _kernel_version(release: str) -> str:
    """6.18.44 of 6.18.44-fc-v310-gpu: the kernel's own version, without the
    local build suffix."""
    return release.split("-", 1)[0]


def built_for(cflags: list) -> dict:
    """What a compiled entry was made for, recorded in it so that a pinned
    entry (KVTRACE_PROGRAM_ENTRY) can be checked on another machine."""
    uname = os.uname()
    return dict(bpf=_program_text_hash(), cflags=_portable_cflags(cflags),
                kernel=uname.release, machine=uname.machine)


BPF_MAP_TYPE_PERF_EVENT_ARRAY = 4


def _possible_cpus() -> int:
    with open("/sys/devices/system/cpu/possible") as f:
        return int(f.read().strip().split(",")[-1].split("-")[-1]) + 1


def read_pinned(path: str, cflags: list) -> dict:
    """The entry a user names with KVTRACE_PROGRAM_ENTRY, compiled on
    another machine (docs/design.md, "A pinned entry"), checked for what
    the cache key would otherwise cover: the entry's format, the program's
    text (bpf/), its flags, the kernel's version and the machine.  What
    the key covers and this does not: the kernel's local release suffix and
    build string, its headers' path, the CPUs and bcc's build.  The perf
    event array, which bcc sizes by the possible CPUs, is sized here for
    this machine's, as bcc would; the other maps do not depend on them."""
    entry = None
    try:
        with open(path, "rb") as f:
            # what is in it is loaded into the kernel: a file that others
            # could have written is not (the cache's rule, cache.py)
            if os.fstat(f.fileno()).st_mode & 0o022:
                raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} is writable by "
                                         f"others than its owner: not loaded")
            entry = json.loads(f.read())
    except OSError as e:
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: cannot read {path}: "
                                 f"{e.strerror}") from None
    except ValueError:
        pass
    if not isinstance(entry, dict) or read_entry(path, entry.get("key")) is None:
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} is not a compiled "
                                 f"program of format {FORMAT}")
    made = entry.get("built_for")
    if not isinstance(made, dict):
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} does not say what it "
                                 f"was compiled for (an entry from before pinning)")
    here = built_for(cflags)
    if made.get("bpf") != here["bpf"]:
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} was compiled from "
                                 f"another bpf/ than this tracer's")
    if made.get("cflags") != here["cflags"]:
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} was compiled for other "
                                 f"options: {' '.join(made.get('cflags') or [])} "
                                 f"(this attach: {' '.join(here['cflags'])})")
    if (_kernel_version(str(made.get("kernel"))), made.get("machine")) != \
            (_kernel_version(here["kernel"]), here["machine"]):
        raise EnvironmentProblem(f"KVTRACE_PROGRAM_ENTRY: {path} was compiled for kernel "
                                 f"{made.get('kernel')} on {made.get('machine')}, this is "
                                 f"{here['kernel']} on {here['machine']}")
    for spec in entry["maps"]:
        if spec["type"] == BPF_MAP_TYPE_PERF_EVENT_ARRAY:
            spec["max_entries"] = _possible_cpus()
    return entry


def cache_key(cflags: list) -> str:
    """What the compiled program depends on: its text (every file of bpf/,
    headers included), its flags, the kernel, its headers, the CPUs bcc
    sizes per-CPU maps by, and bcc itself."""
    h = hashlib.sha256()

    def add(label, value):
        data = value if isinstance(value, bytes) else str(value).encode()
        h.update(f"{label}:{len(data)}:".encode() + data)

    add("format", FORMAT)
    add("bpf", _program_text_hash())
    add("cflags", "\0".join(cflags))
    uname = os.uname()
    add("kernel", f"{uname.release} {uname.version} {uname.machine}")
    build = f"/lib/modules/{uname.release}/build"
    add("headers", os.path.realpath(build) if os.path.exists(build) else "-")
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            add("cpus", f.read().strip())
    except OSError:
        add("cpus", os.cpu_count())
    add("bcc", _loader_identity())
    return h.hexdigest()


def read_entry(path: str, key: str):
    """The cached entry at path, or None when it is missing or unusable
    (corrupt, another key, another format): those are compiled again."""
    try:
        with open(path, "rb") as f:
            entry = json.loads(f.read())
        if entry.get("format") != FORMAT or entry.get("key") != key:
            return None
        for spec in entry["maps"]:
            _key_type(spec["key"]), decode_type(spec["leaf"])
        for prog in entry["progs"]:
            if not isinstance(prog.get("verified_insns", 0), int):
                return None
            n = len(base64.b64decode(prog["insns"], validate=True))
            subprogs = prog.get("subprogs", [])
            if subprogs != sorted(subprogs) or any(
                    type(at) is not int or not 0 < at < n // 8 for at in subprogs):
                return None
            if n % 8 or any(not 0 <= at < n // 8 or not 0 <= m < len(entry["maps"])
                            for at, m in prog["map_refs"]):
                return None
        return entry
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def compile_entry(cflags: list, key: str, out_path: str):
    """Compile in a child process, which writes the entry to out_path.
    The child has LLVM mapped; this process never does."""
    proc = subprocess.run([sys.executable, "-m", "tracer.kernel.program", out_path, key, *cflags],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [str(abi.BPF_DIR.parent)] +
                              [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p])))
    if proc.returncode < 0:  # a signal: Ctrl-C reaches the child's group too
        raise EnvironmentProblem(f"the BPF compile was stopped by "
                                 f"{signal.Signals(-proc.returncode).name}")
    if proc.returncode != 0:
        # clang's first error says most (a missing header, say); bcc's own
        # summary comes last
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line]
        first = (errors or lines or [f"exit {proc.returncode}"])[0 if errors else -1]
        more = f" (and {len(lines) - 1} more lines of the compiler's)" if len(lines) > 1 else ""
        raise EnvironmentProblem(f"the BPF program did not compile: {first}{more}")


def load(cflags: list, kind: int, before_compile=lambda: None) -> tuple:
    """(LoadedProgram, how) for the program with these cflags: from the
    cache when an entry is there, else compiled now (and cached where the
    cache is usable).  `how` says which, for the ready line.
    kind: the expected_attach_type every program is loaded with, for the
    way they will be attached (attach_type(): links; 0: perf events).
    before_compile() runs before a compile (the checks only it needs)."""
    pinned = os.environ.get("KVTRACE_PROGRAM_ENTRY")
    if pinned:
        return LoadedProgram(read_pinned(pinned, cflags), kind), f"from {pinned}"
    key = cache_key(cflags)
    directory, why_not = cache.directory()
    if directory is not None:
        path = os.path.join(directory, f"bpf-{key}.json")
        entry = read_entry(path, key)
        if entry is not None:
            try:
                return LoadedProgram(entry, kind), "cached"
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EACCES):
                    raise
                # refused as cached: compile again, and replace the entry
        before_compile()
        fd, tmp = tempfile.mkstemp(prefix=".compile-", dir=directory)
        os.close(fd)
        try:
            entry = _compiled(cflags, key, tmp)
            os.replace(tmp, path)  # atomic: a reader sees the old entry or the new
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return LoadedProgram(entry, kind), "compiled"
    before_compile()
    with tempfile.TemporaryDirectory(prefix="kvtrace-compile-") as tmpdir:
        entry = _compiled(cflags, key, os.path.join(tmpdir, "program.json"))
    return LoadedProgram(entry, kind), f"compiled, not cached: {why_not}"


def _compiled(cflags: list, key: str, path: str) -> dict:
    """Compile into path and read the entry back, checked as a cached one is."""
    compile_entry(cflags, key, path)
    entry = read_entry(path, key)
    if entry is None:
        raise EnvironmentProblem("the BPF compile wrote no usable program")
    return entry


# -- the child: compile with bcc and write the entry ---------------------------

def _verifier_costs(entry: dict) -> dict:
    """How many instructions the kernel's verifier walked to load each
    program of the entry (name -> count; 0 where the kernel is older than
    5.16): the loader starts the costliest first.  Empty where the kernel
    refuses the entry: the tracer's own load then says why."""
    try:
        loaded = LoadedProgram(entry, attach_type())  # the default session's
    except OSError:
        return {}
    try:
        return {name: struct.unpack_from("<I", obj_info(prog.fd, PROG_INFO_SIZE),
                                         PROG_INFO_VERIFIED_INSNS)[0]
                for name, prog in loaded._progs.items()}
    finally:
        loaded.cleanup()


def _compile_main(out_path: str, key: str, cflags: list) -> int:
    try:
        import bcc
        from bcc.libbcc import lib
    except ImportError as e:
        print(f"bcc is not importable ({e}): install python3-bpfcc and use a venv made "
              "with --system-site-packages (`make setup` does both)", file=sys.stderr)
        return 1
    try:
        b = bcc.BPF(src_file=str(abi.BPF_PROGRAM).encode(), cflags=cflags)
    except Exception as e:  # bcc raises bare Exception on compile errors
        print(str(e).strip() or type(e).__name__, file=sys.stderr)
        return 1
    module = b.module
    for name, res, args in (("bpf_num_tables", ctypes.c_size_t, [ctypes.c_void_p]),
                            ("bpf_table_name", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
                            ("bpf_table_fd_id", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
                            ("bpf_table_key_desc_id", ctypes.c_char_p,
                             [ctypes.c_void_p, ctypes.c_size_t]),
                            ("bpf_table_leaf_desc_id", ctypes.c_char_p,
                             [ctypes.c_void_p, ctypes.c_size_t])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    maps, index_of_fd = [], {}
    for i in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, i)
        mtype, key_size, value_size, entries, flags = map_info(fd)
        index_of_fd[fd] = len(maps)
        maps.append(dict(name=lib.bpf_table_name(module, i).decode(), type=mtype,
                         key_size=key_size, value_size=value_size, max_entries=entries,
                         flags=flags, key=_desc(lib.bpf_table_key_desc_id(module, i)),
                         leaf=json.loads(lib.bpf_table_leaf_desc_id(module, i))))
    functions = {}
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        functions[name.decode()] = b.dump_func(name)
    callbacks = {}
    for cb_name, cb_id in abi.CALLBACKS.items():
        insns = functions.pop(f"kvtrace_cb_{cb_name}", None)
        if insns is not None:
            try:
                check_callback(f"kvtrace_cb_{cb_name}", insns)
            except ValueError as e:
                print(e, file=sys.stderr)
                return 1
            callbacks[cb_id] = insns
    progs = []
    for name, insns in functions.items():
        try:
            insns, subprogs = link_callbacks(insns, callbacks)
        except ValueError as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 1
        refs = []
        for at_ld, code, regs, imm in _instructions(insns):
            if code != _LD_IMM64:
                continue
            if regs >> 4 == BPF_PSEUDO_MAP_FD:
                if imm not in index_of_fd:
                    print(f"{name}: instruction {at_ld} names fd {imm}, not a map",
                          file=sys.stderr)
                    return 1
                refs.append([at_ld, index_of_fd[imm]])
            elif regs >> 4 not in (0, BPF_PSEUDO_FUNC):  # a callback is linked already
                # another kind of pseudo load (map value, BTF id): not relocatable here
                print(f"{name}: instruction {at_ld} is a pseudo load of kind "
                      f"{regs >> 4}, which the cache cannot relocate", file=sys.stderr)
                return 1
        prog = dict(name=name, insns=base64.b64encode(insns).decode(), map_refs=refs)
        if subprogs:
            prog["subprogs"] = subprogs
        progs.append(prog)
    entry = dict(format=FORMAT, key=key, license=lib.bpf_module_license(module).decode(),
                 kern_version=lib.bpf_module_kern_version(module), maps=maps, progs=progs,
                 built_for=built_for(cflags))
    costs = _verifier_costs(entry)
    for prog in progs:
        prog["verified_insns"] = costs.get(prog["name"], 0)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    b.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(_compile_main(sys.argv[1], sys.argv[2], sys.argv[3:]))
