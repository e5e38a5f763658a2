"""The FP8 backward GEMM stages of the CODA block (block.precision=fp8) and the FP8 operand
layouts they need.

sm_90's FP8 WGMMA reads both operands K-major (contiguous along the contraction), so each GEMM
of the backward needs its FP8 operands in the orientation of its contraction:

- dgrad dz·W contracts over the weight's rows: it reads Wᵀ, a transposed FP8 copy of the weight.
- wgrad dzᵀ·a contracts over the tokens: it reads dzᵀ and aᵀ, token-contiguous FP8 copies.

The producers write those copies beside the row-major ones when asked (`QuantizeTo.transposed`,
`quantize.quantize_transpose_fp8`); `k_major_t` takes them. The fused stages (the RMSNorm backward
in the norm consumer's dgrad, dSwiGLU in the down-projection's dgrad) are QuACK GEMMs with FP8
operands and the bf16 stages' epilogues, the accumulator first multiplied by 1/(s_a·s_b) (a 0-d
device tensor, QuACK `Scalar`); the plain dgrad and wgrad are cuBLAS FP8 GEMMs (`torch._scaled_mm`,
per-tensor scales, no fast accumulation), which have no epilogue to fuse.

Where dSwiGLU's outputs are FP8 with delayed scales (FP8 weight gradients after a run's first step),
the down-projection's dgrad is a cuBLAS FP8 GEMM instead, followed by one pass that does dSwiGLU and
writes every FP8 copy the backward reads (`fp8_dgrad_dswiglu_quantized`): QuACK's promoted FP8
mainloop under dSwiGLU's epilogue ran 1.75× `_scaled_mm` at 8B widths, and its 16-bit outputs
needed quantize passes of their own after it (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from quack.activation import dswiglu
from quack.dsl.torch_library_op import cute_op
from quack.epilogue.frontend import pack, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, RowVecReduce, Scalar, TileLoad
from torch import Tensor

from codatrain.kernels.cute import quantize
from codatrain.kernels.cute.common import aligned16, empty
from codatrain.kernels.cute.fp8_stages import fp8_epilogue
from codatrain.kernels.cute.pins import scaled_mm
from codatrain.kernels.fp8 import Fp8Tensor, QuantizeTo


def k_major_t(operand: Fp8Tensor) -> Tensor:
    """The transpose of an FP8 operand's (R, C) data as a contiguous (C, R) tensor: the K-major
    copy an FP8 GEMM that contracts over R reads. The producer's own (`QuantizeTo.transposed`), or
    else a copy by torch (slow: docs/benchmarks.md)."""
    return operand.data_t if operand.data_t is not None else operand.data.t().contiguous()


# ---- RMSNorm backward in the consumer's FP8 dgrad --------------------------------------------------
# As epilogues.rms_bwd_epi / rms_bwd_residual_epi with dn = acc/(s_dz·s_w); n and dx are written in
# the activation dtype and quantized by `quantize.quantize_fp8` (their scales need no second pass,
# but their FP8 copies are the wgrad's and dgrad's operands in two orientations).
_FP8_RMS_BWD_OPS = {
    "x": TileLoad("x"),
    "gamma": RowVecLoad("gamma"),
    "rstd": ColVecLoad("rstd"),
    "zdz": ColVecLoad("zdz"),
    "ab_inv_scale": Scalar("ab_inv_scale"),
}


@fp8_epilogue(outputs=("n",), ops=_FP8_RMS_BWD_OPS, reduces={"dgamma": RowVecReduce("dgamma", scaled=True)})
def fp8_rms_bwd_epi(acc, x, gamma, rstd, zdz, ab_inv_scale, inv_dim):
    """RMSNorm backward on FP8 operands, no residual path."""
    dn = acc * ab_inv_scale
    xr = x * rstd
    return {"D": rstd * (dn * gamma - xr * (zdz * inv_dim)), "n": xr * gamma, "dgamma": (dn, xr)}


@fp8_epilogue(outputs=("n",), ops=_FP8_RMS_BWD_OPS, reduces={"dgamma": RowVecReduce("dgamma", scaled=True)})
def fp8_rms_bwd_residual_epi(acc, c, x, gamma, rstd, zdz, ab_inv_scale, inv_dim):
    """RMSNorm backward on FP8 operands plus the residual-path gradient C of the same x."""
    dn = acc * ab_inv_scale
    xr = x * rstd
    return {"D": rstd * (dn * gamma - xr * (zdz * inv_dim)) + c, "n": xr * gamma, "dgamma": (dn, xr)}


@cute_op("codatrain::cute_fp8_gemm_rms_bwd", mutates_args=("dx", "n", "dgamma_partials"), device_types="cuda")
def fp8_gemm_rms_bwd(
    dz: Tensor, weight_t: Tensor, ab_inv_scale: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    residual_grad: Tensor | None, dx: Tensor, n: Tensor, dgamma_partials: Tensor, fast_accum: bool,
) -> None:
    """`gemm_bwd_stages.gemm_rms_bwd` on FP8 operands: dn = dz·W/(s_dz·s_w), dz (M, N) FP8 and
    weight_t = Wᵀ (K, N) FP8, contiguous; dx, n in x's dtype, dγ partials as there; `fast_accum`
    the run's block.fp8_fast_accum."""
    epilogue = fp8_rms_bwd_epi if residual_grad is None else fp8_rms_bwd_residual_epi
    epilogue(
        "fp8_rms_bwd", fast_accum, dz, weight_t.t(), residual_grad, out={"D": dx, "n": n}, x=x,
        gamma=aligned16(gamma), rstd=aligned16(rstd), zdz=aligned16(zdz), ab_inv_scale=ab_inv_scale,
        inv_dim=1.0 / x.shape[1], dgamma=dgamma_partials,
    )


# ---- the norm backward after a cuBLAS FP8 dgrad, its outputs quantized in the same pass -------------
def one_pass_rms_bwd(n_fp8: QuantizeTo, dx_fp8: QuantizeTo | None) -> bool:
    """Whether `fp8_dgrad_rms_bwd_quantized` can write what the caller asks: n token-contiguous
    alone (its weight gradient is its only reader) and dx, when asked, in FP8 with scales known
    before the pass (delayed)."""
    return (n_fp8.scale is not None and n_fp8.transposed and not n_fp8.rows
            and (dx_fp8 is None or dx_fp8.scale is not None))


def fp8_dgrad_rms_bwd_quantized(
    dz: Fp8Tensor, weight: Fp8Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    residual_grad: Tensor | None, n_fp8: QuantizeTo, dx_fp8: QuantizeTo | None, fast_accum: bool,
) -> tuple[Tensor, Tensor | Fp8Tensor, Fp8Tensor, Tensor]:
    """(dx, dx as asked, n, dγ partials) of `gemm_rms_bwd_fp8` on FP8 dz (M, N) and W (N, d):
    dn = dz·W by cuBLAS (`fp8_mm`), turned by `quantize.rms_bwd_quantize_fp8` into dx (16 bits and
    FP8 as `dx_fp8` asks), n's transposed FP8 copy and the dγ partials of 128-row tiles, as
    `one_pass_rms_bwd` asks."""
    m, d = x.shape
    dn = fp8_mm(dz.data, dz.scale.reciprocal(), k_major_t(weight), weight.scale.reciprocal(), x.dtype,
                fast_accum)
    dx = empty(m, d, like=x)
    dxq, dxq_t = (None, None) if dx_fp8 is None else quantize.fp8_buffers((m, d), dx_fp8, x.device)
    n_t = empty(d, m, like=x, dtype=n_fp8.dtype)
    tiles = quantize.transpose_tiles(m, d)
    dx_amax, n_amax = (empty(*tiles, like=x, dtype=torch.float32) for _ in range(2))
    dgamma = empty(tiles[0], d, like=x, dtype=torch.float32)
    # A scale the pass does not use when dx stays in 16 bits: n's, which is always there.
    quantize.rms_bwd_quantize_fp8(dn, x, residual_grad, gamma, rstd, zdz,
                                  n_fp8.scale if dx_fp8 is None else dx_fp8.scale, n_fp8.scale, dx, dxq,
                                  dxq_t, n_t, dx_amax, n_amax, dgamma)
    n = Fp8Tensor(n_t.t(), n_fp8.scale, x.dtype, n_amax.amax(), n_t)
    if dx_fp8 is None:
        return dx, dx, n, dgamma
    dx_operand = Fp8Tensor(dxq if dxq is not None else dxq_t.t(), dx_fp8.scale, x.dtype, dx_amax.amax(),
                           dxq_t)
    return dx, dx_operand, n, dgamma


# ---- dSwiGLU in the down-projection's FP8 dgrad ------------------------------------------------------


@fp8_epilogue(outputs=("postact",), ops={"ab_inv_scale": Scalar("ab_inv_scale")},
               reduces={"dsum": ColVecReduce("dsum")}, mode="packed_cd_b16x2")
def fp8_dswiglu_epi(acc, c, ab_inv_scale):
    """QuACK's `dswiglu_dpreact_mod` with dy = acc/(s_dout·s_w): C the pre-activation pairs (g, u);
    D = (dg, du) interleaved, ``postact`` = silu(g)·u, ``dsum`` = Σ g·dg + u·du."""
    g, u = unpack(c)
    dg, du, y = dswiglu(g, u, acc * ab_inv_scale)
    return {"D": pack(dg, du), "postact": y, "dsum": dg * g + du * u}


@cute_op("codatrain::cute_fp8_gemm_dswiglu", mutates_args=("dpreact", "y", "zdz"), device_types="cuda")
def fp8_gemm_dswiglu(
    dout: Tensor, weight_t: Tensor, ab_inv_scale: Tensor, preact: Tensor, dpreact: Tensor, y: Tensor,
    zdz: Tensor, fast_accum: bool,
) -> None:
    """`gemm_bwd_stages.gemm_dswiglu` on FP8 operands: dy = dout·W_down/(s·s_w), dout (M, d) FP8 and
    weight_t = W_downᵀ (F, d) FP8, contiguous; `fast_accum` the run's block.fp8_fast_accum."""
    result = fp8_dswiglu_epi(
        "fp8_dswiglu", fast_accum, dout, weight_t.t(), preact, out={"D": dpreact, "postact": y},
        ab_inv_scale=ab_inv_scale,
    )
    zdz.copy_(result["dsum"])


# ---- plain dgrad and wgrad: cuBLAS FP8 ---------------------------------------------------------------


def fp8_mm(a: Tensor, a_inv_scale: Tensor, b_t: Tensor, b_inv_scale: Tensor,
           out_dtype: torch.dtype, fast_accum: bool = False) -> Tensor:
    """a (M, K) · b (K, N) for FP8 a and b_t = bᵀ (N, K), both contiguous (K-major), with per-tensor
    dequantization scales (0-d fp32 device tensors), accumulated in fp32 (periodically promoted
    from the tensor cores' accumulator unless `fast_accum`)."""
    return scaled_mm(a, b_t.t(), scale_a=a_inv_scale, scale_b=b_inv_scale, out_dtype=out_dtype,
                     use_fast_accum=fast_accum)


# ---- dSwiGLU after a cuBLAS FP8 dgrad, its outputs quantized in the same pass ------------------------
# dy is made in column chunks, so that only a chunk of it is alive beside preact and dpreact's FP8
# copies: with DSWIGLU_CHUNKS = 4 the stage holds 9.5 F bytes a row at most (preact 4F, dpreact's
# FP8 copies 4F, y's F, a dy chunk F/2), under the 10 F of the epilogue path (preact, dpreact and y
# in 16 bits), where the FP8 step's memory peaks.
DSWIGLU_CHUNKS = 4


def one_pass_dswiglu(dpreact_fp8: QuantizeTo | None, y_fp8: QuantizeTo | None) -> bool:
    """Whether `fp8_dgrad_dswiglu_quantized` can write what the caller asks: dpreact and y in FP8
    with scales known before the pass (delayed), dpreact in both orientations (or transposed
    alone), y token-contiguous alone (its weight gradient is its only reader)."""
    return (dpreact_fp8 is not None and y_fp8 is not None and dpreact_fp8.scale is not None
            and y_fp8.scale is not None and dpreact_fp8.transposed and y_fp8.transposed and not y_fp8.rows)


def fp8_dgrad_dswiglu_quantized(
    dout: Fp8Tensor, weight: Fp8Tensor, preact: Tensor, dpreact_fp8: QuantizeTo, y_fp8: QuantizeTo,
    fast_accum: bool, chunks: int = DSWIGLU_CHUNKS,
) -> tuple[Fp8Tensor, Fp8Tensor, Tensor]:
    """(dpreact, y, zdz) of `gemm_dswiglu` on FP8 dout (M, d) and W_down (d, F), preact (M, 2F):
    dy = dout·W_down by cuBLAS (`fp8_mm`) in `chunks` column chunks of whole 32-column tiles,
    each turned by `quantize.dswiglu_quantize_fp8` into its columns of dpreact and y in FP8 (as
    `one_pass_dswiglu` asks) and its ZdZ partials."""
    m, f2 = preact.shape
    f = f2 // 2
    dp, dp_t = quantize.fp8_buffers((m, f2), dpreact_fp8, preact.device)
    y_t = empty(f, m, like=preact, dtype=y_fp8.dtype)
    tiles = quantize.transpose_tiles(m, f2)
    dp_amax, y_amax = (empty(*tiles, like=preact, dtype=torch.float32) for _ in range(2))
    zdz = torch.zeros(m, dtype=torch.float32, device=preact.device)
    w_t, a_inv, w_inv = k_major_t(weight), dout.scale.reciprocal(), weight.scale.reciprocal()
    tile_pairs = quantize.TRANSPOSE_TILE[1] // 2
    chunk = -(-f // (chunks * tile_pairs)) * tile_pairs
    for start in range(0, f, chunk):
        dy = fp8_mm(dout.data, a_inv, w_t[start:start + chunk], w_inv, preact.dtype, fast_accum)
        dsum = empty(m, -(-dy.shape[1] // tile_pairs), like=preact, dtype=torch.float32)
        quantize.dswiglu_quantize_fp8(dy, preact, dpreact_fp8.scale, y_fp8.scale, dp, dp_t, y_t,
                                      dp_amax, y_amax, dsum, 2 * start)
        del dy  # before the next chunk's
        zdz += dsum.sum(1)
    dpreact = Fp8Tensor(dp if dp is not None else dp_t.t(), dpreact_fp8.scale, preact.dtype, dp_amax.amax(),
                        dp_t)
    y = Fp8Tensor(y_t.t(), y_fp8.scale, preact.dtype, y_amax.amax(), y_t)
    return dpreact, y, zdz
