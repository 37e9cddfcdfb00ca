"""The kernel side: the BPF program compiled, loaded and attached, its maps
and perf buffers read (rank 2: imports the top and probes/)."""
