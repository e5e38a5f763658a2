"""The CODA stage API and its backends, attention, and the kernel cache (docs/design.md §7 has the
module map)."""
