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
"""

from __future__ import annotations

import torch
from quack.activation import dswiglu
from quack.dsl.torch_library_op import cute_op
from quack.epilogue.frontend import pack, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, RowVecReduce, Scalar, TileLoad
from torch import Tensor

from codatrain.kernels.cute.common import aligned16
from codatrain.kernels.cute.fp8_stages import fp8_epilogue
from codatrain.kernels.cute.pins import scaled_mm
from codatrain.kernels.fp8 import Fp8Tensor


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
           out_dtype: torch.dtype) -> Tensor:
    """a (M, K) · b (K, N) for FP8 a and b_t = bᵀ (N, K), both contiguous (K-major), with per-tensor
    dequantization scales (0-d fp32 device tensors), accumulated in fp32 without fast accumulation."""
    return scaled_mm(a, b_t.t(), scale_a=a_inv_scale, scale_b=b_inv_scale, out_dtype=out_dtype,
                     use_fast_accum=False)
