"""The probe ABI and the shared layouts, read from bpf/ (their one home).

Op names come from `enum kvtrace_op` in bpf/kvtrace.h; the probe names of
bpf/kvtrace_probes.h are the same names in lower case.  Struct layouts are not
repeated here: bcc compiles kvtrace.h and hands us matching ctypes.
"""

import re
from functools import lru_cache
from pathlib import Path

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"
SHARED_HEADER = BPF_DIR / "kvtrace.h"
PROBE_HEADER = BPF_DIR / "kvtrace_probes.h"
BPF_PROGRAM = BPF_DIR / "kvtrace.bpf.c"

PROVIDER = "vllm"


@lru_cache(maxsize=None)
def _enum(name: str) -> dict:
    text = SHARED_HEADER.read_text()
    m = re.search(r"enum\s+%s\s*\{(.*?)\};" % re.escape(name), text, re.S)
    if not m:
        raise RuntimeError(f"enum {name} missing from {SHARED_HEADER}")
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}


@lru_cache(maxsize=None)
def define(name: str) -> int:
    m = re.search(r"#define\s+%s\s+(\d+)" % re.escape(name), SHARED_HEADER.read_text())
    if not m:
        raise RuntimeError(f"#define {name} missing from {SHARED_HEADER}")
    return int(m.group(1))


def _strip(prefix: str, enum: dict) -> dict:
    return {k[len(prefix):].lower(): v for k, v in enum.items() if k.startswith(prefix)}


OPS = _strip("KVTRACE_OP_", _enum("kvtrace_op"))
OP_NAMES = {v: k for k, v in OPS.items()}
NR_OPS = _enum("kvtrace_op")["KVTRACE_NR_OPS"]
WRITE_OPS = frozenset(
    ("reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
     "cpu_attn_reshape_and_cache"))
MOVES = _strip("KVTRACE_MOVE_", _enum("kvtrace_move"))
STAGES = _strip("KVTRACE_STAGE_", _enum("kvtrace_stage"))  # program kvtrace_stage_<name>
CALLBACKS = _strip("KVTRACE_CB_", _enum("kvtrace_callback"))  # function kvtrace_cb_<name>
CALLBACK_MARK = define("KVTRACE_CB_MARK")  # the high half of a callback's marker
GLOBALS = _strip("KVTRACE_G_", _enum("kvtrace_global"))
ARG_KINDS = _strip("KVTRACE_ARG_", _enum("kvtrace_arg_kind"))
MAX_ARGS = define("KVTRACE_MAX_ARGS")
MAX_SITES = define("KVTRACE_MAX_SITES")  # rows of `sites`: probe addresses per tracer
CHUNK = define("KVTRACE_CHUNK")
RECORD_VALUES = CHUNK * define("KVTRACE_RECORD_CHUNKS")  # most values per stream record
DEFAULT_MAX_BLOCKS = define("KVTRACE_MAX_BLOCKS")
STACK_BUCKETS = define("KVTRACE_STACK_BUCKETS")  # the stack map's default size
STACK_COLLIDED = define("KVTRACE_STACK_COLLIDED")  # ids from here up: collided_stacks
COLLIDED_STACKS = define("KVTRACE_COLLIDED_STACKS")  # collided_stacks' room
DEFAULT_MAX_CACHES = define("KVTRACE_MAX_CACHES")
DEFAULT_MAX_PROCS = define("KVTRACE_MAX_PROCS")
CACHE_ENTRIES = define("KVTRACE_CACHE_ENTRIES")  # caches' capacity, cache_stats' rows
DEFAULT_MAX_GROUPS = define("KVTRACE_MAX_GROUPS")
TABLE_CHUNK = define("KVTRACE_TABLE_CHUNK")
FILL_BINS = define("KVTRACE_FILL_BINS")  # struct kvtrace_fill_row: ended[] bins
LOG2_SLOTS = define("KVTRACE_LOG2_SLOTS")  # op_log2: slots per op


def fill_row_bytes(max_blocks: int) -> int:
    """Bytes of one struct kvtrace_fill_row: ended[FILL_BINS], ended_unseen
    and skipped (u64), then fill[] and host[] (u16 per block)."""
    return 8 * (FILL_BINS + 2) + 4 * max_blocks
READ_OPS = frozenset(("block_table",))
LIFE = tuple(_strip("KVTRACE_LIFE_", _enum("kvtrace_life")))  # block_life rows, in order
LIFE_OPS = tuple(f"block_{kind}" for kind in LIFE)  # the ops that count them
REQUEST_OPS = ("request", "req_preempt", "req_finish")
STEP_OPS = ("step_reqs", "step_rows")  # whose the step's rows are; the rows as deltas
PREFIX_OPS = ("prefix_hashes",)  # a prompt's token hashes (miss causes)
PLUGIN_OPS = frozenset(LIFE_OPS + REQUEST_OPS + STEP_OPS + PREFIX_OPS)  # fired by the plugin (plugin/)
REQ_ID_LEN = define("KVTRACE_REQ_ID_LEN")
EV_TRUNCATED = define("KVTRACE_EV_TRUNCATED")
EV_READ_ERROR = define("KVTRACE_EV_READ_ERROR")

# an op number may be unnamed (kept for a probe that is not in this tree)
assert set(OPS) >= WRITE_OPS | PLUGIN_OPS and max(OPS.values()) < NR_OPS
assert [OPS[o] - OPS["block_alloc"] for o in LIFE_OPS] == list(range(len(LIFE)))

# -- the perf stream's records (struct kvtrace_event, struct kvtrace_chunk_hdr)

_CTYPES = {"__u8": "u1", "__s8": "i1", "__u16": "<u2", "__s16": "<i2", "__u32": "<u4",
           "__s32": "<i4", "__u64": "<u8", "__s64": "<i8"}


@lru_cache(maxsize=None)
def struct_dtype(name: str):
    """A numpy dtype for a struct of kvtrace.h made only of scalar fields,
    laid out as the C compiler does (natural alignment).  Used for records
    that user space decodes without bcc (trace files are read anywhere)."""
    import numpy as np

    text = re.sub(r"/\*.*?\*/", "", SHARED_HEADER.read_text(), flags=re.S)
    m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(name), text, re.S)
    if not m:
        raise RuntimeError(f"struct {name} missing from {SHARED_HEADER}")
    fields = []
    for decl in filter(None, (d.strip() for d in m.group(1).split(";"))):
        parts = decl.split()
        # `type name` only: an array (`__u16 pad[3]`) or a nested struct is not
        # a scalar field, and is refused rather than misread
        if len(parts) != 2 or parts[0] not in _CTYPES or not parts[1].isidentifier():
            raise RuntimeError(f"struct {name}: {decl!r} is not a scalar field")
        fields.append((parts[1], _CTYPES[parts[0]]))
    return np.dtype(fields, align=True)


RECORD_TYPES = _strip("KVTRACE_REC_", _enum("kvtrace_rec"))
EV_CHUNKS_LOST = define("KVTRACE_EV_CHUNKS_LOST")
EV_SWAP_OUT = define("KVTRACE_EV_SWAP_OUT")
EV_SWAP_IN = define("KVTRACE_EV_SWAP_IN")
EV_HASHES = define("KVTRACE_EV_HASHES")
