"""The recorded trace: the per-op stream's wire format decoded, and the trace
file written and read (rank 3: imports the top, probes/ and kernel/)."""
