"""Model definitions: configs and presets, the eager Llama, the CODA Llama."""

from __future__ import annotations

import torch
from torch import nn

from codatrain.model.config import PRESETS, LlamaConfig, get_preset
from codatrain.model.llama import Llama

__all__ = ["PRESETS", "LlamaConfig", "Llama", "build_model", "get_preset"]


def build_model(
    cfg: LlamaConfig,
    impl: str,
    backend: str | None = "reference",
    attention: str | None = "sdpa",
    device: torch.device | None = None,
) -> nn.Module:
    """The model for block `impl` (eager | coda | liger); all of them share the canonical state.

    backend (reference | cute) and attention (sdpa | fa4) choose the CODA kernels, as
    `codatrain.kernels.resolve.resolve_block` resolved them (no ``auto`` here); eager and liger
    ignore them. With `device`, kernels that cannot run there (backend cute off Hopper, liger off
    CUDA or without liger-kernel, say) are an error now rather than at the first forward.
    """
    if impl == "eager":
        return Llama(cfg)
    if impl == "coda":
        from codatrain.model.coda import CodaLlama

        return CodaLlama(cfg, backend=backend, attention=attention, device=device)
    if impl == "liger":
        from codatrain.model.liger import LigerLlama

        return LigerLlama(cfg, device=device)
    raise ValueError(f"block.impl={impl!r} is not one of eager, coda, liger")
