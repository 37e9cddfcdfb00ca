"""The compiled-once program's pure parts: bcc's type descriptions decoded as
bcc decodes them, cache entries checked before anything is loaded, and the
cache directory's safety rule.  (Loading them is test_e2e_program.py.)"""

import base64
import ctypes
import json
import os
import shutil
import struct

import pytest

from tracer import abi, cache
from tracer.kernel import program

# descriptions in bcc's JSON form, as bpf_table_key_desc returns them
DESCS = [
    "unsigned long long",
    "int",
    ["kvtrace_site_key", [["pid", "unsigned int"], ["pad", "unsigned int"],
                          ["ip", "unsigned long long"]], "struct"],
    ["row", [["blocks", "unsigned long long", [4096]]], "struct"],
    ["mixed", [["flags", "unsigned int", 3], ["kind", "unsigned int", 5],
               ["", [["a", "unsigned long long"], ["b", "int"]], "union"],
               ["id", "char", [64]], ["n", "unsigned char"]], "struct"],
    ["packed", [["a", "unsigned char"], ["b", "unsigned long long"]], "struct_packed"],
    ["nested", [["inner", [["x", "short"], ["y", "long long", [2]]], "struct"],
                ["z", "_Bool"]], "struct"],
]


def layout(t):
    """(size, [(field, offset, size)...]) of a ctypes type, recursively."""
    if not hasattr(t, "_fields_"):
        return ctypes.sizeof(t)
    return (ctypes.sizeof(t), [(f[0], getattr(t, f[0]).offset, getattr(t, f[0]).size,
                                layout(f[1])) for f in t._fields_])


@pytest.mark.parametrize("desc", DESCS, ids=lambda d: d if isinstance(d, str) else d[0])
def test_decode_type_lays_out_as_bcc_does(desc):
    """bcc's own decoder is the reference (importing it loads LLVM, which
    is why the tracer has its own)."""
    bcc = pytest.importorskip("bcc")
    assert layout(program.decode_type(desc)) == layout(bcc.BPF._decode_table_type(desc))


def test_decode_type_refuses_what_it_does_not_know():
    with pytest.raises(ValueError):
        program.decode_type("float128")
    with pytest.raises(ValueError):
        program.decode_type(["s", [["a", "int", "bogus"]], "struct"])


def entry(key="k" * 64, insns=b"\x95" + b"\0" * 7, refs=()):
    """A minimal well-formed entry: one map, one program of one `exit`."""
    return dict(format=program.FORMAT, key=key, license="GPL", kern_version=0,
                maps=[dict(name="m", type=2, key_size=4, value_size=8, max_entries=1, flags=0,
                           key="int", leaf="unsigned long long")],
                progs=[dict(name="p", insns=base64.b64encode(insns).decode(),
                            map_refs=[list(r) for r in refs])])


def write(tmp_path, doc):
    path = tmp_path / "e.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_read_entry_takes_a_well_formed_entry(tmp_path):
    e = entry(insns=b"\x18\x11" + b"\0" * 14 + b"\x95" + b"\0" * 7, refs=[(0, 0)])
    assert program.read_entry(write(tmp_path, e), e["key"]) == e


@pytest.mark.parametrize("spoil", [
    lambda e: "{ not json",
    lambda e: json.dumps(e)[:-40],                       # truncated
    lambda e: dict(e, key="other"),                      # another program text
    lambda e: dict(e, format=program.FORMAT + 1),        # another layout
    lambda e: dict(e, progs=[dict(e["progs"][0], insns="@@@")]),          # not base64
    lambda e: dict(e, progs=[dict(e["progs"][0], insns="AAAA")]),         # 3 bytes
    lambda e: dict(e, progs=[dict(e["progs"][0], map_refs=[[0, 1]])]),    # no map 1
    lambda e: dict(e, progs=[dict(e["progs"][0], map_refs=[[5, 0]])]),    # no insn 5
    lambda e: dict(e, maps=[dict(e["maps"][0], leaf="no such type")]),
    lambda e: dict(e, maps=None),
    lambda e: dict(e, progs=[dict(e["progs"][0], verified_insns="many")]),
    lambda e: dict(e, progs=[dict(e["progs"][0], subprogs=[0])]),      # the program itself
    lambda e: dict(e, progs=[dict(e["progs"][0], subprogs=[7])]),      # past its end
    lambda e: dict(e, progs=[dict(e["progs"][0], subprogs="1")]),
], ids=["garbage", "truncated", "key", "format", "base64", "size", "map", "insn", "type",
        "maps", "cost", "subprog0", "subprog-end", "subprog-type"])
def test_read_entry_refuses_a_spoiled_entry(tmp_path, spoil):
    e = entry()
    assert program.read_entry(write(tmp_path, spoil(e)), e["key"]) is None


def test_programs_load_costliest_to_verify_first(monkeypatch):
    """The loader starts the programs in the order of the verifier's cost
    that the compile measured, highest first (an entry without it last), so
    that the longest verification does not start when the others are done."""
    class FakeLib:
        def bcc_create_map(self, *args):
            return 3

    loads, kinds = [], set()

    def fake_load(name, *args):
        loads.append(name.decode())
        kinds.add(args[-1])  # the expected_attach_type
        return 10 + len(loads)

    e = entry()
    exit_insn = e["progs"][0]["insns"]
    costs = {"a": 5, "b": 900_000, "c": None, "d": 40, "e": 41}
    e["progs"] = [dict(name=n, insns=exit_insn, map_refs=[],
                       **({} if c is None else {"verified_insns": c}))
                  for n, c in costs.items()]
    monkeypatch.setattr(program, "libbcc_bpf", FakeLib)
    monkeypatch.setattr(program, "load_prog", fake_load)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one loader: a strict order
    loaded = program.LoadedProgram(e, 48)
    assert loads == ["b", "e", "d", "a", "c"]
    assert sorted(loaded._progs) == sorted(costs)
    # every program with the session's one attach type: the kernel refuses a
    # tail call between programs of different attach types
    assert kinds == {48}
    loads.clear()
    kinds.clear()
    program.LoadedProgram(e, 0)  # perf events': a link's program goes on none here
    assert kinds == {0}


def insn(code, dst=0, src=0, off=0, imm=0):
    return struct.pack("<BBhi", code, src << 4 | dst, off, imm)


def marker(cb_id, dst=2):
    """What clang makes of KVTRACE_CALLBACK(cb_id) loaded into dst."""
    return insn(0x18, dst, imm=cb_id) + insn(0, imm=abi.CALLBACK_MARK)


EXIT, MOV_R0_0 = insn(0x95), insn(0xB7, 0)
CALL_LOOP = insn(0x85, imm=181)  # bpf_loop


def test_link_callbacks_appends_each_once_and_points_the_marker_at_it():
    """Two uses of callback 1 and one of callback 2: each is appended once,
    in the order first named, and every marker becomes a BPF_PSEUDO_FUNC
    load whose imm counts from the instruction after the load (as the
    kernel reads it: target = load + 1 + imm)."""
    cb1 = insn(0xBF, 7, 2) + MOV_R0_0 + EXIT           # 3 instructions
    cb2 = insn(0xBF, 6, 2) + EXIT                      # 2
    prog = (marker(1) + CALL_LOOP + marker(2) + CALL_LOOP + MOV_R0_0 + marker(1)
            + CALL_LOOP + EXIT)                        # 11 instructions
    linked, subprogs = program.link_callbacks(prog, {1: cb1, 2: cb2, 3: EXIT})
    assert subprogs == [11, 14]
    assert linked[11 * 8:14 * 8] == cb1 and linked[14 * 8:] == cb2
    for at, target in ((0, 11), (3, 14), (7, 11)):
        code, regs, _, imm = struct.unpack_from("<BBhi", linked, at * 8)
        assert (code, regs >> 4, regs & 0xF) == (0x18, program.BPF_PSEUDO_FUNC, 2)
        assert at + 1 + imm == target
        assert linked[at * 8 + 8:at * 8 + 16] == bytes(8)
    # nothing else changed
    for at in (2, 5, 6, 9, 10):
        assert linked[at * 8:at * 8 + 8] == prog[at * 8:at * 8 + 8]


def test_link_callbacks_leaves_other_constants_and_refuses_unknown_ids():
    other = insn(0x18, 1, imm=1) + insn(0, imm=abi.CALLBACK_MARK + 1)  # not the marker
    mapref = insn(0x18, 1, src=program.BPF_PSEUDO_MAP_FD, imm=5) + insn(0, imm=abi.CALLBACK_MARK)
    prog = other + mapref + EXIT
    assert program.link_callbacks(prog, {1: EXIT}) == (prog, [])
    with pytest.raises(ValueError, match="callback 9"):
        program.link_callbacks(marker(9) + EXIT, {1: EXIT})


def test_a_callback_must_take_r2_first():
    program.check_callback("cb", insn(0xBF, 7, 2) + EXIT)
    program.check_callback("cb", MOV_R0_0 + insn(0xBF, 7, 2) + EXIT)  # r0 set first: fine
    for before in (insn(0xB7, 2),               # r2 = 0
                   insn(0x79, 2, 1),            # r2 = *(u64 *)(r1 + 0)
                   CALL_LOOP,                   # a call clobbers r1-r5
                   insn(0x05, off=1)):          # a jump: r2 may come from elsewhere
        with pytest.raises(ValueError, match="r2"):
            program.check_callback("cb", before + insn(0xBF, 7, 2) + EXIT)
    with pytest.raises(ValueError, match="r2"):
        program.check_callback("cb", MOV_R0_0 + EXIT)  # never takes it


def test_read_entry_of_a_missing_file_is_none(tmp_path):
    assert program.read_entry(str(tmp_path / "nothing.json"), "k") is None


def test_cache_directory_is_made_private(tmp_path, monkeypatch):
    where = tmp_path / "c"
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(where))
    path, why = cache.directory()
    assert (path, why) == (where, None)
    assert where.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_cache_directory_others_can_write_is_not_used(tmp_path, monkeypatch, mode):
    where = tmp_path / "c"
    where.mkdir()
    where.chmod(mode)
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(where))
    path, why = cache.directory()
    assert path is None and "writable by others" in why
    cache.store("x.json", {"a": 1})
    assert not (where / "x.json").exists() and cache.load("x.json") is None


def test_cache_directory_of_another_owner_is_not_used(tmp_path, monkeypatch):
    where = tmp_path / "c"
    where.mkdir(mode=0o700)
    os.chown(where, 12345, 12345) if os.geteuid() == 0 else pytest.skip("needs root to chown")
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(where))
    path, why = cache.directory()
    assert path is None and "belongs to uid 12345, not to this user (euid 0" in why


def test_cache_off(monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", "off")
    assert cache.directory() == (None, "KVTRACE_CACHE_DIR turns it off")


def test_cache_key_follows_flags_and_text(monkeypatch, tmp_path):
    a = program.cache_key(["-DX=1"])
    assert a == program.cache_key(["-DX=1"])
    assert a != program.cache_key(["-DX=2"])
    assert a != program.cache_key(["-DX=1", "-DY"])
    copy = tmp_path / "bpf"
    shutil.copytree(abi.BPF_DIR, copy)
    monkeypatch.setattr(abi, "BPF_DIR", copy)
    assert program.cache_key(["-DX=1"]) == a
    header = copy / "kvtrace.h"
    header.write_text(header.read_text() + "\n/* one more line */\n")
    assert program.cache_key(["-DX=1"]) != a  # a header the program includes


def test_a_refused_link_is_one_clear_error(monkeypatch):
    """Programs loaded for links go on no perf event here, so a link the
    kernel refuses ends the attach with what to do, not a quiet fallback
    that would fail at its first perf event."""
    from tracer.kernel import session
    from tracer.errors import EnvironmentProblem
    from tracer.kernel.uprobes import NoUprobeMulti

    def refuse(*args):
        raise NoUprobeMulti("Invalid argument")
    monkeypatch.setattr(session, "UprobeLink", refuse)
    with pytest.raises(EnvironmentProblem, match="KVTRACE_PERF_UPROBES=1"):
        session.Tracer._link(None, "/x/lib.so", [0x10], 1, 3, [0])
