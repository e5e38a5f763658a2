"""`CuteStages`: every CODA stage, forward and backward, on Hopper (sm_90).

A stage is three pieces: its epilogue (epilogues.py, or QuACK's), an out-style custom op that
launches the kernel (gemm_stages.py, gemm_bwd_stages.py, rowwise.py, entry.py), and the method
here, which checks dtypes, allocates the outputs, calls the op and names the results. The fused
stages are CuTeDSL kernels (QuACK's GEMM with a CODA epilogue, or a row kernel); the rstd
reduction and the LM head's fused linear cross-entropy (head.py) are QuACK's; plain dgrad/wgrad
GEMMs, with nothing to fuse, are cuBLAS calls (faster than QuACK's untuned default at every layer
shape).
"""

from __future__ import annotations

import torch

from codatrain.kernels.cute import entry, gemm_bwd_stages, gemm_stages, head, rowwise
from codatrain.kernels.cute.common import empty, padded_width, rows_of_whole_vectors
from codatrain.kernels.stages import (
    IGNORE_INDEX,
    DSwigluOut,
    EntryOut,
    HeadLossOut,
    LseOut,
    ResidualOut,
    RmsBwdOut,
    Rope,
    RopeBwdOut,
    StageBackend,
    SwigluOut,
    is_sm90,
)

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
STAT = torch.float32  # the statistics dtype of 16-bit activations


def _check_activations(stage: str, *tensors: torch.Tensor) -> None:
    # A plain loop: torch.compile traces this check with the stage call.
    for t in tensors:
        if t.dtype != tensors[0].dtype or t.dtype not in _ACTIVATION_DTYPES:
            got = ", ".join(str(t.dtype) for t in tensors)
            raise TypeError(f"cute {stage}: activations and weights must share one 16-bit dtype, got {got}")


class CuteStages(StageBackend):
    """Every CODA stage as a Hopper kernel: CuTeDSL epilogues on QuACK's GEMM, row kernels, and
    cuBLAS for the plain dgrad/wgrad."""

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
    ) -> EntryOut:
        _check_activations("entry", embedding, gamma)
        if not (embedding.is_contiguous() and gamma.is_contiguous()):
            raise ValueError("cute entry: the embedding table and gamma must be contiguous")
        m, d = tokens.shape[0], embedding.shape[1]
        out = EntryOut(empty(m, d, like=embedding), empty(m, d, like=embedding),
                       empty(m, like=embedding, dtype=STAT))
        entry.entry(tokens.contiguous(), embedding, gamma, *out, eps)
        return out

    def gemm_residual_rms(
        self, a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor
    ) -> ResidualOut:
        _check_activations("gemm_residual_rms", a, weight, residual, gamma)
        # The partials follow the kernel's own column tile (the API allows any P).
        m, n = a.shape[0], weight.shape[0]
        tiles = gemm_stages.column_tiles(gemm_stages.residual_rms_stage(a.shape[1], n), n)
        out = ResidualOut(empty(m, n, like=a), empty(m, n, like=a), empty(m, tiles, like=a, dtype=STAT))
        gemm_stages.gemm_residual_rms(a, weight, residual, gamma, *out)
        return out

    def rstd_from_partials(self, sq_partials: torch.Tensor, *, dim: int, eps: float) -> torch.Tensor:
        return gemm_stages.rstd_from_partials(sq_partials, dim=dim, eps=eps)

    def gemm_rstd_swiglu(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> SwigluOut:
        _check_activations("gemm_rstd_swiglu", h, weight)
        m, n = h.shape[0], weight.shape[0]
        out = SwigluOut(empty(m, n, like=h), empty(m, n // 2, like=h))
        gemm_stages.gemm_rstd_swiglu(h, weight, rstd, *out)
        return out

    def gemm_rstd_rope(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope: Rope,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_activations("gemm_rstd_rope", h, weight, *([] if bias is None else [bias]))
        qkv = empty(h.shape[0], weight.shape[0], like=h)
        gemm_stages.gemm_rstd_rope(
            h, weight, rstd, positions, bias, qkv, head_dim, rope_heads, *gemm_stages.rope_args(rope)
        )
        return qkv

    def gemm_rstd(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        _check_activations("gemm_rstd", h, weight)
        # Logits rows are TMA stores: a vocabulary that is not a multiple of 8 is written into rows
        # padded to one, and the (M, V) view is returned.
        vocab = weight.shape[0]
        z = empty(h.shape[0], padded_width(vocab), like=h)[:, :vocab]
        gemm_stages.gemm_rstd(h, weight, rstd, z)
        return z

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
        out = LseOut(empty(h.shape[0], like=h, dtype=STAT), empty(h.shape[0], like=h, dtype=STAT))
        gemm_stages.gemm_rstd_lse(h, weight, rstd, targets, *out, ignore_index)
        return out

    def lm_head_ce(
        self,
        x: torch.Tensor,
        gamma: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        eps: float,
        chunk_rows: int,
        ignore_index: int = IGNORE_INDEX,
    ) -> HeadLossOut:
        _check_activations("lm_head_ce", x, gamma, weight)
        out = head.lm_head_ce(x.contiguous(), gamma, weight, targets, eps, chunk_rows, ignore_index)
        return HeadLossOut(*out)

    def lm_head_dweight(
        self,
        dweight: torch.Tensor | None,
        last_dlogits: torch.Tensor | None,
        last_n: torch.Tensor | None,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        return head.lm_head_dweight(dweight, last_dlogits, last_n, scale, dtype)

    # ---- backward --------------------------------------------------------------------------

    def rope_bwd(
        self,
        dqkv: torch.Tensor,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        rope_heads: int,
        rope: Rope,
        bias: torch.Tensor | None = None,
    ) -> RopeBwdOut:
        _check_activations("rope_bwd", dqkv, qkv, *([] if bias is None else [bias]))
        out = RopeBwdOut(empty(*dqkv.shape, like=dqkv), empty(dqkv.shape[0], like=dqkv, dtype=STAT))
        rowwise.rope_bwd(
            dqkv.contiguous(), qkv.contiguous(), positions, bias, *out, head_dim, rope_heads,
            *gemm_stages.rope_args(rope),
        )
        return out

    def bias_grad(self, dz: torch.Tensor) -> torch.Tensor:
        # One column-sum pass over dz (M × N_qkv), in fp32.
        return dz.sum(0, dtype=STAT)

    def row_dot(self, z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        _check_activations("row_dot", z, dz)
        zdz = empty(z.shape[0], like=z, dtype=STAT)
        rowwise.row_dot(z.contiguous(), dz.contiguous(), zdz)
        return zdz

    def gemm_rms_bwd(
        self,
        dz: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        gamma: torch.Tensor,
        rstd: torch.Tensor,
        zdz: torch.Tensor,
        residual_grad: torch.Tensor | None = None,
    ) -> RmsBwdOut:
        extra = () if residual_grad is None else (residual_grad,)
        _check_activations("gemm_rms_bwd", dz, weight, x, gamma, *extra)
        # dz is the dgrad's K-major A operand: its rows must be 16-byte TMA rows (the full-logits
        # head's dlogits over a vocabulary that is not a multiple of 8 are not).
        dz = rows_of_whole_vectors(dz)
        # The dγ partials follow the kernel's own row tile (the API allows any P_m).
        m, d = x.shape
        tiles = gemm_bwd_stages.rms_bwd_row_tiles(m)
        out = RmsBwdOut(empty(m, d, like=x), empty(m, d, like=x), empty(tiles, d, like=x, dtype=STAT))
        gemm_bwd_stages.gemm_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad, *out)
        return out

    def gemm_dswiglu(self, dout: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor) -> DSwigluOut:
        _check_activations("gemm_dswiglu", dout, weight, preact)
        m, f2 = preact.shape
        out = DSwigluOut(empty(m, f2, like=preact), empty(m, f2 // 2, like=preact),
                         empty(m, like=preact, dtype=STAT))
        gemm_bwd_stages.gemm_dswiglu(dout, weight, preact, *out)
        return out

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
        # The table starts at zero: rows of tokens absent from the batch get no gradient. It sums
        # in fp32 and is rounded once.
        grad = torch.zeros(num_embeddings, dx.shape[1], dtype=STAT, device=dx.device)
        entry.entry_bwd(dx.contiguous(), tokens.contiguous(), grad)
        return grad.to(dx.dtype)
