"""Model definitions: configs and presets, the eager Llama, the CODA Llama."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from codatrain.model.config import PRESETS, LlamaConfig, get_preset
from codatrain.model.llama import Llama

if TYPE_CHECKING:
    from codatrain.config import BlockConfig

__all__ = ["PRESETS", "LlamaConfig", "Llama", "build_model", "get_preset"]


def build_model(cfg: LlamaConfig, block: BlockConfig, device: torch.device | None = None) -> nn.Module:
    """The model for `block.impl`. Both implementations share the canonical state.

    With `device`, kernels that cannot run there (block.backend=cute off Hopper, say) are an error
    now rather than at the first forward.
    """
    if block.impl == "eager":
        return Llama(cfg)
    if block.impl == "coda":
        from codatrain.kernels.stages import get_backend
        from codatrain.model.attention import get_attention
        from codatrain.model.coda import CodaLlama

        if device is not None:
            get_backend(block.backend, device)
            get_attention(block.attention, device)
        return CodaLlama(cfg, backend=block.backend, attention=block.attention)
    raise ValueError(f"block.impl={block.impl!r} is not one of eager, coda")
