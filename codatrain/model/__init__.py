"""Model definitions (docs/design.md §7 has the module map); `build_model` makes a block's model."""

from __future__ import annotations

import torch
from torch import nn

from codatrain.kernels.fp8 import Fp8Recipe
from codatrain.kernels.resolve import ResolvedBlock
from codatrain.model.config import LlamaConfig, get_preset
from codatrain.model.llama import Llama

__all__ = ["LlamaConfig", "Llama", "build_model", "get_preset"]


def build_model(cfg: LlamaConfig, block: ResolvedBlock, device: torch.device | None = None,
                fp8: Fp8Recipe | None = None) -> nn.Module:
    """The model for `block` (eager | coda | liger, as `codatrain.kernels.resolve.resolve_block`
    resolved it); all of them share the canonical state. `fp8`: the CODA layer GEMMs' FP8 recipe.

    CODA takes the block's stage backend and attention function, which `resolve_block` loaded and
    checked against the device. With `device`, liger is checked to run there (CUDA and
    liger-kernel) now rather than at the first forward.
    """
    if fp8 is not None and block.impl != "coda":
        raise ValueError(f"an FP8 recipe is for block=coda, not block={block.impl}")
    if block.impl == "eager":
        return Llama(cfg)
    if block.impl == "coda":
        from codatrain.model.coda import CodaLlama

        return CodaLlama(cfg, block, fp8=fp8)
    if block.impl == "liger":
        from codatrain.model.liger import LigerLlama

        return LigerLlama(cfg, device=device)
    raise ValueError(f"block.impl={block.impl!r} is not one of eager, coda, liger")
