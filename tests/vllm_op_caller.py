"""A process that is not the traced vLLM but calls the same op in the same
library: vLLM's own cpu_attn_reshape_and_cache from its _C extension, on a
KV cache of its own.  The uprobe sits on that library's file, so the kernel
sees this process hit the same probe address.  The isolation test checks
that the tracer counts none of it.

Run with the vLLM venv's python.  Prints "READY <library path>" once the
extension is loaded, waits for a line on stdin, makes --calls calls of
--tokens tokens each, and prints "DONE <slots written>".
"""
import argparse
import sys

import torch

from vllm import _custom_ops as ops

BLOCK_SIZE, HEADS, HEAD_SIZE, NUM_BLOCKS = 32, 2, 64, 64


def loaded_extension() -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/vllm/_C" in path and path.endswith(".abi3.so") and "x" in line.split()[1]:
                return path
    raise SystemExit("vLLM's _C extension is not mapped")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()

    # the layout vLLM's CPU backend gives the op: one tensor per layer, key
    # and value halves of the third dimension
    kv = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE * 2, HEAD_SIZE)
    key_cache, value_cache = kv.chunk(2, dim=2)
    key = torch.randn(args.tokens, HEADS, HEAD_SIZE)
    value = torch.randn(args.tokens, HEADS, HEAD_SIZE)
    print(f"READY {loaded_extension()}", flush=True)
    sys.stdin.readline()
    slots = 0
    for call in range(args.calls):
        first = (call * args.tokens) % (NUM_BLOCKS * BLOCK_SIZE - args.tokens)
        slot_mapping = torch.arange(first, first + args.tokens, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "vec")
        slots += args.tokens
    # the op really wrote (its ISA's own layout inside the block: only the
    # amount is checked), at least one call's keys and values
    assert int((kv != 0).sum()) >= 2 * key.numel(), "the op wrote nothing"
    print(f"DONE {slots}", flush=True)


if __name__ == "__main__":
    main()
