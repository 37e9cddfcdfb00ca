"""What the ops mean: counters, access patterns, occupancy, block lifecycle,
heatmaps and the report's core (rank 4: imports every stage below)."""
