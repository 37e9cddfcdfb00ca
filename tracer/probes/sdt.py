"""USDT probes in ELF files: the .note.stapsdt notes read with pyelftools, their
argument specs decoded for the BPF program, and file offsets of addresses.

The lowest module of probes/: catalog.py (stock vLLM's functions) and
discover.py (a process's files) build on its types.
"""

import re
import struct
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from .. import abi
from ..errors import TargetError
from ..files import IsNotRegular, open_regular

# Byte offsets of the registers in the kernel's struct pt_regs (x86_64),
# keyed by every name an SDT argument may use for them.
_X86_PT_REGS = {
    "r15": 0, "r14": 8, "r13": 16, "r12": 24, "bp": 32, "bx": 40, "r11": 48,
    "r10": 56, "r9": 64, "r8": 72, "ax": 80, "cx": 88, "dx": 96, "si": 104,
    "di": 112, "ip": 128, "sp": 152,
}


def _x86_reg_offset(name: str) -> int:
    """pt_regs offset for any x86_64 register spelling (rax, eax, ax, al, r8d...)."""
    m = re.fullmatch(r"r(\d+)[dwb]?", name)
    if m and 8 <= int(m.group(1)) <= 15:
        return _X86_PT_REGS["r" + m.group(1)]
    for full in ("ax", "bx", "cx", "dx"):
        # not %ah..%dh: bits 8-15 cannot be expressed as a trim of the register
        if name in ("r" + full, "e" + full, full, full[0] + "l"):
            return _X86_PT_REGS[full]
    for full in ("si", "di", "bp", "sp", "ip"):
        if name in ("r" + full, "e" + full, full, full + "l"):
            return _X86_PT_REGS[full]
    raise ValueError(f"unknown register %{name}")


@dataclass(frozen=True)
class ArgSpec:
    """One argument's location, in the BPF program's terms (kvtrace_arg_spec)."""

    kind: int  # abi.ARG_KINDS value
    reg_off: int
    val_off: int
    size: int  # bytes
    is_signed: bool

    @property
    def bitshift(self) -> int:
        return 64 - 8 * self.size


def parse_sdt_arg(text: str) -> ArgSpec:
    """Parse one x86_64 SDT argument such as '-8@%rax', '8@-24(%rbp)', '4@$5'."""
    m = re.fullmatch(r"(-?)(1|2|4|8)@(.+)", text)
    if not m:
        raise ValueError(f"unsupported SDT argument {text!r}")
    signed, size, loc = m.group(1) == "-", int(m.group(2)), m.group(3)
    if loc.startswith("$"):
        return ArgSpec(abi.ARG_KINDS["const"], 0, int(loc[1:], 0) & (2**64 - 1), size, signed)
    m = re.fullmatch(r"%(\w+)", loc)
    if m:
        return ArgSpec(abi.ARG_KINDS["reg"], _x86_reg_offset(m.group(1)), 0, size, signed)
    m = re.fullmatch(r"(-?(?:0x)?[0-9a-fA-F]*)\(%(\w+)\)", loc)
    if m and m.group(2) != "rip":
        disp = int(m.group(1), 0) if m.group(1) not in ("", "-") else 0
        return ArgSpec(abi.ARG_KINDS["reg_deref"], _x86_reg_offset(m.group(2)),
                       disp & (2**64 - 1), size, signed)
    raise ValueError(f"unsupported SDT argument {text!r}")


@dataclass
class Probe:
    path: str
    provider: str
    name: str
    vaddr: int  # link-time address of the probe instruction
    offset: int  # its file offset: what a uprobe is placed on
    sem_vaddr: int  # 0 when the probe has no semaphore
    sem_offset: int  # file offset of the semaphore (uprobe ref_ctr_offset)
    args: str  # the raw argument spec, e.g. '8@%rax -8@$4'
    arg_specs: list = field(default_factory=list)
    arg_error: str = ""  # why arg_specs could not be decoded, if so
    symbol: str = ""  # stock uprobes: the function's (mangled) name
    recipe: tuple = ()  # stock uprobes: catalog recipe (tensor arguments)
    skip: int = 0  # stock uprobes: bytes from the function's entry to the site

    @property
    def stock(self) -> bool:
        """A uprobe on a stock vLLM function (catalog.py), not a USDT probe."""
        return bool(self.symbol)

    @property
    def qualified(self) -> str:
        return f"{self.provider}:{self.name}"


def vaddr_to_offset(elf: ELFFile, vaddr: int) -> int:
    for seg in elf.iter_segments():
        if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
            return vaddr - seg["p_vaddr"] + seg["p_offset"]
    raise ValueError(f"address {vaddr:#x} is in no loadable segment")


def read_probes(path: str, provider: str = abi.PROVIDER) -> list:
    """All USDT probes of `provider` in the ELF file at `path` (empty if none)."""
    try:
        # a regular file only: opening a named pipe nobody writes to would
        # wait forever (files.open_regular)
        with open_regular(path) as f:
            elf = ELFFile(f)
            notes = elf.get_section_by_name(".note.stapsdt")
            if notes is None:
                return []
            base_sec = elf.get_section_by_name(".stapsdt.base")
            addr_fmt = "<3Q" if elf.elfclass == 64 else "<3I"
            addr_size = struct.calcsize(addr_fmt)
            probes = []
            for note in notes.iter_notes():
                # pyelftools names type 3 after the GNU note of that number
                if note["n_name"] != "stapsdt" or note["n_type"] not in (
                        3, "NT_GNU_BUILD_ID", "NT_STAPSDT"):
                    continue
                desc = note["n_descdata"]
                pc, base, sem = struct.unpack_from(addr_fmt, desc)
                prov, name, args = desc[addr_size:].split(b"\0")[:3]
                if prov.decode() != provider:
                    continue
                if base_sec is not None and base:
                    # prelink may have moved the file; the note records the
                    # link-time .stapsdt.base so that the pc can be adjusted
                    pc += base_sec["sh_addr"] - base
                probe = Probe(path, prov.decode(), name.decode(), pc,
                              vaddr_to_offset(elf, pc), sem,
                              vaddr_to_offset(elf, sem) if sem else 0,
                              args.decode())
                try:
                    probe.arg_specs = [parse_sdt_arg(a) for a in probe.args.split()]
                except ValueError as e:
                    probe.arg_error = str(e)
                probes.append(probe)
            return probes
    except (ELFError, struct.error) as e:
        raise TargetError(f"{path}: not a readable ELF file ({e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TargetError(f"{path}: malformed .note.stapsdt ({e})") from None
    except IsNotRegular as e:
        what = "is a directory" if str(e) == "a directory" else f"{e}"
        raise TargetError(f"{path}: {what}, not an ELF file") from None
    except PermissionError:
        raise TargetError(f"{path}: permission denied") from None
    except FileNotFoundError:
        raise TargetError(f"{path}: no such file") from None


def entry_offset(path: str):
    """File offset of an ELF executable's entry point, None if not ELF."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            return vaddr_to_offset(elf, elf.header["e_entry"])
    except (ELFError, ValueError, struct.error):
        return None
