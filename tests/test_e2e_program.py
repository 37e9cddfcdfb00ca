"""The BPF program compiled once (tracer/program.py), on the path users get:
the first attach compiles in a child and caches, the next loads the cache
without LLVM, and both count kvsim's ground truth exactly.  A spoiled or
unsafe cache is never loaded as it is."""

import json
import os
import re
import shutil
import stat

import pytest

from conftest import KVSIM, Kvsim, Tracer, assert_matches_truth, run_kvtrace

pytestmark = pytest.mark.usefixtures("no_leftovers")


def in_cache(cache_dir):
    return dict(os.environ, KVTRACE_CACHE_DIR=str(cache_dir))


def attach_default(tmp_path, cache_dir, name):
    """kvsim's default workload under `attach --`: (its ready line, its
    aggregate, kvsim's truth)."""
    out, truth = tmp_path / f"{name}.json", tmp_path / f"{name}-truth.json"
    r = run_kvtrace("attach", "-q", "--json", out, "--", KVSIM, "--workload", "default",
                    "--truth", truth, "--quiet", env=in_cache(cache_dir))
    assert r.returncode == 0, r.stderr
    ready = [line for line in r.stderr.splitlines() if "ready after" in line]
    assert len(ready) == 1, r.stderr
    return ready[0], json.loads(out.read_text()), json.loads(truth.read_text())


def entries(cache_dir):
    return sorted(cache_dir.glob("bpf-*.json"))


def attach_pid_without_llvm(tmp_path, cache_dir, expect, *extra):
    """attach -p to a paused kvsim: while it traces, the tracer process maps
    no LLVM, clang or bcc compiler library (a compile ran in a child that
    has exited); the counts equal kvsim's truth."""
    sim = Kvsim(tmp_path, "default")
    tracer = None
    try:
        out = tmp_path / f"pid-{expect}.json"
        tracer = Tracer("-q", "-p", sim.pid, "--json", out, *extra, env=in_cache(cache_dir))
        tracer.wait_attached()
        assert f"BPF program {expect} in" in tracer.early_err, tracer.early_err
        with open(f"/proc/{tracer.proc.pid}/maps") as f:
            libs = {line.split()[-1] for line in f if ".so" in line}
        assert not [p for p in libs if "libLLVM" in p or "libclang" in p
                    or re.search(r"/libbcc\.so", p)], sorted(libs)
        assert [p for p in libs if "libbcc_bpf.so" in p], sorted(libs)
        sim.go()
        assert sim.wait() == 0
        rc, _, err = tracer.finish()
        assert rc == 0, err
        assert_matches_truth(json.loads(out.read_text()), sim.truth())
    finally:
        if tracer is not None:
            tracer.kill()
        sim.kill()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One attach on an empty cache: (its tmp dir, cache dir, ready line,
    aggregate, truth).  The module's other tests start from its entry."""
    tmp = tmp_path_factory.mktemp("compiled")
    cache_dir = tmp / "cache"
    return (tmp, cache_dir, *attach_default(tmp, cache_dir, "first"))


def test_compiled_once_then_loaded_from_the_cache_both_exact(compiled):
    tmp, cache_dir, ready, doc, truth = compiled
    assert "BPF program compiled in" in ready, ready
    assert_matches_truth(doc, truth)
    [entry] = entries(cache_dir)
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert not list(cache_dir.glob(".compile-*"))  # no temporary left behind
    attach_pid_without_llvm(tmp, cache_dir, "cached")
    assert entries(cache_dir) == [entry]


def test_a_compiling_tracer_keeps_no_llvm_mapped(tmp_path):
    """With --folded too: stacks are symbolized (at attach, and at the end)
    without bcc's Python module, which would load LLVM."""
    folded = tmp_path / "kv.folded"
    attach_pid_without_llvm(tmp_path, tmp_path / "cache", "compiled", "--folded", folded)
    lines = folded.read_text().splitlines()
    assert lines and any("kvsim" in line for line in lines), lines[:5]


def test_the_entry_holds_what_the_verifier_walked(compiled):
    """Each program's verified_insns in the entry (the loader's order) is
    what the kernel's verifier says it processed when the program is loaded
    again with its statistics log: read from bpf_prog_info at the offset
    program.py names, checked here against the verifier's own words."""
    import base64
    import ctypes
    import struct

    from tracer.kernel import bpf, program

    [path] = entries(compiled[1])
    entry = json.loads(path.read_text())
    lib = bpf.libbcc_bpf()
    fds = [lib.bcc_create_map(m["type"], m["name"][:15].encode(), m["key_size"],
                              m["value_size"], m["max_entries"], m["flags"])
           for m in entry["maps"]]
    fds.append(bpf.load_btf(bpf.FUNC_BTF))
    try:
        assert min(fds) >= 0
        said = {}
        for prog in entry["progs"]:
            insns = bytearray(base64.b64decode(prog["insns"]))
            for at, m in prog["map_refs"]:
                struct.pack_into("<i", insns, at * 8 + 4, fds[m])
            log = ctypes.create_string_buffer(1 << 16)
            buf = (ctypes.c_char * len(insns)).from_buffer(insns)
            # as the tracer loads it; log level 4: the statistics
            fd = bpf.load_prog(prog["name"][:15].encode(), buf, len(insns),
                               entry["license"].encode(), entry["kern_version"], fds[-1],
                               prog.get("subprogs") or [], log, 4, program.attach_type())
            assert fd >= 0, prog["name"]
            os.close(fd)
            said[prog["name"]] = int(re.search(rb"processed (\d+) insns", log.value).group(1))
        assert {p["name"]: p["verified_insns"] for p in entry["progs"]} == said
        assert min(said.values()) > 0
        # the table and ids stages' chunks are bpf_loop() callbacks, linked
        # by the compile: one instruction range each past the stage's end
        linked = {p["name"]: p.get("subprogs") for p in entry["progs"] if p.get("subprogs")}
        assert {name: len(at) for name, at in linked.items()} == {
            "kvtrace_stage_table": 1, "kvtrace_stage_ids": 1}
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("spoil", ["garbage", "refused"])
def test_a_spoiled_entry_is_compiled_again(tmp_path, compiled, spoil):
    """Garbage is not read; an entry the kernel refuses (its first program's
    instructions replaced by an unterminated one) is compiled again and
    replaced.  Both runs still count exactly."""
    cache_dir = tmp_path / "cache"
    shutil.copytree(compiled[1], cache_dir)
    [entry] = entries(cache_dir)
    if spoil == "garbage":
        entry.write_text("{ this is not the program")
    else:
        doc = json.loads(entry.read_text())
        doc["progs"][0]["insns"] = "twAAAAAAAAA="  # one `mov r0, 0` and no exit
        doc["progs"][0]["map_refs"] = []
        entry.write_text(json.dumps(doc))
    ready, doc, truth = attach_default(tmp_path, cache_dir, "again")
    assert "BPF program compiled in" in ready, ready
    assert_matches_truth(doc, truth)
    assert entries(cache_dir) == [entry]
    assert json.loads(entry.read_text())["progs"][0]["insns"] != "twAAAAAAAAA="
    ready, _, _ = attach_default(tmp_path, cache_dir, "third")
    assert "BPF program cached in" in ready, ready


def test_a_directory_others_can_write_is_not_used(tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    ready, doc, truth = attach_default(tmp_path, cache_dir, "unsafe")
    assert re.search(r"BPF program compiled, not cached: .* writable by others", ready), ready
    assert_matches_truth(doc, truth)
    assert entries(cache_dir) == []


def test_a_compile_error_names_clangs_first_error():
    """The compile runs in a child; its failure still reaches the user as
    one line that names the compiler's first error, not bcc's summary."""
    from tracer import abi
    from tracer.kernel import program
    from tracer.errors import EnvironmentProblem

    with pytest.raises(EnvironmentProblem) as e:
        program.compile_entry([f"-I{abi.BPF_DIR}", "-DKVTRACE_MAX_BLOCKS=notanumber"],
                              "k" * 64, "/dev/null")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("the BPF program did not compile: ")
    assert "error: use of undeclared identifier 'notanumber'" in line, line
