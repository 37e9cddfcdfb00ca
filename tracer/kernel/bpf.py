"""The bpf() syscall and bcc's loader library (libbcc_bpf), without LLVM.

The layer under the program's loader (program.py): bcc's map, program,
perf-buffer and symbolizer calls through ctypes, an object's info from the
kernel, and the bpf() commands that bcc's loader path cannot give (a
program with bpf_loop() callbacks needs BTF function info).  Nothing here
knows kvtrace's program or maps.
"""

import ctypes
import errno
import os
import struct

from ..errors import EnvironmentProblem

BPF_PROG_TYPE_KPROBE = 2
BPF_PROG_LOAD, BPF_BTF_LOAD = 5, 18
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type (uapi/linux/bpf.h), 6.6+
_SYS_bpf = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
# struct bpf_map_info's head (uapi/linux/bpf.h): type, id, key_size,
# value_size, max_entries, map_flags
_MAP_INFO = struct.Struct("<6I")
_MAP_INFO_SIZE = 88


# -- libbcc_bpf: bcc's map, program and buffer calls, without LLVM ------------

RAW_CB = ctypes.CFUNCTYPE(None, ctypes.py_object, ctypes.c_void_p, ctypes.c_int)
LOST_CB = ctypes.CFUNCTYPE(None, ctypes.py_object, ctypes.c_ulonglong)
RINGBUF_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)


class Symbol(ctypes.Structure):  # bcc's struct bcc_symbol
    _fields_ = [("name", ctypes.c_char_p), ("demangle_name", ctypes.c_char_p),
                ("module", ctypes.POINTER(ctypes.c_char)), ("offset", ctypes.c_ulonglong)]


_lib = None


def libbcc_bpf():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libbcc_bpf.so.0", use_errno=True)
        except OSError as e:
            raise EnvironmentProblem(
                f"bcc's loader library is missing ({e}): install libbpfcc "
                "(`make setup` does)") from None
        vp, i = ctypes.c_void_p, ctypes.c_int
        for name, res, args in (
                ("bcc_create_map", i, [i, ctypes.c_char_p, i, i, i, i]),
                ("bpf_lookup_elem", i, [i, vp, vp]),
                ("bpf_update_elem", i, [i, vp, vp, ctypes.c_ulonglong]),
                ("bpf_delete_elem", i, [i, vp]),
                ("bpf_lookup_and_delete", i, [i, vp, vp]),
                ("bpf_get_next_key", i, [i, vp, vp]),
                ("bpf_obj_get_info", i, [i, vp, ctypes.POINTER(ctypes.c_uint32)]),
                ("perf_reader_new", vp, [RAW_CB, LOST_CB, ctypes.py_object, i]),
                ("perf_reader_set_fd", None, [vp, i]),
                ("perf_reader_mmap", i, [vp]),
                ("perf_reader_poll", i, [i, ctypes.POINTER(vp), i]),
                ("perf_reader_consume", i, [i, ctypes.POINTER(vp)]),
                ("perf_reader_free", None, [vp]),
                ("bpf_new_ringbuf", vp, [i, RINGBUF_CB, vp]),
                ("bpf_poll_ringbuf", i, [vp, i]),
                ("bpf_consume_ringbuf", i, [vp]),
                ("bpf_free_ringbuf", None, [vp]),
                ("bcc_symcache_new", vp, [i, vp]),
                ("bcc_symcache_resolve", i, [vp, ctypes.c_ulonglong, ctypes.POINTER(Symbol)]),
                ("bcc_symbol_free_demangle_name", None, [ctypes.POINTER(Symbol)])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
    return _lib


def oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# struct bpf_prog_info (uapi/linux/bpf.h): its size as far as we read it,
# and the offsets of the fields we read (checked against it with offsetof)
PROG_INFO_SIZE = 232
PROG_INFO_RECURSION_MISSES = 208  # u64, 5.12+
PROG_INFO_VERIFIED_INSNS = 216  # u32, 5.16+


def obj_info(fd: int, size: int) -> bytes:
    """The first `size` bytes of a BPF object's info (BPF_OBJ_GET_INFO_BY_FD:
    struct bpf_map_info or bpf_prog_info, uapi/linux/bpf.h); what an older
    kernel does not fill stays zero."""
    buf = ctypes.create_string_buffer(size)
    length = ctypes.c_uint32(size)
    if libbcc_bpf().bpf_obj_get_info(fd, buf, ctypes.byref(length)) < 0:
        raise oserror("BPF_OBJ_GET_INFO_BY_FD")
    return buf.raw


def map_info(fd: int) -> tuple:
    """(type, key_size, value_size, max_entries, flags) of a map, from the kernel."""
    mtype, _id, key_size, value_size, entries, flags = _MAP_INFO.unpack_from(
        obj_info(fd, _MAP_INFO_SIZE))
    return mtype, key_size, value_size, entries, flags


# -- programs with bpf_loop() callbacks ------------------------------------------
#
# The kernel takes a callback (an ld_imm64 of kind BPF_PSEUDO_FUNC) only in a
# program that comes with BTF function info: one record per function, the
# program's own at instruction 0 and one where each callback starts.  bcc's
# loader path has none to give, so these programs are loaded here with the
# bpf() syscall and the least BTF that says so: an int, a prototype returning
# it, and two functions of that prototype.  Static linkage: the verifier
# checks no argument types against it.

def _btf(types: list, strings: bytes) -> bytes:
    body = b"".join(types)
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strings))
    return header + body + strings


def _btf_type(name_off: int, kind: int, vlen: int, size_or_type: int) -> bytes:
    return struct.pack("<III", name_off, kind << 24 | vlen, size_or_type)


_BTF_KIND_INT, _BTF_KIND_FUNC, _BTF_KIND_FUNC_PROTO = 1, 12, 13
_BTF_FUNC_MAIN, _BTF_FUNC_CALLBACK = 3, 4  # type ids below
FUNC_BTF = _btf([
    _btf_type(1, _BTF_KIND_INT, 0, 4) + struct.pack("<I", 1 << 24 | 32),  # [1] int, signed
    _btf_type(0, _BTF_KIND_FUNC_PROTO, 0, 1),                            # [2] int (void)
    _btf_type(5, _BTF_KIND_FUNC, 0, 2),                                  # [3] main
    _btf_type(10, _BTF_KIND_FUNC, 0, 2),                                 # [4] callback
], b"\0int\0main\0callback\0")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def bpf_syscall(cmd: int, attr) -> int:
    """bpf(cmd, &attr, sizeof attr): what the kernel answers, -1 with errno
    set on failure.  attr: a ctypes buffer or structure."""
    if _SYS_bpf is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    return _libc.syscall(_SYS_bpf, cmd, ctypes.byref(attr), ctypes.sizeof(attr))


def load_btf(blob: bytes) -> int:
    data = ctypes.create_string_buffer(blob, len(blob))
    attr = ctypes.create_string_buffer(32)  # union bpf_attr, BPF_BTF_LOAD's part
    struct.pack_into("<QQI", attr, 0, ctypes.addressof(data), 0, len(blob))
    fd = bpf_syscall(BPF_BTF_LOAD, attr)
    if fd < 0:
        raise oserror("loading the programs' BTF")
    return fd


def load_prog(name: bytes, insns, size: int, license_: bytes, kern_version: int,
               btf_fd: int, subprogs: list, log=None, log_level: int = 0,
               attach_type: int = 0) -> int:
    """BPF_PROG_LOAD of a kprobe program whose callbacks start at `subprogs`
    (none: no BTF needed, btf_fd 0): the fd, or -1 with errno set.  log: a
    buffer for the verifier's log, at log_level (1: every instruction, 4: the
    statistics).  attach_type: the expected_attach_type (attach_type())."""
    records = [(0, _BTF_FUNC_MAIN)] + [(at, _BTF_FUNC_CALLBACK) for at in subprogs]
    func_info = ctypes.create_string_buffer(b"".join(struct.pack("<II", *r) for r in records))
    lic = ctypes.create_string_buffer(license_)
    attr = ctypes.create_string_buffer(144)  # union bpf_attr, BPF_PROG_LOAD's part
    struct.pack_into("<IIQQIIQII16sIIIIQI", attr, 0,
                     BPF_PROG_TYPE_KPROBE, size // 8, ctypes.addressof(insns),
                     ctypes.addressof(lic), log_level if log else 0, len(log) if log else 0,
                     ctypes.addressof(log) if log else 0, kern_version, 0, name,
                     0, attach_type,  # prog_ifindex, expected_attach_type
                     btf_fd if subprogs else 0, 8 if subprogs else 0,
                     ctypes.addressof(func_info) if subprogs else 0,
                     len(records) if subprogs else 0)
    return bpf_syscall(BPF_PROG_LOAD, attr)


def trivial_program(attach_type: int, name: bytes = b"kvtrace_probe",
                    kern_version: int = 0) -> int:
    """A loaded `r0 = 0; exit` kprobe program of that attach type: its fd, or
    -1 with errno set.  kern_version: what kernels before 5.0 check against
    their own (later ones ignore it)."""
    code = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    buf = ctypes.create_string_buffer(code, len(code))
    return load_prog(name, buf, len(code), b"GPL", kern_version, 0, [],
                      attach_type=attach_type)
