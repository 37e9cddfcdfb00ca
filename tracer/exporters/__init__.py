"""Outputs for other programs: Prometheus metrics, folded stacks, the report's
JSON and CSV (rank 5: imports the stages below, never views/)."""
