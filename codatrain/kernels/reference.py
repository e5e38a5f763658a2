"""The reference stage backend: the CODA stage math in plain PyTorch, on any device.

It is the specification of every stage (`codatrain.kernels.stages`), the CPU path, and the
oracle the GPU kernels are tested against. Numerics mirror a GEMM + epilogue kernel: the GEMM
runs in the activation dtype (PyTorch accumulates in fp32 and rounds the product once), then
the epilogue upcasts to the statistics dtype, does all its math there, and rounds each written
tensor once. In fp32/fp64 this is exact math in the input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from codatrain.kernels import fp8
from codatrain.kernels.fp8 import Fp8Tensor, QuantizeTo
from codatrain.kernels.stages import (
    IGNORE_INDEX,
    DSwigluOut,
    EntryOut,
    HeadLossOut,
    LseOut,
    QkNormBwdOut,
    QkNormOut,
    ResidualOut,
    RmsBwdFp8Out,
    RmsBwdOut,
    Rope,
    RopeBwdOut,
    StageBackend,
    SwigluOut,
    register_backend,
    rope_inv_freq,
    stat_dtype,
)


def _rope_cos_sin(
    positions: torch.Tensor, head_dim: int, rope: Rope, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (M, 1, head_dim/2) of angle position · θ_i, θ_i = rope_inv_freq(head_dim, rope)[i].

    Angles are formed in fp64 (as the eager model does): at positions in the thousands an fp32
    angle would already be off by ~1e-3 rad.
    """
    inv_freq = rope_inv_freq(head_dim, rope, positions.device)
    angles = positions.to(torch.float64)[:, None, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_pairs(
    z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rope_heads: int
) -> torch.Tensor:
    """Rotate the adjacent column pairs (a, b) of the first rope_heads heads to (a·cos − b·sin,
    a·sin + b·cos); the remaining (v) columns are copied."""
    m, rope_cols = z.shape[0], rope_heads * head_dim
    a, b = z[:, :rope_cols].reshape(m, rope_heads, head_dim // 2, 2).unbind(-1)
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).reshape(m, rope_cols)
    return torch.cat((rotated, z[:, rope_cols:]), dim=1)


def _head_norm(z: torch.Tensor, head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x̂ = z·r and r = (mean z² + eps)^-1/2 over each head of the (M, heads·head_dim) z, both
    (M, heads, ·) in the stat dtype."""
    zs = z.to(stat_dtype(z.dtype)).reshape(z.shape[0], -1, head_dim)
    r = torch.rsqrt(zs.square().mean(-1, keepdim=True) + eps)
    return zs * r, r


def _head_gammas(q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int,
                 rope_heads: int) -> torch.Tensor:
    """(rope_heads, head_dim): the q norm's weight for each q head, the k norm's for each k head."""
    return torch.cat((q_weight.expand(q_heads, -1), k_weight.expand(rope_heads - q_heads, -1)))


def _tile_sums(values: torch.Tensor, tile: int, dim: int) -> torch.Tensor:
    """Sums of `values` over consecutive tiles of `tile` entries along `dim` (0 or 1); the last
    tile is zero-padded, as a kernel's edge tile would be masked."""
    size = values.shape[dim]
    tiles = math.ceil(size / tile)
    pad = tiles * tile - size
    if dim == 1:
        return F.pad(values, (0, pad)).view(values.shape[0], tiles, tile).sum(-1)
    return F.pad(values, (0, 0, 0, pad)).view(tiles, tile, values.shape[1]).sum(1)


def _mm(a: torch.Tensor | Fp8Tensor, b: torch.Tensor | Fp8Tensor) -> torch.Tensor:
    """a·b: in the activation dtype for tensors, in fp32 for FP8 operands (`fp8.matmul`)."""
    return fp8.matmul(a, b) if isinstance(a, Fp8Tensor) else a @ b


def _write(value: torch.Tensor, dtype: torch.dtype, to: QuantizeTo | None) -> torch.Tensor | Fp8Tensor:
    """An epilogue's stat-dtype value as written: rounded to `dtype`, or quantized as `to` asks."""
    return value.to(dtype) if to is None else fp8.quantize(value, to, dtype)


def _plus(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """total + term, where a None total is an empty sum."""
    return term if total is None else total + term


class ReferenceStages(StageBackend):
    """Pure-PyTorch stages. `logits_chunk_elements` bounds the logits block that `gemm_rstd_lse`
    materialises at once (rows × V), so the LM head never holds M×V logits. The partial sums
    of `gemm_residual_rms` are over column tiles of `tile_n` columns, those of `gemm_rms_bwd`
    over row tiles of `tile_m` rows, as a kernel with those tiles would leave them."""

    def __init__(self, logits_chunk_elements: int = 1 << 24, tile_n: int = 128, tile_m: int = 128) -> None:
        self.logits_chunk_elements, self.tile_n, self.tile_m = logits_chunk_elements, tile_n, tile_m

    # ---- forward ---------------------------------------------------------------------------

    def entry(
        self,
        tokens: torch.Tensor,
        embedding: torch.Tensor,
        gamma: torch.Tensor,
        *,
        eps: float,
        h_fp8: QuantizeTo | None = None,
    ) -> EntryOut:
        st = stat_dtype(embedding.dtype)
        x = embedding[tokens]
        xs = x.to(st)
        rstd = torch.rsqrt(xs.square().mean(-1) + eps)
        return EntryOut(x, _write(xs * gamma.to(st), x.dtype, h_fp8), rstd)

    def gemm_residual_rms(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        *,
        h_fp8: QuantizeTo | None = None,
    ) -> ResidualOut:
        st = stat_dtype(a.dtype)
        x = (residual.to(st) + _mm(a, weight.t()).to(st)).to(a.dtype)
        xs = x.to(st)  # statistics of x as written, the x the backward will read
        h = _write(xs * gamma.to(st), a.dtype, h_fp8)
        return ResidualOut(x, h, _tile_sums(xs.square(), self.tile_n, dim=1))

    def rstd_from_partials(self, sq_partials: torch.Tensor, *, dim: int, eps: float) -> torch.Tensor:
        return torch.rsqrt(sq_partials.sum(-1) / dim + eps)

    def gemm_rstd_swiglu(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                         y_fp8: QuantizeTo | None = None) -> SwigluOut:
        z = _mm(h, weight.t()).to(rstd.dtype) * rstd[:, None]
        y = F.silu(z[:, 0::2]) * z[:, 1::2]
        return SwigluOut(z.to(h.dtype), _write(y, h.dtype, y_fp8))

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
        z = _mm(h, weight.t()).to(rstd.dtype) * rstd[:, None]
        if bias is not None:
            z += bias.to(rstd.dtype)
        cos, sin = _rope_cos_sin(positions, head_dim, rope, rstd.dtype)
        return _rotate_pairs(z, cos, sin, head_dim, rope_heads).to(h.dtype)

    def gemm_rstd_qknorm_rope(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        q_heads: int,
        rope_heads: int,
        rope: Rope,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> QkNormOut:
        st, rope_cols = rstd.dtype, rope_heads * head_dim
        z = _mm(h, weight.t()).to(st) * rstd[:, None]
        if bias is not None:
            z += bias.to(st)
        z_qk = z[:, :rope_cols].to(h.dtype)  # written once: the norm and its backward read this z
        x_hat, _ = _head_norm(z_qk, head_dim, eps)
        gamma = _head_gammas(q_weight, k_weight, q_heads, rope_heads).to(st)
        normed = torch.cat(((x_hat * gamma).reshape(z.shape[0], rope_cols), z[:, rope_cols:]), dim=1)
        cos, sin = _rope_cos_sin(positions, head_dim, rope, st)
        return QkNormOut(_rotate_pairs(normed, cos, sin, head_dim, rope_heads).to(h.dtype), z_qk)

    def gemm_rstd(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        return ((h @ weight.t()).to(rstd.dtype) * rstd[:, None]).to(h.dtype)

    def gemm_rstd_lse(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        targets: torch.Tensor,
        *,
        ignore_index: int = IGNORE_INDEX,
    ) -> LseOut:
        lse = torch.empty_like(rstd)
        target_logit = torch.empty_like(rstd)
        rows = max(1, self.logits_chunk_elements // weight.shape[0])
        for start in range(0, h.shape[0], rows):
            chunk = slice(start, start + rows)
            logits = (h[chunk] @ weight.t()).to(rstd.dtype) * rstd[chunk, None]
            lse[chunk] = torch.logsumexp(logits, dim=-1)
            valid = targets[chunk] != ignore_index
            picked = logits.gather(1, torch.where(valid, targets[chunk], 0)[:, None])[:, 0]
            target_logit[chunk] = torch.where(valid, picked, 0.0)
        return LseOut(lse, target_logit)

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
        st = stat_dtype(x.dtype)
        xs = x.to(st)
        rstd = torch.rsqrt(xs.pow(2).mean(-1) + eps)
        xr = xs * rstd[:, None]
        n = (xr * gamma.to(st)).to(x.dtype)  # the normed rows, written once as the GEMMs' operand
        loss = torch.empty_like(rstd)
        dn = torch.empty_like(x)
        dweight = last_dlogits = last_n = None
        for start in range(0, x.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = (n[rows] @ weight.t()).to(st)
            lse = torch.logsumexp(logits, dim=-1)
            valid = targets[rows] != ignore_index
            picked = torch.where(valid, targets[rows], 0)[:, None]
            loss[rows] = torch.where(valid, lse - logits.gather(1, picked)[:, 0], 0.0)
            # dlogits overwrite the logits chunk, in the activation dtype.
            dlogits = torch.exp(logits - lse[:, None]).scatter_add_(1, picked, -torch.ones_like(lse)[:, None])
            dlogits = (dlogits * valid[:, None]).to(x.dtype)
            dn[rows] = dlogits @ weight
            if last_dlogits is not None:  # the previous chunk's, accumulated unrounded
                dweight = _plus(dweight, last_dlogits.t().to(st) @ last_n.to(st))
            # The last chunk's weight gradient is left to `lm_head_dweight`, as the cute head does.
            last_dlogits, last_n = dlogits, n[rows]
        dns = dn.to(st)
        zdz = (n.to(st) * dns).sum(-1)
        # The norm backward of `gemm_rms_bwd`, with dn at hand instead of a dgrad GEMM.
        dx = rstd[:, None] * (dns * gamma.to(st) - xr * (zdz[:, None] / x.shape[1]))
        return HeadLossOut(loss, dx.to(x.dtype), (dns * xr).sum(0), dweight, last_dlogits, last_n)

    def lm_head_dweight(
        self,
        dweight: torch.Tensor | None,
        last_dlogits: torch.Tensor | None,
        last_n: torch.Tensor | None,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        st = scale.dtype
        if last_dlogits is not None:
            dweight = _plus(dweight, last_dlogits.t().to(st) @ last_n.to(st))
        return (dweight * scale).to(dtype)

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
        dz_fp8: QuantizeTo | None = None,
    ) -> RopeBwdOut:
        st = stat_dtype(dqkv.dtype)
        dqkv_s = dqkv.to(st)
        cos, sin = _rope_cos_sin(positions, head_dim, rope, st)
        # The transpose of a rotation is the rotation by the opposite angle.
        dz = _rotate_pairs(dqkv_s, cos, -sin, head_dim, rope_heads)
        zdz = (qkv.to(st) * dqkv_s).sum(-1)
        if bias is not None:  # the norm's consumer z excludes the bias: Σ (z − b)·dz
            zdz -= dz @ bias.to(st)
        return RopeBwdOut(_write(dz, dqkv.dtype, dz_fp8), zdz)

    def qknorm_rope_bwd(
        self,
        dqkv: torch.Tensor,
        qkv: torch.Tensor,
        z: torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        q_heads: int,
        rope_heads: int,
        rope: Rope,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> QkNormBwdOut:
        st, m, rope_cols = stat_dtype(dqkv.dtype), dqkv.shape[0], rope_heads * head_dim
        cos, sin = _rope_cos_sin(positions, head_dim, rope, st)
        dn = _rotate_pairs(dqkv.to(st), cos, -sin, head_dim, rope_heads)[:, :rope_cols]
        dn = dn.reshape(m, rope_heads, head_dim)
        x_hat, r = _head_norm(z, head_dim, eps)
        gamma = _head_gammas(q_weight, k_weight, q_heads, rope_heads).to(st)
        dx_hat = dn * gamma
        dz_qk = r * (dx_hat - x_hat * (x_hat * dx_hat).mean(-1, keepdim=True))
        dgamma = (dn * x_hat).sum(0)  # (rope_heads, head_dim)
        dz = torch.cat((dz_qk.reshape(m, rope_cols), dqkv[:, rope_cols:].to(st)), dim=1)
        z_all = torch.cat((z.to(st), qkv[:, rope_cols:].to(st)), dim=1)
        if bias is not None:
            z_all -= bias.to(st)
        return QkNormBwdOut(dz.to(dqkv.dtype), (z_all * dz).sum(-1), dgamma[:q_heads].sum(0),
                            dgamma[q_heads:].sum(0))

    def bias_grad(self, dz: torch.Tensor) -> torch.Tensor:
        return dz.to(stat_dtype(dz.dtype)).sum(0)

    def row_dot(self, z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        st = stat_dtype(z.dtype)
        return (z.to(st) * dz.to(st)).sum(-1)

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
        dx, n, dgamma_partials = self._rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)
        return RmsBwdOut(dx.to(x.dtype), n.to(x.dtype), dgamma_partials)

    def gemm_rms_bwd_fp8(
        self,
        dz: Fp8Tensor,
        weight: Fp8Tensor,
        x: torch.Tensor,
        gamma: torch.Tensor,
        rstd: torch.Tensor,
        zdz: torch.Tensor,
        residual_grad: torch.Tensor | None = None,
        *,
        n_fp8: QuantizeTo,
        dx_fp8: QuantizeTo | None = None,
    ) -> RmsBwdFp8Out:
        dx, n, dgamma_partials = self._rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)
        dx_q = None if dx_fp8 is None else fp8.quantize(dx, dx_fp8, x.dtype)
        return RmsBwdFp8Out(dx.to(x.dtype), dx_q, fp8.quantize(n, n_fp8, x.dtype), dgamma_partials)

    def _rms_bwd(
        self, dz: torch.Tensor | Fp8Tensor, weight: torch.Tensor | Fp8Tensor, x: torch.Tensor,
        gamma: torch.Tensor, rstd: torch.Tensor, zdz: torch.Tensor, residual_grad: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`gemm_rms_bwd`'s dx and n in the stat dtype, unrounded, and its dγ partials."""
        st = rstd.dtype
        dn = _mm(dz, weight).to(st)
        xs, g, r = x.to(st), gamma.to(st), rstd[:, None]
        # dx = r·(dn⊙γ − x·r·ZdZ) with ZdZ = zdz/d = r·Σ_k dn_k γ_k x_k / d (docs/design.md §3).
        dx = r * (dn * g - xs * r * (zdz[:, None] / x.shape[1]))
        if residual_grad is not None:
            dx += residual_grad.to(st)
        xr = xs * r
        return dx, xr * g, _tile_sums(dn * xr, self.tile_m, dim=0)

    def gemm_dswiglu(self, dout: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, *,
                     dpreact_fp8: QuantizeTo | None = None, y_fp8: QuantizeTo | None = None,
                     reuse_preact: bool = False) -> DSwigluOut:
        del reuse_preact  # the reference's FP8 copies are new tensors of the quantize rule's
        st = stat_dtype(preact.dtype)
        dy = _mm(dout, weight).to(st)
        pre = preact.to(st)
        g, u = pre[:, 0::2], pre[:, 1::2]
        sig = torch.sigmoid(g)
        silu = g * sig
        dg = dy * u * sig * (1 + g * (1 - sig))  # silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
        du = dy * silu
        dpreact = torch.stack((dg, du), dim=-1).view_as(pre)
        return DSwigluOut(_write(dpreact, preact.dtype, dpreact_fp8), _write(silu * u, preact.dtype, y_fp8),
                          (g * dg + u * du).sum(-1))

    def dgrad(self, dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _mm(dz, weight).to(dz.dtype)

    def wgrad(
        self, dz: torch.Tensor, a: torch.Tensor, *, accumulate_into: torch.Tensor | None = None
    ) -> torch.Tensor:
        if accumulate_into is None:
            return _mm(dz.t(), a).to(dz.dtype)
        return accumulate_into.add_(_mm(dz.t(), a))

    def quantize(self, x: torch.Tensor, to: QuantizeTo) -> Fp8Tensor:
        return fp8.quantize(x, to)

    def entry_bwd(self, dx: torch.Tensor, tokens: torch.Tensor, *, num_embeddings: int) -> torch.Tensor:
        st = stat_dtype(dx.dtype)
        grad = torch.zeros(num_embeddings, dx.shape[1], dtype=st, device=dx.device)
        return grad.index_add_(0, tokens, dx.to(st)).to(dx.dtype)


register_backend("reference", ReferenceStages())
