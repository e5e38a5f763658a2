"""Training and validation data (docs/design.md §7 has the module map); `build_loaders` is the entry."""

from codatrain.data.loader import PackedLoader, build_loaders, prepare_streams
from codatrain.data.packing import Batch

__all__ = ["Batch", "PackedLoader", "build_loaders", "prepare_streams"]
