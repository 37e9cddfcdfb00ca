"""Print one __global__ kernel of a CUDA source verbatim: from its template
line to the closing brace in column 0 (vLLM's clang-format style), so that
the kit compiles the fork's own kernel text (scripts/gpu-kit/build.sh).

    python3 extract_kernel.py csrc/cache_kernels.cu reshape_and_cache_flash_kernel
"""
import re
import sys


def extract(text: str, name: str) -> str:
    m = re.search(r"^template <[^\n]*>\n__global__ void " + re.escape(name) + r"\(",
                  text, re.M)
    if not m:
        raise SystemExit(f"extract_kernel: no kernel {name}")
    end = text.find("\n}\n", m.end())
    if end < 0:
        raise SystemExit(f"extract_kernel: {name} has no closing brace in column 0")
    return text[m.start():end + 3]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(extract(f.read(), sys.argv[2]))
