"""Apply activation checkpointing, torch.compile and FSDP2 to a model from the outside.

The model only has to expose `blocks()`: the modules sharded (and compiled, and checkpointed) one
at a time. Order follows torchtitan: checkpointing, then compile, then FSDP2. Weights go into the
wrapped, sharded parameters through `codatrain.train.canonical_state`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from codatrain.model.layout import CanonicalModel
from codatrain.train.plan import DataParallelMesh


def _replace_block(model: nn.Module, block: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is block:
                setattr(parent, name, new)
                return
    raise ValueError("block is not a submodule of the model")


def apply_activation_checkpointing(model: CanonicalModel) -> None:
    """Recompute every block but the last in backward. The last block's backward runs right after
    its forward, while every other block's checkpoint is alive, so recomputing it would not lower
    the peak; it would repeat its work (for the CODA model, the LM head's three GEMMs)."""
    for block in model.blocks()[:-1]:
        _replace_block(model, block, checkpoint_wrapper(block))


def apply_compile(model: CanonicalModel) -> None:
    for block in model.blocks():
        block.compile(fullgraph=False)


def device_mesh(device: torch.device, mesh: DataParallelMesh) -> DeviceMesh:
    """The processes as FSDP2's mesh: 1-D over every process for full sharding, else 2-D
    (dp_replicate, dp_shard), on which `fully_shard` shards along dp_shard and replicates along
    dp_replicate (HSDP: reduce-scatter within a replica group, then all-reduce across groups)."""
    if mesh.replicate == 1:
        return init_device_mesh(device.type, (mesh.shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device.type, (mesh.replicate, mesh.shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This process's place among the data-parallel processes: replica · dp_shard + shard. The
    loaders split the batches by it."""
    if mesh.ndim == 1:
        return mesh.get_local_rank()
    return mesh.get_local_rank("dp_replicate") * mesh.size(1) + mesh.get_local_rank("dp_shard")


def apply_fsdp(model: CanonicalModel, mesh: DeviceMesh, compute_dtype: torch.dtype) -> None:
    """fully_shard each block, then the root (embedding, final norm, head and the rest), over
    `mesh` (`device_mesh`: 1-D shards, 2-D shards and replicates).

    Applied at every world size, one process too (its all-gather is a copy there): the policy is
    where the compute dtype takes effect. Below fp32 (bf16 on a GPU) each forward and backward
    computes in `compute_dtype` on parameters FSDP2 casts, with fp32 master weights and fp32
    gradient reduction, so the models hold no casts and run without autocast.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    blocks = model.blocks()
    # Unsharded by one process (one process, or pure replication), a block's parameters would be
    # gathered again for backward by a copy of the whole block: keep the forward's copy instead.
    sharded = mesh.size(mesh.ndim - 1) > 1
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by backward: keep them unsharded.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=sharded and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def reshard_after_eval(model: nn.Module) -> None:
    """Reshard what a forward without backward left unsharded.

    FSDP2 keeps the root's parameters (and the last block's, see `apply_fsdp`) unsharded after
    forward because backward needs them at once; a `no_grad` evaluation has no backward to reshard
    them, and a checkpoint saved next would see plain tensors among the DTensors.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
