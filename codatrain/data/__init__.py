"""Training and validation data: sources, tokenizers, packing, per-rank sharding, resumable state."""

from codatrain.data.loader import PackedLoader, build_loaders, prepare_streams, unigram_entropy
from codatrain.data.packing import Batch

__all__ = ["Batch", "PackedLoader", "build_loaders", "prepare_streams", "unigram_entropy"]
