"""The vLLM plugin (plugin/, docs/plugin.md): its probes' C extension and
its hooks in a real vLLM on the CPU.

The plugin is installed into .venv-vllm by `make setup`; these tests run it
there, with vLLM's python, in subprocesses.  Expected values come from the
probe header, from an FNV-1a written here, and from vLLM itself: what it
generated, its own prefix-cache counters, and what its worker passed to the
attention op (scripts/vllm-workload.py --record-reads); never from the
plugin's code.  KVTRACE_PLUGIN_RECORD makes the hooks fire every probe as if
a tracer were attached and write each firing to a file.
"""

import json
import os
import re
import subprocess
import textwrap
from collections import defaultdict

import pytest
from elftools.elf.elffile import ELFFile

from conftest import ROOT

pytestmark = pytest.mark.vllm

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKLOAD = ROOT / "scripts" / "vllm-workload.py"
HEADER = ROOT / "bpf" / "kvtrace_probes.h"
BLOCK_SIZE = 32
# prompt_len:max_tokens; every prompt starts with the same 64 tokens, so with
# prefix caching on the later ones hit the first one's two full blocks
REQUESTS = "100:8,70:8,90:3,64:5,100:1,128:4"
SHARED_PREFIX = 64


def vllm_python(code, env=None, timeout=300):
    """Run code with vLLM's python; (returncode, stdout + stderr)."""
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM CPU environment is missing: run make setup")
    e = dict(os.environ)
    e.pop("KVTRACE_PLUGIN_RECORD", None)
    e.update(env or {})
    r = subprocess.run([str(VLLM_PYTHON), "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=e, cwd="/")
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def probes_so():
    rc, out = vllm_python("import kvtrace_vllm._probes as p; print('SO', p.__file__)")
    assert rc == 0, f"the plugin is not installed in .venv-vllm (make setup):\n{out[-2000:]}"
    return re.search(r"^SO (\S+)$", out, re.M).group(1)


def header_plugin_tier_probes():
    """The probe names the plugin fires, read from the header: the probe
    macros (KVTRACE_<NAME>) defined after "The plugin tier", and block_table,
    which it also fires."""
    text = HEADER.read_text()
    tier = text[text.index(" * The plugin tier"):]
    names = {m.lower() for m in re.findall(r"#define KVTRACE_(\w+)\(", tier)}
    names.add("block_table")
    assert {"block_alloc", "request", "req_finish"} <= names
    return names


def test_so_carries_the_plugin_tier_probes_with_semaphores(probes_so):
    out = subprocess.run(["readelf", "-n", probes_so], check=True, capture_output=True,
                         text=True).stdout
    notes = re.findall(r"Provider: (\S+)\s+Name: (\S+)\s+Location: \S+, Base: \S+, "
                       r"Semaphore: (0x[0-9a-f]+)", out)
    assert sorted(n for _, n, _ in notes) == sorted(header_plugin_tier_probes())
    assert {p for p, _, _ in notes} == {"vllm"}
    with open(probes_so, "rb") as f:
        elf = ELFFile(f)
        probes = elf.get_section_by_name(".probes")
        assert probes is not None, "no .probes section: the header's semaphores are missing"
        lo, hi = probes["sh_addr"], probes["sh_addr"] + probes["sh_size"]
        symbols = {s.name: s["st_value"] for s in elf.get_section_by_name(".symtab").iter_symbols()}
    for _, name, sem in notes:
        addr = int(sem, 16)
        assert addr != 0, name
        assert lo <= addr < hi, f"{name}'s semaphore is not in .probes"
        assert symbols.get(f"vllm_{name}_semaphore") == addr, name


def test_every_probe_argument_is_one_the_tracer_reads(probes_so):
    """Each argument a register, a stack slot or a constant: a global's
    `8@sym(%rip)` (the compiler's choice for a static buffer) would get the
    probe skipped.  Read with readelf, checked against the forms the SDT
    notes allow the tracer to decode."""
    out = subprocess.run(["readelf", "-n", probes_so], check=True, capture_output=True,
                         text=True).stdout
    args = re.findall(r"Name: (\S+)\n.*\n\s+Arguments: ([^\n]*)", out)
    assert sorted(n for n, _ in args) == sorted(header_plugin_tier_probes())
    form = re.compile(r"-?\d+@(%\w+|-?\d*\(%(rsp|rbp)\)|\$-?\d+)$")
    for name, spec in args:
        bad = [a for a in spec.split() if not form.match(a)]
        assert not bad, (name, spec)


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def test_req_hash_is_fnv1a_64_of_utf8(probes_so):
    # published FNV-1a 64 test vectors, then the algorithm on vLLM-like ids
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8
    ids = ["", "a", "foobar", "cmpl-3f2a9c-0", "0-87b1cab3", "req-é-中文", "x" * 300]
    rc, out = vllm_python(f"""
        from kvtrace_vllm import _probes
        for s in {ids!r}:
            print(_probes.req_hash(s))
    """)
    assert rc == 0, out
    got = [int(x) for x in out.split()]
    assert got == [fnv1a64(s.encode()) for s in ids]


def run_workload(tmp_path, name, env, *extra, requests=REQUESTS):
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    e = dict(os.environ)
    e.pop("KVTRACE_PLUGIN_RECORD", None)
    e.pop("VLLM_PLUGINS", None)
    e.update(env)
    with open(log, "w") as f:
        r = subprocess.run([str(VLLM_PYTHON), str(WORKLOAD), "--model", str(tmp_path / "model"),
                            "--requests", requests, "--block-size", str(BLOCK_SIZE),
                            "--out", str(out), *map(str, extra)],
                           stdout=f, stderr=subprocess.STDOUT, env=e, timeout=600)
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    return json.loads(out.read_text()), text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same greedy workload twice, prefix caching on, prompts prefilled
    in chunks: plugin loaded with every probe firing (recorded), and plugins
    disabled (VLLM_PLUGINS='')."""
    tmp = tmp_path_factory.mktemp("plugin")
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "make-tiny-model.py"),
                    str(tmp / "model")], check=True, capture_output=True)
    rec, reads = tmp / "probes.jsonl", tmp / "reads.jsonl"
    # a 64-token step budget: the longer prompts are prefilled in chunks
    prefix = ("--prefix-caching", "on", "--shared-prefix", SHARED_PREFIX,
              "--max-num-batched-tokens", 64)
    on, on_log = run_workload(tmp, "on", {"KVTRACE_PLUGIN_RECORD": str(rec)},
                              "--record-reads", reads, *prefix)
    off, off_log = run_workload(tmp, "off", {"VLLM_PLUGINS": ""}, *prefix)
    fired = [json.loads(line) for line in rec.read_text().splitlines()]
    worker = [json.loads(line) for line in reads.read_text().splitlines()]
    return dict(on=on, on_log=on_log, off=off, off_log=off_log, fired=fired, reads=worker)


def test_plugin_loads_and_installs_in_the_engine_core(runs):
    assert re.search(r"EngineCore pid=\d+\).*kvtrace: hooks installed in pid \d+ "
                     r"\(tested vLLM release 0\.32\.0\)", runs["on_log"]), runs["on_log"][-3000:]
    assert "kvtrace:" not in runs["off_log"]
    assert "a hook failed" not in runs["on_log"]


def test_generation_is_unchanged_by_the_plugin(runs):
    on = [r["generated"] for r in runs["on"]["requests"]]
    off = [r["generated"] for r in runs["off"]["requests"]]
    assert on == off
    assert all(on)


def test_requests_and_their_ends(runs):
    fired, gen = runs["fired"], runs["on"]
    reqs = [f for f in fired if f["probe"] == "request"]
    assert [r["prompt_tokens"] for r in reqs] == [r["prompt_len"] for r in gen["requests"]]
    assert all(r["req"] == fnv1a64(r["id"].encode()) for r in reqs)
    finished = {f["req"]: f["tokens"] for f in fired if f["probe"] == "req_finish"}
    assert finished == {r["req"]: len(g["generated"]) for r, g in zip(reqs, gen["requests"])}
    assert not [f for f in fired if f["probe"] == "req_preempt"]


def test_block_events_balance_per_request(runs):
    """Each request frees exactly the blocks it was given (allocated or hit),
    and every event is for a request the request probe named."""
    fired = runs["fired"]
    named = {f["req"] for f in fired if f["probe"] == "request"}
    given, freed = defaultdict(list), defaultdict(list)
    for f in fired:
        if f["probe"] in ("block_alloc", "block_hit", "block_cache", "block_free"):
            assert f["req"] in named and f["group"] == 0 and 0 not in f["ids"], f
        if f["probe"] in ("block_alloc", "block_hit"):
            given[f["req"]] += f["ids"]
        elif f["probe"] == "block_free":
            freed[f["req"]] += f["ids"]
    assert set(given) == named
    assert {r: sorted(v) for r, v in given.items()} == {r: sorted(v) for r, v in freed.items()}


def test_block_hits_equal_vllms_prefix_cache_hits(runs):
    hits = sum(len(f["ids"]) for f in runs["fired"] if f["probe"] == "block_hit")
    pc = runs["on"]["prefix_cache"]
    assert pc["unit"] == "tokens" and pc["hits"] > 0
    assert hits == pc["hits"] // BLOCK_SIZE and pc["hits"] % BLOCK_SIZE == 0


def test_block_cache_is_each_requests_full_blocks_not_hit(runs):
    """A request computes prompt + generated - 1 tokens (its last token is
    never fed back); every full block of those that it did not hit gets a
    hash, in a block allocated for it."""
    fired, gen = runs["fired"], runs["on"]
    reqs = [f["req"] for f in fired if f["probe"] == "request"]
    by = defaultdict(lambda: defaultdict(list))
    for f in fired:
        if f["probe"].startswith("block_") and f["probe"] != "block_table":
            by[f["req"]][f["probe"]] += f["ids"]
    for req, g in zip(reqs, gen["requests"]):
        computed = g["prompt_len"] + len(g["generated"]) - 1
        ev = by[req]
        assert len(ev["block_cache"]) == computed // BLOCK_SIZE - len(ev["block_hit"]), g
        assert set(ev["block_cache"]) <= set(ev["block_alloc"])


def assert_tables_equal_reads(fired, reads):
    """Per step, the plugin's block_table rows (the first ceil(seq_len /
    block_size) entries) and seq_lens equal the block table and seq_lens the
    worker passed to cpu_attention_with_kv_cache (as multisets: row order
    is the worker's input batch order)."""
    tables = [f for f in fired if f["probe"] == "block_table"]
    reads = [r for r in reads if "rows" in r]
    assert len(tables) == len(reads) > 0

    def plugin_rows(t):
        bs = t["block_size"]
        return sorted((s, row[:-(-s // bs)]) for s, row in zip(t["seq_lens"], t["rows"]))

    for t, r in zip(tables, reads):
        assert t["group"] == r["group"] == 0
        assert t["block_size"] == r["block_size"] and t["num_blocks"] == r["num_blocks"]
        assert t["row_stride"] >= max(map(len, t["rows"]))
        assert plugin_rows(t) == sorted(zip(r["seq_lens"], r["rows"]))


def test_block_tables_equal_what_the_worker_attention_read(runs):
    assert_tables_equal_reads(runs["fired"], runs["reads"])


def assert_step_rows_replay_to_tables(fired, resets=False):
    """step_rows' deltas, replayed (each row: the row kept for its request
    and group cut at tail_from, then its tail; a block_free nulls the freed
    blocks in its request's kept row), equal the whole table the plugin
    fired for the same step and group, row for row (0-padded to its
    stride), with the same seq_lens and step_reqs' tokens.  resets: some
    row must have been sent whole again (a preemption freed it)."""
    kept, table, names, steps, resent = defaultdict(dict), {}, None, 0, 0
    for f in fired:
        p = f["probe"]
        if p == "step_reqs":
            names = f
        elif p == "block_table":
            table[f["group"]] = f
        elif p == "block_free":
            row = kept[f["group"]].get(f["req"])
            if row:
                row[:] = [0 if b in f["ids"] else b for b in row]
        elif p == "step_rows":
            t, rows, tail = table.pop(f["group"]), kept[f["group"]], f["tail"]
            assert len(f["rows"]) == len(t["rows"]) == len(names["reqs"])
            assert f["block_size"] == t["block_size"] and f["num_blocks"] == t["num_blocks"]
            at = 0
            for (req, seq, new, n, frm), want, seq_t, req_t, new_t in zip(
                    f["rows"], t["rows"], t["seq_lens"], names["reqs"], names["tokens"]):
                assert (req % 2**64, seq, new) == (req_t, seq_t, new_t)
                req %= 2**64
                if frm == 0 and req in rows:
                    resent += 1
                assert frm <= len(rows.get(req, [])) or frm == 0
                row = (rows.get(req, [])[:frm] if frm else []) + tail[at:at + n - frm]
                at += n - frm
                assert len(row) == n >= -(-seq // f["block_size"])
                rows[req] = row
                assert row + [0] * (len(want) - n) == want, (req, frm)
            assert at == len(tail)
            steps += 1
    assert steps == sum(f["probe"] == "block_table" for f in fired) > 0
    assert not table
    if resets:
        assert resent > 0


def test_step_rows_replay_to_the_whole_tables(runs):
    """Prefix caching and chunked prefill: the deltas add up to the tables."""
    fired = runs["fired"]
    assert_step_rows_replay_to_tables(fired)
    # deltas: each row's entries are sent once, not at every step
    tails = sum(len(f["tail"]) for f in fired if f["probe"] == "step_rows")
    entries = sum(r[3] for f in fired if f["probe"] == "step_rows" for r in f["rows"])
    assert 0 < tails < entries / 2


def test_step_reqs_names_each_rows_request_and_its_new_tokens(runs):
    """step_reqs fires just before each step's block_table, one entry per
    row: the row holds only blocks its request was given (allocated or
    hit), and a request's new tokens over its steps are what it computed
    (prompt + generated - 1, less its prefix hits), chunked prefill
    included."""
    fired, gen = runs["fired"], runs["on"]
    given, hits = defaultdict(set), defaultdict(int)
    written = defaultdict(int)
    steps = 0
    for k, f in enumerate(fired):
        if f["probe"] in ("block_alloc", "block_hit"):
            given[f["req"]].update(f["ids"])
            if f["probe"] == "block_hit":
                hits[f["req"]] += len(f["ids"])
        if f["probe"] != "block_table":
            continue
        sr = fired[k - 1]
        assert sr["probe"] == "step_reqs" and len(sr["reqs"]) == len(f["rows"]), sr
        steps += 1
        bs = f["block_size"]
        for req, new, seq, row in zip(sr["reqs"], sr["tokens"], f["seq_lens"], f["rows"]):
            assert 0 < new <= seq
            assert set(row[:-(-seq // bs)]) <= given[req]
            written[req] += new
    assert steps == sum(f["probe"] == "step_reqs" for f in fired) > 0
    reqs = [f["req"] for f in fired if f["probe"] == "request"]
    assert sorted(written) == sorted(reqs)
    chunked = False
    for req, g in zip(reqs, gen["requests"]):
        assert written[req] == g["prompt_len"] + len(g["generated"]) - 1 - hits[req] * BLOCK_SIZE
        chunked |= g["prompt_len"] > 64
    assert chunked  # some prompt took more than one step


def test_preemption_and_eviction(tmp_path):
    """A KV cache of 20 blocks for 4 requests of 10 blocks each, prefix
    caching on: vLLM preempts, and evicts cached blocks to reuse them.
    req_preempt carries the tokens computed before the reset and the
    request's blocks are freed right after it; an evicted block had been
    cached and is among the blocks then allocated for the same request;
    block tables still equal the worker's reads (recomputation included);
    greedy tokens equal a run with plugins off."""
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "make-tiny-model.py"),
                    str(tmp_path / "model")], check=True, capture_output=True)
    rec, reads = tmp_path / "probes.jsonl", tmp_path / "reads.jsonl"
    # 32 KiB per block of the tiny model
    small = ("--kv-cache-bytes", 20 * 32768, "--prefix-caching", "on")
    requests = "200:100,200:100,200:100,200:100"
    on, log = run_workload(tmp_path, "on", {"KVTRACE_PLUGIN_RECORD": str(rec)},
                           "--record-reads", reads, *small, requests=requests)
    off, _ = run_workload(tmp_path, "off", {"VLLM_PLUGINS": ""}, *small, requests=requests)
    assert "a hook failed" not in log
    assert [r["generated"] for r in on["requests"]] == [r["generated"] for r in off["requests"]]
    fired = [json.loads(line) for line in rec.read_text().splitlines()]
    events = [f for f in fired if f["probe"] not in ("block_table", "step_rows")]

    preempts = [i for i, f in enumerate(events) if f["probe"] == "req_preempt"]
    assert preempts, "vLLM did not preempt: the test's KV cache is too large"
    for i in preempts:
        req, computed = events[i]["req"], events[i]["tokens"]
        assert computed > 0
        free = next(f for f in events[i + 1:] if f["req"] == req)
        assert free["probe"] == "block_free"
        # it held at least the blocks of what it had computed
        assert len(free["ids"]) >= -(-computed // BLOCK_SIZE)

    evicts = [i for i, f in enumerate(events) if f["probe"] == "block_evict"]
    assert evicts, "vLLM evicted no cached block"
    for i in evicts:
        ev = events[i]
        cached = {b for f in events[:i] if f["probe"] == "block_cache" for b in f["ids"]}
        assert set(ev["ids"]) <= cached
        alloc = next(f for f in events[i + 1:] if f["probe"] == "block_alloc")
        assert alloc["req"] == ev["req"] and alloc["group"] == ev["group"]
        assert set(ev["ids"]) <= set(alloc["ids"])

    assert_tables_equal_reads(fired, [json.loads(line) for line in reads.read_text().splitlines()])
    assert_step_rows_replay_to_tables(fired, resets=True)


@pytest.fixture(scope="module")
def status_so():
    rc, out = vllm_python("import kvtrace_vllm._status as s; print('SO', s.__file__)")
    assert rc == 0, f"the plugin is not installed in .venv-vllm (make setup):\n{out[-2000:]}"
    return re.search(r"^SO (\S+)$", out, re.M).group(1)


def test_the_status_object_carries_no_probe(status_so):
    """A process that maps probe sites is one the tracer names a tier for:
    the object every scheduler process maps, refused plugin or not, has
    none."""
    out = subprocess.run(["readelf", "-n", status_so], check=True, capture_output=True,
                         text=True).stdout
    assert "stapsdt" not in out and "Provider:" not in out


def status_in_memory(pid, so_path):
    """The plugin's status line as the tracer would read it: the
    kvtrace_plugin_status symbol of the status object (its ELF symbol
    table), at the address where the process mapped that object
    (/proc/PID/maps), read from /proc/PID/mem."""
    with open(so_path, "rb") as f:
        elf = ELFFile(f)
        sym = elf.get_section_by_name(".symtab").get_symbol_by_name("kvtrace_plugin_status")
        assert sym, "no kvtrace_plugin_status symbol in the probes' object"
        first_load = min(seg["p_vaddr"] for seg in elf.iter_segments()
                         if seg["p_type"] == "PT_LOAD")
        addr, size = sym[0]["st_value"], sym[0]["st_size"]
    real = os.path.realpath(so_path)
    base = None
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        if len(parts) >= 6 and os.path.realpath(parts[5]) == real and int(parts[2], 16) == 0:
            base = int(parts[0].split("-")[0], 16) - first_load
            break
    assert base is not None, f"{so_path} is not mapped in {pid}"
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(base + addr)
        return mem.read(size).split(b"\0")[0].decode()


def run_until_read(code, env=None):
    """Start code with vLLM's python: it prints "READY <pid>" and waits on
    stdin, so that its memory can be read while it lives."""
    e = dict(os.environ)
    e.pop("KVTRACE_PLUGIN_RECORD", None)
    e.update(env or {})
    return subprocess.Popen([str(VLLM_PYTHON), "-c", textwrap.dedent(code)], cwd="/",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=e)


def read_status_of(code, status_so):
    """Start code, read the status line from its memory once it is READY,
    let it end; (status, its whole output, its /proc/PID/maps then)."""
    p = run_until_read(code)
    lines = []
    status = maps = None
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("READY"):
                pid = int(line.split()[1])
                status = status_in_memory(pid, status_so)
                maps = open(f"/proc/{pid}/maps").read()
                break
    finally:
        out, _ = p.communicate("\n", timeout=300)
    return status, "".join(lines) + out, maps


# a Scheduler built the way the conformance run builds one: no model
# (indented as the test code it joins, for textwrap.dedent)
BUILD_SCHEDULER = f"""
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import vllm_conformance as vc
        vc.make_scheduler(MODEL, vc.scenario("full-16"))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts" / "make-tiny-model.py"), str(d)],
                   check=True, capture_output=True)
    return d


def test_an_untested_release_is_traced_and_labelled(status_so, tiny_model):
    """A release outside the tested matrix whose classes pass the layout
    check: the hooks go in, one log line says untested, and the probes'
    status object carries "untested vLLM release X" where the tracer reads
    it."""
    code = f"""
        import os, sys
        import vllm
        vllm.__version__ = "0.99.1"
        import kvtrace_vllm
        from kvtrace_vllm import hooks
        kvtrace_vllm.register()
        kvtrace_vllm.register()
        MODEL = {str(tiny_model)!r}
    """ + BUILD_SCHEDULER + """
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.sched.scheduler import Scheduler
        print("WRAPPED", hasattr(BlockPool.touch, "__kvtrace_wrapped__"),
              hasattr(Scheduler.schedule, "__kvtrace_wrapped__"))
        print("READY", os.getpid(), flush=True)
        sys.stdin.readline()
    """
    status, out, maps = read_status_of(code, status_so)
    assert "WRAPPED True True" in out, out
    assert "kvtrace_vllm/_probes" in maps
    assert status == "untested vLLM release 0.99.1", out
    lines = [line for line in out.splitlines()
             if "kvtrace:" in line and "hooks installed in pid" not in line]
    assert len(lines) == 1 and "0.99.1" in lines[0] and "untested" in lines[0], out


def test_a_broken_layout_installs_nothing_and_says_what_is_missing(status_so, tiny_model):
    """A method the hooks need is gone: nothing of vLLM's is wrapped but
    Scheduler.__init__, one log line names the method, and the same reason
    is in the status object of the scheduler's process, in one line; the
    probes' object is not mapped there."""
    code = f"""
        import os, sys
        from vllm.v1.core.block_pool import BlockPool
        del BlockPool._maybe_evict_cached_block
        import kvtrace_vllm
        kvtrace_vllm.register()
        kvtrace_vllm.register()
        MODEL = {str(tiny_model)!r}
    """ + BUILD_SCHEDULER + """
        from vllm.v1.core.sched.scheduler import Scheduler
        print("WRAPPED", hasattr(BlockPool.touch, "__kvtrace_wrapped__"),
              hasattr(Scheduler.schedule, "__kvtrace_wrapped__"))
        print("READY", os.getpid(), flush=True)
        sys.stdin.readline()
    """
    status, out, maps = read_status_of(code, status_so)
    assert "WRAPPED False False" in out, out
    assert "kvtrace_vllm/_probes" not in maps
    assert status is not None and "\n" not in status, out
    assert re.fullmatch(r"refused vLLM release 0\.32\.0: "
                        r"BlockPool\._maybe_evict_cached_block is missing", status), status
    lines = [line for line in out.splitlines() if "kvtrace:" in line]
    assert len(lines) == 1 and "_maybe_evict_cached_block is missing" in lines[0], out


def test_a_failing_hook_leaves_vllm_untouched(tmp_path):
    """With every probe on, a probe call that raises: vLLM's functions return
    the same, raise the same, the failure is counted and logged once."""
    code = """
        import kvtrace_vllm
        from kvtrace_vllm import hooks
        kvtrace_vllm.register()
        kvtrace_vllm.register()
        from vllm.v1.core.block_pool import BlockPool
        assert not hasattr(BlockPool.get_new_blocks, "__wrapped__")  # no scheduler yet
        hooks.activate()  # what building the first Scheduler does
        assert BlockPool.get_new_blocks.__wrapped__.__name__ == "get_new_blocks"
        assert not hasattr(BlockPool.get_new_blocks.__wrapped__, "__wrapped__")

        class Boom:
            def __getattr__(self, name):
                def fail(*a):
                    raise RuntimeError("probe " + name)
                return fail
        hooks.P = Boom()

        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
        hooks.CTX.req_id, hooks.CTX.pool, hooks.CTX.group = "r1", pool, 0
        blocks = pool.get_new_blocks(3)
        print("IDS", [b.block_id for b in blocks], [b.ref_cnt for b in blocks])
        pool.touch(blocks)
        print("REF", [b.ref_cnt for b in blocks])
        try:
            pool.get_new_blocks(100)
        except ValueError as e:
            print("RAISED", e)
        print("ERRORS", hooks.errors)
    """
    rc, out = vllm_python(code, env={"KVTRACE_PLUGIN_RECORD": str(tmp_path / "rec.jsonl")})
    assert rc == 0, out
    assert "IDS [1, 2, 3] [1, 1, 1]" in out
    assert "REF [2, 2, 2]" in out
    assert "RAISED Cannot get 100 free blocks from the pool" in out
    assert "ERRORS 2" in out
    assert out.count("a hook failed") == 1, out


@pytest.mark.parametrize("edit,why", [
    ("from vllm.v1.core.kv_cache_utils import KVCacheBlock\n"
     "del KVCacheBlock.block_hash",
     "KVCacheBlock has no attribute block_hash"),
    # an __init__ with source to read (a file), setting no num_gpu_blocks
    ("from vllm.v1.core.block_pool import BlockPool\n"
     "import edit_init\n"
     "BlockPool.__init__ = edit_init.__init__",
     "BlockPool sets no attribute num_gpu_blocks"),
])
def test_the_layout_check_names_a_missing_attribute(tmp_path, edit, why):
    """The attributes the hooks read on vLLM's objects are part of the
    layout check: one gone (a property, an attribute its class's __init__
    no longer sets) refuses the release with that one line."""
    (tmp_path / "edit_init.py").write_text("def __init__(self, *a, **k):\n"
                                           "    self.blocks = []\n")
    rc, out = vllm_python(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + edit +
                          "\nfrom kvtrace_vllm import hooks\nprint('WHY', hooks._check_layout())")
    assert rc == 0, out
    assert f"WHY {why}" in out, out
    rc, out = vllm_python("from kvtrace_vllm import hooks\nprint('WHY', hooks._check_layout())")
    assert rc == 0 and "WHY None" in out, out
