"""Terminal views: the live view and the report's rich text (rank 5: imports
the stages below, never exporters/)."""
