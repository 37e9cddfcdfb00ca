"""Probe sites: USDT notes and stock vLLM functions in ELF files, the files a
process maps, the processes to follow (rank 1: imports only tracer/'s top)."""
