"""Fuzzing the trace reader and the offline commands (report, export) with
hypothesis: damaged, cut, shuffled and made-up trace files must either read
or fail with DataError: one line on stderr, exit 4, never a traceback, never
another exception, never a hang.  `--partial` must keep the intact prefix.

Seeds: a synthetic trace written with TraceWriter from records built in the
layouts of bpf/kvtrace.h (tests/test_unit_tracefile.py), and a real
recording of kvsim (`record`, real BPF; the swap workload: writes, swaps).

The runs are deterministic (derandomize, no example database) and bounded:
KVTRACE_FUZZ_EXAMPLES raises the examples per test for a longer hunt
(docs/trace-format.md, "Robustness")."""

import contextlib
import io
import json
import os
import signal
import struct
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from conftest import KVSIM, run_kvtrace
from test_unit_tracefile import synthetic_ops, write_trace
from tracer import cli
from tracer.trace import tracefile
from tracer.errors import DataError

EXIT_DATA = 4
EXAMPLES = int(os.environ.get("KVTRACE_FUZZ_EXAMPLES", "0")) or None
PER_EXAMPLE_S = 20  # an example that takes longer counts as a hang


def fuzz_settings(examples):
    return settings(max_examples=EXAMPLES or examples, deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])


# -- seeds ----------------------------------------------------------------------------

def frames_of(data: bytes) -> list:
    """(offset, kind, payload) of every frame of an intact trace, by the layout
    in docs/trace-format.md (written out here, not taken from the reader)."""
    pos, out = 16, []
    while pos < len(data):
        magic, kind, length, _crc, _head = struct.unpack_from("<4sIQII", data, pos)
        assert magic == b"KVTF"
        out.append((pos, kind, data[pos + 24:pos + 24 + length]))
        pos += 24 + length
    return out


def frame(kind: int, payload: bytes) -> bytes:
    head = struct.pack("<4sIQI", b"KVTF", kind, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.fixture(scope="session")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    synthetic = write_trace(d / "synthetic.kvt", [synthetic_ops(6, 40, 16, seq0=6 * i)
                                                  for i in range(3)], blocks=16)
    real = d / "real.kvt"
    r = run_kvtrace("record", "-o", real, "--", KVSIM, "--workload", "swap", "--layers", 1,
                    "--quiet")
    assert r.returncode == 0, r.stderr
    out = Seeds(synthetic=synthetic.read_bytes(), real=real.read_bytes())
    for data in out.values():  # both seeds are whole, valid traces
        assert [k for _, k, _ in frames_of(data)][-1] == tracefile.KIND_END
    return out


class Seeds(dict):
    def __repr__(self):  # hypothesis prints the arguments of a failing example
        return f"<seeds {', '.join(f'{k}: {len(v)} bytes' for k, v in self.items())}>"


# -- the property ---------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds):
    def hang(signum, frame):
        raise AssertionError(f"no answer within {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli_main(*args):
    """tracer.cli.main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


COMMANDS = [("report", "--format", "json"), ("report", "--format", "csv", "--table",
                                               "generations"),
            ("report",), ("export", "--folded", "--by", "stack"),
            ("export", "--folded", "--by", "block", "--weight", "bytes"),
            ("export", "--folded", "--by", "block")]


def check(path, data: bytes, command, original: bytes = None):
    """The reader and one offline command on `data`: a trace or DataError.
    original: the file `data` was made from by damage; every frame before
    the first byte that differs must then be kept."""
    path.write_bytes(data)
    # a warning would be more lines on stderr: numpy's, on made-up numbers
    with time_limit(PER_EXAMPLE_S), warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            trace = tracefile.read(str(path))
        except DataError as e:
            assert "\n" not in str(e) and str(e)
            trace = None
            event("refused: " + str(e).split(": ", 1)[1][:40])
        else:
            event("read: " + (trace.damage or "whole")[:40])
        if original is not None:
            header_whole, batches_whole = intact_prefix(original, data)
            assert trace is not None or not header_whole
            if trace is not None:
                kept = [bytes(b.ops) + bytes(b.chunk_hdrs) + bytes(b.values)
                        for b in trace.batches]
                assert kept[:len(batches_whole)] == batches_whole
        if trace is not None:
            len(trace.ops.ops)  # decoding the batches it kept must work
            try:
                tracefile.load(str(path))
                assert trace.damage is None
            except DataError as e:
                assert trace.damage and "\n" not in str(e)
            warned = []
            again = tracefile.load(str(path), partial=True, warn=warned.append)
            assert len(again.batches) == len(trace.batches) and bool(warned) == bool(trace.damage)
        for partial in ((), ("--partial",)):
            rc, out, err = cli_main(*command[:1], path, *command[1:], *partial)
            lines = err.strip().splitlines()
            if rc == 0:
                assert trace is not None and (partial or trace.damage is None)
                assert all(line.startswith("kvtrace-bpf:") for line in lines), err
            else:
                assert rc == EXIT_DATA, (rc, err)
                assert len(lines) == 1 and lines[0].startswith("kvtrace-bpf: "), err
                assert out == ""
                # whatever the reader kept, --partial reports
                assert trace is None or not partial, err


def intact_prefix(original: bytes, data: bytes):
    """(whether the trace header frame, and which batches (their three arrays),
    of original lie wholly before the first byte where data differs)."""
    n = min(len(original), len(data))
    diff = np.flatnonzero(np.frombuffer(original[:n], np.uint8) !=
                          np.frombuffer(data[:n], np.uint8))
    first = int(diff[0]) if len(diff) else n
    whole = [(kind, payload) for off, kind, payload in frames_of(original)
             if off + 24 + len(payload) <= first]
    return bool(whole), [p[24:] for k, p in whole if k == tracefile.KIND_BATCH]


seed_names = st.sampled_from(["synthetic", "real"])
commands = st.sampled_from(COMMANDS)


# -- byte-level damage ----------------------------------------------------------------

@st.composite
def offsets_in(draw, data):
    """An offset anywhere, or near a file or frame header (lengths, checksums)."""
    heads = [0] + [off for off, _, _ in frames_of(data)] if data[:4] == b"KVTR" else [0]
    return draw(st.one_of(
        st.integers(0, max(0, len(data) - 1)),
        st.builds(lambda h, d: min(max(0, len(data) - 1), h + d),
                  st.sampled_from(heads), st.integers(0, 31))))


@st.composite
def damaged(draw, data):
    how = draw(st.sampled_from(["cut", "flip", "overwrite", "insert", "delete"]))
    at = draw(offsets_in(data))
    if how == "cut":
        return data[:at]
    if how == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            out[at] ^= draw(st.integers(1, 255))
            at = draw(offsets_in(data))
        return bytes(out)
    if how == "overwrite":
        patch = draw(st.binary(min_size=1, max_size=16))
        return data[:at] + patch + data[at + len(patch):]
    if how == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=64)) + data[at:]
    return data[:at] + data[at + draw(st.integers(1, 64)):]


@fuzz_settings(150)
@given(data=st.data(), seed=seed_names, command=commands)
def test_damaged_bytes(seeds, tmp_path_factory, data, seed, command):
    original = seeds[seed]
    check(tmp_path_factory.mktemp("f") / "t.kvt", data.draw(damaged(original)), command,
          original)


@fuzz_settings(60)
@given(blob=st.one_of(st.binary(max_size=4096),
                      st.builds(lambda v, rest: struct.pack("<8sII", b"KVTRACE\0", v, 0) + rest,
                                st.sampled_from([1, 1, 0, 2, 2**32 - 1]),
                                st.binary(max_size=512))),
       command=commands)
def test_random_bytes_and_valid_header_then_garbage(tmp_path_factory, blob, command):
    check(tmp_path_factory.mktemp("f") / "t.kvt", blob, command)


# -- checksummed nonsense: frames that pass their checksums ---------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)


def json_paths(doc, prefix=()):
    """Every (path) to a value inside a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, prefix + (i,))


def replaced(doc, path, value):
    if not path:
        return value
    doc = doc.copy()
    doc[path[0]] = replaced(doc[path[0]], path[1:], value)
    return doc


@st.composite
def mutated_json(draw, payload: bytes):
    doc = json.loads(payload)
    how = draw(st.sampled_from(["replace", "drop", "text"]))
    paths = list(json_paths(doc))
    path = draw(st.sampled_from(paths))
    if how == "text":  # not JSON, or not UTF-8, or deeply nested
        return draw(st.sampled_from([b"\xff\xfe", b"[" * 100000, b"{\"kind\": ", b"1e999",
                                     b"NaN", b"\"x\"", payload[:len(payload) // 2]]))
    if how == "drop" and path:
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        value = {k: v for k, v in parent.items() if k != path[-1]} \
            if isinstance(parent, dict) else parent[:path[-1]] + parent[path[-1] + 1:]
        return json.dumps(replaced(doc, path[:-1], value)).encode()
    return json.dumps(replaced(doc, path, draw(JSON_VALUES))).encode()


INT_FIELDS = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from(
    [0, 1, -1, 2**31, 2**32 - 1, 2**62, -2**63, 511, 512, 513]))


@st.composite
def mutated_batch(draw, payload: bytes):
    """A batch payload with some of its records' fields set to any value,
    its length fields changed, or bytes cut from one of its three arrays."""
    n_ops, n_hdr, n_val = struct.unpack_from("<QQQ", payload)
    body = bytearray(payload)
    how = draw(st.sampled_from(["field", "field", "field", "lengths", "cut"]))
    if how == "lengths":
        lens = [draw(st.one_of(st.just(x), INT_FIELDS.map(lambda v: v % 2**64)))
                for x in (n_ops, n_hdr, n_val)]
        struct.pack_into("<QQQ", body, 0, *lens)
        return bytes(body)
    if how == "cut":
        which = draw(st.integers(0, 2))
        lens = [n_ops, n_hdr, n_val]
        cut = draw(st.integers(1, 64))
        start = 24 + sum(lens[:which])
        lens[which] = max(0, lens[which] - cut)
        del body[start + lens[which]:start + lens[which] + cut]
        struct.pack_into("<QQQ", body, 0, *lens)
        return bytes(body)
    for _ in range(draw(st.integers(1, 4))):
        # an aligned 8-, 4- or 2-byte field anywhere in the arrays
        width = draw(st.sampled_from([8, 4, 2]))
        if len(body) - 24 < width:
            break
        at = 24 + draw(st.integers(0, (len(body) - 24 - width) // width)) * width
        body[at:at + width] = (draw(INT_FIELDS) % 2**(8 * width)).to_bytes(width, "little")
    return bytes(body)


@st.composite
def reframed(draw, data):
    """A trace whose frames all pass their checksums but say nonsense: one
    frame's payload mutated, or frames dropped, repeated, reordered or of
    another kind."""
    frames = [(k, p) for _, k, p in frames_of(data)]
    how = draw(st.sampled_from(["payload", "payload", "payload", "drop", "repeat", "swap",
                                "kind"]))
    i = draw(st.integers(0, len(frames) - 1))
    kind, payload = frames[i]
    if how == "payload":
        if kind == tracefile.KIND_BATCH:
            frames[i] = (kind, draw(mutated_batch(payload)))
        else:
            frames[i] = (kind, draw(mutated_json(payload)))
    elif how == "drop":
        del frames[i]
    elif how == "repeat":
        frames.insert(i, frames[i])
    elif how == "swap":
        j = draw(st.integers(0, len(frames) - 1))
        frames[i], frames[j] = frames[j], frames[i]
    else:
        frames[i] = (draw(st.sampled_from([0, 1, 2, 3, 4, 2**32 - 1])), payload)
    return data[:16] + b"".join(frame(k, p) for k, p in frames)


@fuzz_settings(200)
@given(data=st.data(), seed=seed_names, command=commands)
def test_checksummed_nonsense(seeds, tmp_path_factory, data, seed, command):
    check(tmp_path_factory.mktemp("f") / "t.kvt", data.draw(reframed(seeds[seed])), command,
          seeds[seed])


# -- the CLI itself, as a user runs it ------------------------------------------------

def test_cli_subprocess_on_damaged_files(seeds, tmp_path):
    real = seeds["real"]
    frames = frames_of(real)
    batch_at = next(off for off, k, _ in frames if k == tracefile.KIND_BATCH)
    flipped = bytearray(real)
    flipped[batch_at + 40] ^= 0x10
    cases = {
        "cut.kvt": (real[:batch_at + 30], "truncated"),
        "flipped.kvt": (bytes(flipped), "checksum"),
        "noise.kvt": (bytes(range(256)) * 8, "not a kvtrace-bpf trace file"),
        "header-only.kvt": (real[:16], "empty trace file"),
        "bad-json.kvt": (real[:16] + frame(tracefile.KIND_META, b"{\"kind\": \"trace\""),
                         "bad frame"),
    }
    for name, (content, words) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        for cmd in (("report",), ("export", "--folded")):
            r = run_kvtrace(*cmd, path)
            assert r.returncode == EXIT_DATA, (name, cmd, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("kvtrace-bpf:"), (name, r.stderr)
            assert "Traceback" not in r.stderr and r.stdout == ""
            assert words in lines[0], (name, lines[0])
