"""Where torch keeps a tensor's data pointer, storage offset and sizes.

Stock uprobes read `const at::Tensor&` arguments through torch's TensorImpl
and StorageImpl (catalog.py, KVTRACE_ARG_TENSOR_* in bpf/kvtrace.h).  Those
offsets change between torch releases and build options, so they are never
written into this code: they are found in the target's own torch.  The
target's interpreter (/proc/PID/exe), with the site-packages of the torch the
target has mapped, builds tensors whose fields have unlikely values and
looks for them in the TensorImpl's bytes; every field must be found at one
offset only, and the same for a second tensor, or discovery fails.

The answer is cached by the build-id of the libc10.so that defines
TensorImpl, so a second attach to the same torch costs nothing.

Safety: the probe runs as the target process's user, not as root (it imports
code from the target's environment), reads only its own tensors, and never
touches the target.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from .. import cache
from . import discover

TIMEOUT_S = 120

# Runs in the target's interpreter.  Prints one JSON object.
_PROBE_SCRIPT = r"""
import ctypes, json, struct, sys
import torch

def words(addr, n=64):
    return struct.unpack("<%dQ" % n, ctypes.string_at(addr, 8 * n))

def only(ws, pred, what):
    hits = [i * 8 for i in range(len(ws)) if pred(i)]
    if len(hits) != 1:
        raise SystemExit(json.dumps({"error": "%s found at %d offsets" % (what, len(hits))}))
    return hits[0]

def layout(offset, sizes, foreign):
    numel = 1
    for s in sizes:
        numel *= s
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    if foreign:
        # memory torch did not allocate: its DataPtr's context is not the
        # data pointer, as it is for torch's own CPU allocations
        keep.append(bytearray(8 * (offset + numel)))
        base = torch.frombuffer(keep[-1], dtype=torch.int64)
    else:
        base = torch.zeros(offset + numel, dtype=torch.int64)
    t = base.as_strided(sizes, strides, offset)
    impl, storage = t._cdata, t.untyped_storage()._cdata
    iw, sw = words(impl), words(storage, 8)
    n = len(sizes)
    found = {
        "impl_storage": only(iw, lambda i: iw[i] == storage, "StorageImpl pointer"),
        "storage_data": only(sw, lambda i: sw[i] == base.data_ptr(), "data pointer"),
        "impl_storage_offset": only(iw, lambda i: iw[i] == offset, "storage offset"),
        "impl_sizes": only(iw, lambda i: i + n <= len(iw) and list(iw[i:i + n]) == list(sizes),
                           "sizes"),
        "impl_strides": only(iw, lambda i: i + n <= len(iw) and list(iw[i:i + n]) == strides,
                             "strides"),
    }
    # the data pointer the BPF side computes must be the tensor's own
    if sw[found["storage_data"] // 8] + 8 * iw[found["impl_storage_offset"] // 8] != t.data_ptr():
        raise SystemExit(json.dumps({"error": "data pointer does not add up"}))
    return found

keep = []
a = layout(1237, (7, 11, 13, 3), True)
b = layout(4421, (5, 17, 19), True)
if a != b:
    raise SystemExit(json.dumps({"error": "two tensors disagree: %r %r" % (a, b)}))
a["torch"] = torch.__version__
print(json.dumps(a))
"""


@dataclass(frozen=True)
class TensorLayout:
    impl_storage: int
    storage_data: int
    impl_storage_offset: int
    impl_sizes: int
    impl_strides: int  # a block table's row stride (reads)
    torch: str = "?"


def torch_library(pid: int, maps: list = None):
    """The libc10.so a process has mapped (it defines TensorImpl), or None.
    `maps`: the process's discover.read_maps(), if the caller has it."""
    for m in discover.read_maps(pid) if maps is None else maps:
        if os.path.basename(m.path) == "libc10.so" and "/torch/lib/" in m.path:
            return m.path
    return None


def build_id(path: str) -> str:
    try:
        with open(path, "rb") as f:
            for sec in ELFFile(f).iter_sections():
                if sec["sh_type"] == "SHT_NOTE":
                    for note in sec.iter_notes():
                        if note["n_type"] == "NT_GNU_BUILD_ID":
                            return note["n_desc"]
    except (OSError, ELFError):
        pass
    st = os.stat(path)
    return f"ino{st.st_ino}-{st.st_mtime_ns}"


def _owner(pid: int):
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Uid"].split()[1]), int(fields["Gid"].split()[1])  # effective


def _cache_name(libc10: str) -> str:
    return f"tensor-layout-{build_id(libc10)}.json"


def cached(libc10: str):
    try:
        return TensorLayout(**cache.load(_cache_name(libc10)))
    except TypeError:  # missing, or another version's fields
        return None


def _store(libc10: str, layout: TensorLayout):
    cache.store(_cache_name(libc10), asdict(layout))


class Discovery:
    """One discovery for one process, run in the background: start() returns
    at once, result() waits.  Several processes of one vLLM share a torch:
    the caller keeps one Discovery per libc10 path."""

    def __init__(self, pid: int, libc10: str = None):
        """libc10: the process's torch_library(), if the caller found it."""
        self.pid = pid
        self.libc10 = libc10 or torch_library(pid)
        self.layout = cached(self.libc10) if self.libc10 else None
        self.error = None if self.libc10 else "the process has no torch (libc10.so) mapped"
        self._proc = None

    def start(self):
        if self.layout or self.error or self._proc:
            return self
        try:
            exe = os.readlink(f"/proc/{self.pid}/exe")
            uid, gid = _owner(self.pid)
        except OSError as e:
            self.error = f"cannot read process {self.pid}: {e.strerror}"
            return self
        site_packages = str(Path(self.libc10).parents[2])
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": site_packages,
               "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "HOME": "/"}
        try:
            self._proc = subprocess.Popen(
                [exe, "-c", _PROBE_SCRIPT], env=env, cwd="/", user=uid, group=gid,
                extra_groups=[], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.error = f"cannot run {exe}: {e.strerror}"
        return self

    def done(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def cancel(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
        self._proc = None

    def result(self):
        """The TensorLayout, or None with self.error saying why."""
        if self._proc is not None:
            try:
                out, err = self._proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.communicate()
                out, err = "", f"timed out after {TIMEOUT_S}s"
            self._proc = None
            self._parse(out, err)
        return self.layout

    def _parse(self, out: str, err: str):
        try:
            doc = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            last = (err.strip().splitlines() or ["no output"])[-1]
            self.error = f"torch layout probe failed: {last[:200]}"
            return
        if "error" in doc:
            self.error = f"torch layout probe: {doc['error']}"
            return
        self.layout = TensorLayout(**doc)
        _store(self.libc10, self.layout)


if __name__ == "__main__":  # kvtrace's own check: python -m tracer.probes.torch_layout PID
    d = Discovery(int(sys.argv[1])).start()
    print(d.result() or d.error)
