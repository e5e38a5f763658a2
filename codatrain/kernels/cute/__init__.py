"""The ``cute`` stage backend: CODA forward stages as CuTeDSL kernels on QuACK's Hopper GEMM,
and FlashAttention 4 as the ``fa4`` attention.

Importing this package needs the cuda extras (``pip install 'codatrain[cuda]'``: CuTeDSL, QuACK,
flash-attn-4); without them the import raises ImportError, which `stages.get_backend` turns into
a BackendUnavailableError that names the fix. The backend runs on sm_90 GPUs only
(`CuteStages.unsupported_reason`).

Forward stages run as kernels: `entry` (entry.py), the GEMM + epilogue stages (gemm_stages.py,
epilogues in epilogues.py) and the rstd reduction. The backward stages are still the
reference implementations, running as PyTorch ops on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import quack.cache
import torch

from codatrain.kernels.cute import attention, entry, gemm_stages
from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.stages import (
    IGNORE_INDEX,
    EntryOut,
    LseOut,
    ResidualOut,
    SwigluOut,
    is_sm90,
    register_backend,
)
from codatrain.model.attention import register_attention

# QuACK keys its on-disk kernel cache on a fingerprint of its own sources; adding ours makes an
# edit to a kernel here invalidate the kernels compiled from the old version.
quack.cache.EXTRA_SOURCE_DIRS.append(Path(__file__).resolve().parent)

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


def _check_activations(stage: str, *tensors: torch.Tensor) -> None:
    # A plain loop: torch.compile traces this check with the stage call.
    for t in tensors:
        if t.dtype != tensors[0].dtype or t.dtype not in _ACTIVATION_DTYPES:
            got = ", ".join(str(t.dtype) for t in tensors)
            raise TypeError(f"cute {stage}: activations and weights must share one 16-bit dtype, got {got}")


class CuteStages(ReferenceStages):
    """Forward stages as Hopper kernels; the backward stages are inherited from the reference."""

    def unsupported_reason(self, device: torch.device) -> str | None:
        if not is_sm90(device):
            return "the CuTeDSL kernels target sm_90 (Hopper) GPUs"
        return None

    def entry(
        self,
        tokens: torch.Tensor,
        embedding: torch.Tensor,
        gamma: torch.Tensor,
        *,
        eps: float,
        dtype: torch.dtype | None = None,
    ) -> EntryOut:
        dtype = dtype or embedding.dtype
        if dtype not in _ACTIVATION_DTYPES:
            raise TypeError(f"cute entry: the activation dtype must be 16-bit, got {dtype}")
        return EntryOut(*entry.entry(tokens, embedding, gamma, eps=eps, dtype=dtype))

    def gemm_residual_rms(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        *,
        tile_n: int = 128,
    ) -> ResidualOut:
        # The partials follow the kernel's own column tile (the API allows any P), not tile_n.
        _check_activations("gemm_residual_rms", a, weight, residual, gamma)
        return ResidualOut(*gemm_stages.gemm_residual_rms(a, weight, residual, gamma))

    def rstd_from_partials(self, sq_partials: torch.Tensor, *, dim: int, eps: float) -> torch.Tensor:
        return gemm_stages.rstd_from_partials(sq_partials, dim=dim, eps=eps)

    def gemm_rstd_swiglu(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> SwigluOut:
        _check_activations("gemm_rstd_swiglu", h, weight)
        return SwigluOut(*gemm_stages.gemm_rstd_swiglu(h, weight, rstd))

    def gemm_rstd_rope(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope_theta: float,
    ) -> torch.Tensor:
        _check_activations("gemm_rstd_rope", h, weight)
        return gemm_stages.gemm_rstd_rope(
            h, weight, rstd, positions, head_dim=head_dim, rope_heads=rope_heads, rope_theta=rope_theta
        )

    def gemm_rstd(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        _check_activations("gemm_rstd", h, weight)
        return gemm_stages.gemm_rstd(h, weight, rstd)

    def gemm_rstd_lse(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        targets: torch.Tensor,
        *,
        ignore_index: int = IGNORE_INDEX,
    ) -> LseOut:
        _check_activations("gemm_rstd_lse", h, weight)
        return LseOut(*gemm_stages.gemm_rstd_lse(h, weight, rstd, targets, ignore_index=ignore_index))


register_backend("cute", CuteStages())
register_attention("fa4", attention.fa4_attention)
