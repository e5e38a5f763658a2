"""Llama-style weight init, defined on the canonical state so it is independent of block
implementation and of sharding: each canonical tensor is drawn from its own seeded generator."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from codatrain.model.config import LlamaConfig


def canonical_init_std(name: str, cfg: LlamaConfig) -> float | None:
    """Std of the normal init for a canonical weight, or None for norm weights (ones)."""
    if name.endswith("layernorm.weight") or name == "norm.weight":
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Residual-branch outputs shrink with depth (GPT-2 / Llama practice).
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def canonical_init_tensor(name: str, shape: torch.Size, cfg: LlamaConfig, seed: int) -> torch.Tensor:
    std = canonical_init_std(name, cfg)
    if std is None:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator, device="cpu").mul_(std)


def set_full_tensor(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter that may be an FSDP2-sharded DTensor."""
    if isinstance(param, DTensor):
        # Every rank holds the same full tensor, so each takes its shard locally (no scatter).
        full = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(full)


@torch.no_grad()
def init_canonical_weights(model: nn.Module, cfg: LlamaConfig, seed: int) -> None:
    names = model.canonical_names()  # type: ignore[attr-defined]
    for native_name, param in model.named_parameters():
        canonical = names[native_name]
        shape = param.shape  # DTensor.shape is the global shape
        full = canonical_init_tensor(canonical, shape, cfg, seed)
        set_full_tensor(param, model.from_canonical(native_name, full))  # type: ignore[attr-defined]
