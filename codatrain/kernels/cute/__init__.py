"""The ``cute`` stage backend: CODA forward stages as CuTeDSL kernels on QuACK's Hopper GEMM,
and FlashAttention 4 as the ``fa4`` attention.

Importing this package needs the cuda extras (``pip install 'codatrain[cuda]'``: CuTeDSL, QuACK,
flash-attn-4); without them the import raises ImportError, which `stages.get_backend` turns into
a BackendUnavailableError that names the fix. The backend runs on sm_90 GPUs only
(`CuteStages.unsupported_reason`).

Every stage runs as a kernel:
- forward: `entry` (entry.py), the GEMM + epilogue stages (gemm_stages.py) and the rstd reduction;
- backward: the GEMM + epilogue stages (gemm_bwd_stages.py: RMSNorm backward, dSwiGLU, the
  cross-entropy backward, the LM head's fp32-accumulating wgrad), the row-wise RoPE backward and
  row dot (rowwise.py) and the embedding backward (entry.py). Plain dgrad/wgrad GEMMs, with
  nothing to fuse, are cuBLAS calls (faster than QuACK's untuned default at every layer shape).
The epilogues QuACK's library lacks are in epilogues.py.
"""

from __future__ import annotations

from pathlib import Path

import quack.cache
import torch

from codatrain.kernels.attention import register_attention
from codatrain.kernels.cute import attention, entry, gemm_bwd_stages, gemm_stages, rowwise
from codatrain.kernels.stages import (
    IGNORE_INDEX,
    CeBwdOut,
    DSwigluOut,
    EntryOut,
    LseOut,
    ResidualOut,
    RmsBwdOut,
    RopeBwdOut,
    StageBackend,
    SwigluOut,
    is_sm90,
    register_backend,
)

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


class CuteStages(StageBackend):
    """Every CODA stage as a Hopper kernel (CuTeDSL on QuACK's GEMM)."""

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

    # ---- backward --------------------------------------------------------------------------

    def rope_bwd(
        self,
        dqkv: torch.Tensor,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope_theta: float,
    ) -> RopeBwdOut:
        _check_activations("rope_bwd", dqkv, qkv)
        return RopeBwdOut(
            *rowwise.rope_bwd(
                dqkv, qkv, positions, head_dim=head_dim, rope_heads=rope_heads, rope_theta=rope_theta
            )
        )

    def gemm_rstd_ce_bwd(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        targets: torch.Tensor,
        lse: torch.Tensor,
        grad_scale: torch.Tensor,
        *,
        ignore_index: int = IGNORE_INDEX,
    ) -> CeBwdOut:
        _check_activations("gemm_rstd_ce_bwd", h, weight)
        out = gemm_bwd_stages.gemm_rstd_ce_bwd(
            h, weight, rstd, targets, lse, grad_scale, ignore_index=ignore_index
        )
        return CeBwdOut(*out)

    def row_dot(self, z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        _check_activations("row_dot", z, dz)
        return rowwise.row_dot(z, dz)

    def gemm_rms_bwd(
        self,
        dz: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        gamma: torch.Tensor,
        rstd: torch.Tensor,
        zdz: torch.Tensor,
        residual_grad: torch.Tensor | None = None,
        *,
        tile_m: int = 128,
    ) -> RmsBwdOut:
        # The dγ partials follow the kernel's own row tile (the API allows any P_m), not tile_m.
        extra = () if residual_grad is None else (residual_grad,)
        _check_activations("gemm_rms_bwd", dz, weight, x, gamma, *extra)
        return RmsBwdOut(*gemm_bwd_stages.gemm_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad))

    def gemm_dswiglu(self, dout: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor) -> DSwigluOut:
        _check_activations("gemm_dswiglu", dout, weight, preact)
        return DSwigluOut(*gemm_bwd_stages.gemm_dswiglu(dout, weight, preact))

    def dgrad(self, dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        _check_activations("dgrad", dz, weight)
        return gemm_bwd_stages.dgrad(dz, weight)

    def wgrad(
        self, dz: torch.Tensor, a: torch.Tensor, *, accumulate_into: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check_activations("wgrad", dz, a)
        if accumulate_into is None:
            return gemm_bwd_stages.wgrad(dz, a)
        gemm_bwd_stages.wgrad_accumulate(dz, a, accumulate_into)
        return accumulate_into

    def entry_bwd(self, dx: torch.Tensor, tokens: torch.Tensor, *, num_embeddings: int) -> torch.Tensor:
        if dx.dtype not in _ACTIVATION_DTYPES:
            raise TypeError(f"cute entry_bwd: the gradient must be 16-bit, got {dx.dtype}")
        return entry.entry_bwd(dx, tokens, num_embeddings=num_embeddings)


register_backend("cute", CuteStages())
register_attention("fa4", attention.fa4_attention)
