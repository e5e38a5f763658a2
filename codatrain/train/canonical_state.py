"""A model's and its optimizer's state under canonical names and layouts (docs/design.md §3).

`CanonicalMapping` is the one application of the model's layout table (`model.layout()`) to its
possibly wrapped and FSDP2-sharded parameters, and to optimizer state of the same shapes:
checkpoints (checkpoint.py) and HF export (hf_io.py) read tensors through it, and weight init
(`init_weights`) and HF import (hf_io.py) write them through `CanonicalMapping.assign`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from codatrain.model.init import canonical_init_tensor
from codatrain.model.layout import CanonicalModel, permute_rows
from codatrain.train.fp8_allgather import plain

# Wrappers that activation checkpointing and torch.compile put into parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def strip_wrapper_prefixes(fqn: str) -> str:
    """The model's own name of a wrapped parameter (the name its `layout()` uses)."""
    for prefix in WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def set_full_tensor(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter that may be an FSDP2-sharded DTensor."""
    if isinstance(param, DTensor):
        # Every rank holds the same full tensor, so each takes its shard locally (no scatter).
        full = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(full)


def _permute_rows(tensor: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    if order is not None and isinstance(tensor, DTensor):
        # Rows move across shards: gather, permute, and let each rank take its shard back.
        full = permute_rows(tensor.full_tensor(), order)
        return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
    return permute_rows(tensor, order)


class CanonicalMapping:
    """A model's layout table (`model.layout()`, codatrain/model/layout.py) applied to its possibly
    wrapped and sharded parameters, and to optimizer state of their shapes.

    Names are used without wrapper prefixes, as DCP's state-dict helpers report them.
    """

    def __init__(self, model: CanonicalModel) -> None:
        layout = model.layout()
        self.canonical = {native: entry.name for native, entry in layout.items()}
        self._to = {native: entry.inverse_order() for native, entry in layout.items()}
        self._from = {native: entry.row_order for native, entry in layout.items()}
        # The global shapes, also for sharded DTensors.
        self.shapes = {strip_wrapper_prefixes(name): p.shape for name, p in model.named_parameters()}

    def is_identity(self, native: str) -> bool:
        return self._from[native] is None

    def to_canonical(self, native: str, tensor: torch.Tensor) -> torch.Tensor:
        return _permute_rows(tensor, self._to[native])

    def from_canonical(self, native: str, tensor: torch.Tensor) -> torch.Tensor:
        return _permute_rows(tensor, self._from[native])

    @torch.no_grad()
    def assign(self, model: nn.Module, canonical_tensor: Callable[[str, torch.Size], torch.Tensor]) -> None:
        """Set every parameter of `model` (this mapping's model, possibly wrapped and sharded) from
        its full canonical tensor, `canonical_tensor(canonical name, global shape)`."""
        for name, param in model.named_parameters():
            native = strip_wrapper_prefixes(name)
            full = canonical_tensor(self.canonical[native], self.shapes[native])
            set_full_tensor(param, permute_rows(full, self._from[native]))


def init_weights(model: CanonicalModel, seed: int) -> None:
    """`model.init_weights(seed)` for a model that may be wrapped and sharded: the same weights,
    each drawn as its canonical tensor."""
    CanonicalMapping(model).assign(
        model, lambda name, shape: canonical_init_tensor(name, shape, model.cfg, seed))


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """DCP's model state dict (`get_model_state_dict`) with every parameter a plain tensor: the
    FP8-gathered layer weights (`parallel.fp8_all_gather`) as DTensors over their fp32 master
    shards, in the same memory, so checkpoints, exports and loads see what they see without it."""
    return {name: plain(tensor) for name, tensor in get_model_state_dict(model).items()}


# (checkpoint key, dict holding the tensor, its key there, native parameter, whether the tensor has
# the parameter's shape and so its layout)
Entry = tuple[str, dict[str, Any], str, str, bool]


def state_entries(model_state: dict[str, Any], optim_state: dict[str, Any],
                  mapping: CanonicalMapping) -> list[Entry]:
    """Every tensor of a model and optimizer state dict (from DCP's helpers) and its checkpoint key."""
    entries = [
        (f"model.{mapping.canonical[native]}", model_state, native, native, True)
        for native in model_state
        if native in mapping.canonical  # buffers are recomputed from the config, not state
    ]
    for native, state in optim_state["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {native}.{key} is a {type(value).__name__}, not a tensor")
            fqn = f"optim.{mapping.canonical[native]}.{key}"
            entries.append((fqn, state, key, native, value.shape == mapping.shapes[native]))
    return entries


def canonical_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    mapping: CanonicalMapping) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The model and optimizer tensors as a flat canonical dict for DCP (sharded tensors stay
    sharded), and the optimizer's param-group hyperparameters."""
    optim_state = get_optimizer_state_dict(model, optimizer)
    entries = state_entries(model_state_dict(model), optim_state, mapping)
    tensors = {
        fqn: mapping.to_canonical(native, container[key]) if shaped else container[key]
        for fqn, container, key, native, shaped in entries
    }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optim_state["param_groups"]]
    return tensors, groups


def full_canonical_tensors(model: nn.Module, mapping: CanonicalMapping) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as a full canonical tensor, one at a time. With FSDP2 each is gathered, so
    every rank must consume the iterator in step."""
    for native, tensor in model_state_dict(model).items():
        if native in mapping.canonical:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield mapping.canonical[native], mapping.to_canonical(native, full)
