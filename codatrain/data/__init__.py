"""Training and validation data: sources, tokenizers, packing, per-rank sharding, resumable state."""

from codatrain.data.loader import PackedLoader, build_loaders, prepare_streams, unigram_entropy
from codatrain.data.packing import Batch, cu_seqlens_from_doc_ids

__all__ = ["Batch", "PackedLoader", "build_loaders", "cu_seqlens_from_doc_ids", "prepare_streams",
           "unigram_entropy"]
