"""The worker: one controller session at a time, its scheduler and its store."""
