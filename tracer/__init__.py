"""kvtrace-bpf: an eBPF tracer for vLLM's paged KV cache."""

__version__ = "0.1.0"
