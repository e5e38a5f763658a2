"""Canonical layouts: how a model's own parameters map onto the canonical state.

The canonical state is the eager Llama's (codatrain/model/llama.py): HF Llama names and layouts
with QKV and gate/up fused row-wise. Checkpoints, HF import/export and weight init work on it, so
every block implementation trains, saves and loads the same weights.

A model describes its mapping in one table, `model.layout()`: native parameter name (as the model
names it, without the prefixes that wrappers such as activation checkpointing insert) → its
`Canonical` tensor. Every entry is one native tensor ↔ one canonical tensor of the same shape, a
rename plus an optional row permutation, so it applies equally to a parameter and to optimizer
state of the parameter's shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from codatrain.model.config import LlamaConfig


class Canonical(NamedTuple):
    """Where a native parameter lives in the canonical state."""

    name: str
    # Native row r holds canonical row row_order[r] (a permutation, on the CPU); None: same rows.
    row_order: torch.Tensor | None = None

    def to_native(self, canonical: torch.Tensor) -> torch.Tensor:
        """The native tensor from the full canonical one."""
        return permute_rows(canonical, self.row_order)

    def to_canonical(self, native: torch.Tensor) -> torch.Tensor:
        """The full canonical tensor from the full native one."""
        return permute_rows(native, self.inverse_order())

    def inverse_order(self) -> torch.Tensor | None:
        """Canonical row c is native row inverse_order()[c]."""
        return None if self.row_order is None else torch.argsort(self.row_order)


Layout = dict[str, Canonical]


@runtime_checkable
class CanonicalModel(Protocol):
    """What the train layer asks of a model (`Llama`, `CodaLlama`, `LigerLlama`) beyond being an
    nn.Module: its config, the modules FSDP2 shards one at a time, its layout table and its init."""

    cfg: LlamaConfig

    def blocks(self) -> list[nn.Module]: ...

    def layout(self) -> Layout: ...

    def init_weights(self, seed: int) -> None: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]: ...


def permute_rows(tensor: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Row r of the result is row order[r] of `tensor` (the tensor itself for None)."""
    return tensor if order is None else tensor[order.to(tensor.device)]


def canonical_names(cfg: LlamaConfig) -> list[str]:
    """The tensors of the canonical state, in the eager model's parameter order. A tied head has no
    tensor of its own: it is embed_tokens.weight. The QKV bias is fused as the weight is, [q; k; v];
    q_norm and k_norm are the QK-norms' (head_dim,) weights, shared by every head."""
    attention = ["self_attn.qkv_proj.weight", *(["self_attn.qkv_proj.bias"] if cfg.qkv_bias else []),
                 *(["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if cfg.qk_norm else []),
                 "self_attn.o_proj.weight"]
    layer = ["input_layernorm.weight", *attention, "post_attention_layernorm.weight",
             "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    layers = [f"layers.{i}.{name}" for i in range(cfg.n_layers) for name in layer]
    head = [] if cfg.tie_embeddings else ["lm_head.weight"]
    return ["embed_tokens.weight", *layers, "norm.weight", *head]
