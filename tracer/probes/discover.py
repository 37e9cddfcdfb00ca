"""Find a running process's probe sites: the files it maps (/proc/PID/maps),
each read for USDT notes (sdt.py) or else stock vLLM functions (catalog.py).

Everything here only reads: files on disk, /proc/PID/maps, and (for
`probes -p`, to show semaphore values) /proc/PID/mem.
"""

import os
import platform
import struct
from dataclasses import dataclass

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from .. import abi
from ..errors import TargetError
from . import probe_cache
from .catalog import stock_sites
from .sdt import Probe, read_probes


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str


def read_proc(pid: int, name: str) -> bytes:
    """/proc/PID/<name>, or a TargetError that says why not: the process is
    gone, or it may not be read."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise TargetError(f"no process with pid {pid}") from None
    except PermissionError:
        raise TargetError(f"cannot read /proc/{pid}/{name}: permission denied") from None


def read_maps(pid: int) -> list:
    """The file-backed mappings of a process."""
    maps = []
    for line in read_proc(pid, "maps").decode(errors="surrogateescape").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append(Mapping(lo, hi, parts[1], int(parts[2], 16), int(parts[4]),
                            parts[5]))
    return maps


def runtime_address(maps: list, path: str, file_offset: int):
    """Where file_offset of `path` is mapped in the process, or None."""
    for m in maps:
        if m.path == path and m.offset <= file_offset < m.offset + (m.end - m.start):
            return m.start + file_offset - m.offset
    return None


def process_probe_files(pid: int, provider: str = abi.PROVIDER, cache: dict = None,
                        stock: bool = True, maps: list = None) -> dict:
    """{path: [Probe]} for every file mapped by `pid` that has probe sites:
    `provider` USDT probes, or else (stock=True) the stock vLLM functions of
    catalog.py.  A file with USDT probes (a kvtrace build of vLLM) is never
    also given stock uprobes: the same op would count twice.

    With `cache` (a dict the caller keeps), each file is parsed once per
    (path, inode, mtime): re-reading a process that maps hundreds of
    libraries, as vLLM does, then costs a stat per file.  `maps`: the
    process's read_maps(), if the caller has it."""
    cache = {} if cache is None else cache
    no_probes = probe_cache.known(provider)
    found, mine = {}, set()  # mine: this process's files without probes
    for path in sorted({m.path for m in (read_maps(pid) if maps is None else maps)}):
        try:
            st = os.stat(path)
        except OSError:
            continue  # "(deleted)", or gone since
        ident = probe_cache.file_ident(path, st)
        key = (path, st.st_ino, st.st_mtime_ns, provider, stock)
        if key not in cache:
            sites = []
            if ident not in no_probes["files"]:
                try:
                    sites = read_probes(path, provider) if os.path.isfile(path) else []
                except TargetError:
                    sites = []  # a mapped non-ELF (fonts, locale archives...)
                if not sites:
                    no_probes["files"].add(ident)
                    no_probes["dirty"] = True
            if not sites and stock:
                sites = stock_sites(path)
            cache[key] = sites
        if cache[key]:
            found[path] = cache[key]
        if ident in no_probes["files"]:
            mine.add(ident)
    probe_cache.save(provider, mine)
    return found


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def read_semaphore(pid: int, maps: list, probe: Probe):
    """Current value of a probe's semaphore in a live process (read only)."""
    if not probe.sem_vaddr:
        return None
    addr = runtime_address(maps, probe.path, probe.sem_offset)
    if addr is None:
        return None
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(addr)
            return struct.unpack("<H", f.read(2))[0]
    except OSError:
        return None


# -- the kvtrace vLLM plugin's install outcome ----------------------------------

PLUGIN_STATUS_SYMBOL = "kvtrace_plugin_status"


def is_plugin_status_object(path: str) -> bool:
    """The plugin's probe-less status object (plugin/kvtrace_vllm/_status.c)."""
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) == "kvtrace_vllm" and \
        name.startswith("_status") and name.endswith(".so")


def plugin_status(pid: int, maps: list = None):
    """The kvtrace vLLM plugin's install outcome in a process, one line
    (docs/plugin.md, "What the tracer is told"): "tested vLLM release X",
    "untested vLLM release X" or "refused vLLM release X: why"; None where
    the process maps no status object or its line is not set.  Read from
    the kvtrace_plugin_status array of that object, at the address the
    process mapped it (its load bias plus the symbol's value)."""
    maps = read_maps(pid) if maps is None else maps
    for path in sorted({m.path for m in maps if is_plugin_status_object(m.path)}):
        try:
            with open(path, "rb") as f:
                elf = ELFFile(f)
                symtab = elf.get_section_by_name(".dynsym") or elf.get_section_by_name(".symtab")
                syms = symtab.get_symbol_by_name(PLUGIN_STATUS_SYMBOL) if symtab else None
                if not syms:
                    continue
                value, size = syms[0]["st_value"], syms[0]["st_size"]
                first = min(s["p_vaddr"] - s["p_offset"] for s in elf.iter_segments()
                            if s["p_type"] == "PT_LOAD")
        except (OSError, ELFError):
            continue
        starts = [m.start - m.offset for m in maps if m.path == path and m.offset == 0]
        if not starts:
            continue
        try:
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.seek(starts[0] - first + value)
                raw = f.read(size)
        except OSError:
            continue
        line = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
        if line:
            return line.splitlines()[0]
    return None


def check_arch():
    if platform.machine() != "x86_64":
        from ..errors import EnvironmentProblem
        raise EnvironmentProblem(
            f"SDT argument decoding is implemented for x86_64 only, not {platform.machine()}")
