"""Training: distributed setup, FSDP2, optimizer and schedule, metrics, checkpointing, logging."""
