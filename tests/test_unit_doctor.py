"""doctor's words for what it found (no BPF, no processes)."""

from tracer.cmd_doctor import describe_probes
from tracer.discover import Probe


def probe(name, path):
    return Probe(path, "vllm", name, 0x10, 0x10, 0, 0, "")


def test_describe_probes_names_the_ops():
    files = {"/x/libkvsim_ops.so": [probe("swap_blocks", "/x/libkvsim_ops.so"),
                                    probe("reshape_and_cache", "/x/libkvsim_ops.so"),
                                    probe("reshape_and_cache", "/x/libkvsim_ops.so")],
             "/x/other.so": [probe("copy_blocks", "/x/other.so")]}
    assert describe_probes(files, stock=False) == (
        "3 vllm:* probe(s) in /x/libkvsim_ops.so (reshape_and_cache, swap_blocks), "
        "1 vllm:* probe(s) in /x/other.so (copy_blocks)")
    stock = {"/v/_C.abi3.so": [probe("cpu_attn_reshape_and_cache", "/v/_C.abi3.so"),
                               probe("concat_and_cache_mla", "/v/_C.abi3.so")]}
    assert describe_probes(stock, stock=True) == (
        "2 stock cache op(s) in /v/_C.abi3.so (concat_and_cache_mla, "
        "cpu_attn_reshape_and_cache)")
