"""Llama-style weight init, defined on the canonical state so it is independent of block
implementation and of sharding: each canonical tensor is drawn from its own seeded generator.

`init_canonical_weights` fills a plain model; the trainer fills a wrapped or FSDP2-sharded one
with `codatrain.train.canonical_state.init_weights`, from the same `canonical_init_tensor`s."""

from __future__ import annotations

import math
import zlib

import torch

from codatrain.model.config import LlamaConfig
from codatrain.model.layout import Canonical, CanonicalModel


def canonical_init_std(name: str, cfg: LlamaConfig) -> float | None:
    """Std of the normal init for a canonical weight, or None for norm weights (ones) and biases
    (zeros)."""
    if name.endswith(("norm.weight", ".bias")):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Residual-branch outputs shrink with depth (GPT-2 / Llama practice).
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def canonical_init_tensor(name: str, shape: torch.Size, cfg: LlamaConfig, seed: int) -> torch.Tensor:
    std = canonical_init_std(name, cfg)
    if std is None:
        return torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator, device="cpu").mul_(std)


def native_init_tensor(canonical: Canonical, shape: torch.Size, cfg: LlamaConfig, seed: int) -> torch.Tensor:
    """The full initial value of a native parameter, drawn as its canonical tensor."""
    return canonical.to_native(canonical_init_tensor(canonical.name, shape, cfg, seed))


@torch.no_grad()
def init_canonical_weights(model: CanonicalModel, seed: int) -> None:
    """Fill every parameter of `model` (unwrapped, unsharded; it has `cfg` and `layout()`)."""
    layout = model.layout()
    for name, param in model.named_parameters():
        param.copy_(native_init_tensor(layout[name], param.shape, model.cfg, seed))
