"""Training and validation data: sources, tokenizers, packing, per-rank sharding, resumable state."""

from codatrain.data.loader import TokenBatches, build_loaders

__all__ = ["TokenBatches", "build_loaders"]
