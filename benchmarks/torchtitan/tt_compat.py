"""Shims that let torchtitan 0.3.0 import and run under torch 2.11 (it is written against a newer
torch). Each one prints a line when applied, so a log shows exactly what was patched.

- torch.distributed.fsdp.DataParallelMeshDims: imported at module level by torchtitan/distributed/
  fsdp.py:15 and full_dtensor.py:23, absent in torch 2.11 (and its fully_shard has no dp_mesh_dims
  argument). torchtitan passes dp_mesh_dims to fully_shard only when it is not None
  (fsdp.py:171), and resolve_fsdp_mesh returns None for a size-1 mesh under spmd_types
  (full_dtensor.py:85-90) and is not used under partial_dtensor, so on one GPU the stand-in is
  only a name. If it were ever constructed, fully_shard would reject the argument loudly.
- torch.distributed.set_timeout: called by torchtitan/distributed/utils.py:595 (set_pg_timeouts,
  from Trainer.train after step 1); absent in torch 2.11. Mapped to c10d._set_pg_timeout, the same
  operation under its private name there.
- torch.compiler._is_non_strict_tracing: MoE token dispatcher only (not on the llama3 path).
- create_block_mask(separate_full_blocks=...): torchtitan/models/common/decoder.py:274 passes it
  (True unless batch-invariant mode); torch 2.11's create_block_mask has no such argument and
  always keeps full blocks separate, i.e. behaves as True. patch_torchtitan() swaps torchtitan's
  module-level torch.compile(create_block_mask) (models/common/attention.py:621) for a compiled
  wrapper that drops the argument when True and refuses False.
- torch.utils.tensorboard: torchtitan/components/metrics.py:15 imports SummaryWriter
  unconditionally; stubbed only if the real import fails (tensorboard logging stays off).
"""
import dataclasses
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.fsdp as _fsdp

_applied = []

if not hasattr(_fsdp, "DataParallelMeshDims"):
    @dataclasses.dataclass(frozen=True)
    class DataParallelMeshDims:  # noqa: D401
        shard: object = None
        replicate: object = None

        def __post_init__(self):
            raise RuntimeError("tt_compat: DataParallelMeshDims is not supported by torch "
                               f"{torch.__version__} (needs a multi-axis FSDP mesh); this run cannot use it")

    _fsdp.DataParallelMeshDims = DataParallelMeshDims
    _applied.append("torch.distributed.fsdp.DataParallelMeshDims (name only; constructing it raises)")

if not hasattr(dist, "set_timeout"):
    import torch.distributed.distributed_c10d as _c10d

    def set_timeout(timeout, group=None):
        _c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout
    _applied.append("torch.distributed.set_timeout -> distributed_c10d._set_pg_timeout")

if not hasattr(torch.compiler, "_is_non_strict_tracing"):
    torch.compiler._is_non_strict_tracing = lambda: False
    _applied.append("torch.compiler._is_non_strict_tracing -> False (MoE only)")

try:
    import torch.utils.tensorboard  # noqa: F401
except Exception as e:  # tensorboard missing or broken: torchtitan needs only the name
    _tb = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, *a, **k):
            raise RuntimeError("tt_compat: tensorboard is stubbed out; keep metrics.enable_tensorboard off")

    _tb.SummaryWriter = SummaryWriter
    sys.modules["torch.utils.tensorboard"] = _tb
    torch.utils.tensorboard = _tb
    _applied.append(f"torch.utils.tensorboard stub ({type(e).__name__}: {e})")


def _report():
    for a in _applied:
        print(f"[tt_compat] torch {torch.__version__}: shimmed {a}", flush=True)
    _applied.clear()


_report()


def patch_torchtitan() -> None:
    """Shims on torchtitan's own modules; call after importing torchtitan."""
    import inspect

    import torchtitan.models.common.attention as tt_attention
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        def create_block_mask_compat(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise RuntimeError(f"tt_compat: torch {torch.__version__} create_block_mask cannot "
                                   "merge full blocks (separate_full_blocks=False)")
            return create_block_mask(*args, **kwargs)

        tt_attention._compiled_create_block_mask = torch.compile(create_block_mask_compat)
        _applied.append("torchtitan create_block_mask(separate_full_blocks=True) -> torch 2.11's")
    _report()
