"""FP8 all-gather of the CODA layer weights under FSDP2 (`parallel.fp8_all_gather`; docs/design.md
§3, "FP8 layer GEMMs").

With block.precision=fp8 the layer GEMMs read their weights in e4m3 anyway. Gathered in the
compute dtype, each weight would be quantized after the all-gather; instead each rank quantizes its
shard before it, and the all-gather moves one byte per value instead of two (bf16) or four (fp32).
This goes through FSDP2's extension point for tensor subclasses: the local shard of each layer
GEMM weight is an `Fp8GatherShard`, whose `fsdp_pre_all_gather` hands FSDP2 the shard's FP8 bytes
and whose `fsdp_post_all_gather` makes the gathered bytes a `kernels.fp8.Fp8Weight`, the parameter
the model's Functions see.

The values are bitwise those of the unsharded path, which quantizes the gathered compute-dtype
weight with its own current amax (`Fp8Recipe.weight`):
- each shard is rounded to the compute dtype first, then quantized, as the gathered weight would be;
- the per-tensor scale is the whole weight's: `refresh_scales` maxes the shards' amaxes (of the
  compute-dtype values) over the ranks in one all-reduce for all weights, once per optimizer step
  (the weights change only there) and before each evaluation, never per micro-batch.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from codatrain.kernels.fp8 import E4M3, Fp8Weight, QuantizeTo, fp8_max, quantize, scale_from_amax
from codatrain.train.distributed import all_reduce_max_

# The ops by which FSDP2 makes and re-pads the local shard (chunk, pad, copy, view) and by which
# modules are materialised (`to_empty`), moved and loaded: their results are the shard too. Every
# other op (the optimizer's arithmetic, state dicts' copies) computes on the fp32 master values
# and returns plain tensors.
_KEEPS_SHARD = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class Fp8GatherShard(torch.Tensor):
    """A rank's shard of a layer GEMM weight: the fp32 master values (`master`), all-gathered in
    e4m3 with the weight's per-tensor `scale` (`refresh_scales`) after rounding to `compute_dtype`
    (FSDP2's param_dtype), so the gathered bytes are the unsharded path's."""

    master: torch.Tensor
    compute_dtype: torch.dtype
    margin: int
    scale: torch.Tensor | None

    @staticmethod
    def __new__(cls, master: torch.Tensor, compute_dtype: torch.dtype, margin: int) -> Fp8GatherShard:
        return torch.Tensor._make_wrapper_subclass(
            cls, master.size(), strides=master.stride(), storage_offset=master.storage_offset(),
            dtype=master.dtype, device=master.device, requires_grad=master.requires_grad)

    def __init__(self, master: torch.Tensor, compute_dtype: torch.dtype, margin: int) -> None:
        self.master, self.compute_dtype, self.margin = master, compute_dtype, margin
        self.scale = None

    def __repr__(self) -> str:
        return f"Fp8GatherShard({self.master!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        shard = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8GatherShard))
        args, kwargs = pytree.tree_map_only(Fp8GatherShard, lambda t: t.master, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEPS_SHARD:
            return out
        return pytree.tree_map_only(
            torch.Tensor, lambda t: Fp8GatherShard(t, shard.compute_dtype, shard.margin), out)

    def local_amax(self) -> torch.Tensor:
        """0-d fp32: max |x| of this shard in the compute dtype (NaN when one is NaN)."""
        return self.master.to(self.compute_dtype).abs().amax().float()

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride, module: nn.Module,
                            mp_policy) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        if self.scale is None:
            raise RuntimeError("an FP8 all-gather before its weight scales: call "
                               "codatrain.train.fp8_allgather.refresh_scales(model) after each optimizer "
                               "step and before evaluating (parallel.fp8_all_gather)")
        # Rounded to the compute dtype, then quantized: the unsharded path quantizes the weight as
        # FSDP2 gathered it, in the compute dtype.
        data = quantize(self.master.to(self.compute_dtype), QuantizeTo(E4M3, self.scale)).data
        # FSDP2 pads a weight whose rows do not divide over the ranks: every rank sends as many rows
        # as the first (the padding is dropped after the gather).
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (self.scale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: tuple,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[Fp8Weight, tuple[torch.Tensor, ...]] | None:
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:
            # FSDP2 gathered into the same buffer again (`out` views it): only the scale is new.
            out.fp8_scale = scale
            return None
        return Fp8Weight(data, scale, param_dtype), (data,)


def wrap_fp8_weights(model: nn.Module, compute_dtype: torch.dtype, margin: int) -> None:
    """Make each FP8 layer GEMM weight of `model` (`model.fp8_weight_names()`) an `Fp8GatherShard`.
    Before activation checkpointing and compile wrap the blocks (the names are the model's own) and
    before `fully_shard`, which keeps the subclass as each rank's local shard."""
    for name in model.fp8_weight_names():
        owner, _, attr = name.rpartition(".")
        param = model.get_parameter(name)
        shard = Fp8GatherShard(param.detach(), compute_dtype, margin)
        setattr(model.get_submodule(owner), attr, nn.Parameter(shard, requires_grad=param.requires_grad))


def gather_shards(model: nn.Module) -> list[Fp8GatherShard]:
    """The local `Fp8GatherShard`s of `model`'s FSDP2 parameters (read each time: FSDP2 may replace
    a parameter's local tensor, e.g. re-padding it after a checkpoint load)."""
    return [p._local_tensor for p in model.parameters()
            if isinstance(p, DTensor) and isinstance(p._local_tensor, Fp8GatherShard)]


@torch.no_grad()
def refresh_scales(model: nn.Module) -> None:
    """Set every FP8-gathered weight's scale from its current amax over all ranks (one all-reduce):
    the scale `Fp8Recipe.weight` gives the whole weight. Call after each optimizer step (before the
    next step's first forward) and before evaluating; every rank must call it."""
    shards = gather_shards(model)
    if not shards:
        return
    amaxes = torch.stack([shard.local_amax() for shard in shards])
    all_reduce_max_(amaxes)
    scales = scale_from_amax(amaxes, fp8_max(E4M3), shards[0].margin)
    for shard, scale in zip(shards, scales, strict=True):
        shard.scale = scale


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` without the gather subclass: a DTensor over the fp32 master shard (the same memory),
    as checkpoints, exports and loads read and write the weights; other tensors as they are."""
    if isinstance(tensor, DTensor) and isinstance(tensor._local_tensor, Fp8GatherShard):
        return DTensor.from_local(tensor._local_tensor.master, tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())
    return tensor
