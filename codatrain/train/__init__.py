"""Training: the run plan, the loop and the services it uses (docs/design.md §7 has the module map)."""
