"""The FP8 forward GEMM stages of the CODA block (block.precision=fp8) on QuACK's SM90 GEMM.

Operands are per-tensor scaled FP8 (data ≈ x·scale, docs/design.md §3 "FP8"): the GEMM multiplies
the FP8 values with fp32 accumulation and the epilogue multiplies the sum by `ab_inv_scale` =
1/(s_a·s_b), a 0-d fp32 device tensor, so a delayed scale never crosses to the host.

The mainloop is QuACK's FP8 mainloop, in one of two modes per stage (`Fp8Epilogue`,
configs.fp8_stage_config): it adds the WGMMA accumulator into an fp32 register copy after every
k-tile, two accumulators per thread, which cooperative tiles hold (pingpong tiles spill), or it
keeps the sum in the tensor cores' accumulator (fast accumulation, about 14 bits), one
accumulator, which pingpong tiles take: the stages whose outputs meet the stage tests' criterion
with it run so by default, the others when a run asks (block.fp8_fast_accum; docs/benchmarks.md,
"FP8 fast accumulation").

Producers write the next GEMM's operand in FP8 in their epilogue, with the scale they are given,
and the per-column-tile max |value| partials of what they quantized (the amax the delayed scaling
records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from quack.activation import swiglu
from quack.dsl.torch_library_op import cute_op
from quack.epilogue.frontend import EpiMod, pack, unpack
from quack.epilogue.head_rmsnorm import HeadRstd
from quack.epilogue.ops import ColVecLoad, ColVecReduce, RowVecLoad, Scalar
from torch import Tensor

from codatrain.kernels.cute.common import aligned16
from codatrain.kernels.cute.configs import fp8_stage_config
from codatrain.kernels.cute.epilogues import norm_rope, qknorm_ops, rotate_pair
from codatrain.kernels.cute.gemm_stages import column_norm_weight, rope_freq
from codatrain.kernels.cute.pins import FastAccumEpiMod


class Fp8Epilogue:
    """An FP8 stage's epilogue GEMM (what QuACK's `gemm_epilogue` builds from `fn` and `spec`) in
    both FP8 mainloops; a call of `stage` runs the tile and mainloop configs.fp8_stage_config
    gives for the run's `fast_accum` (block.fp8_fast_accum)."""

    def __init__(self, fn: Callable, **spec: Any) -> None:
        self.promoted, self.fast = EpiMod(fn, **spec), FastAccumEpiMod(fn, **spec)

    def __call__(self, stage: str, fast_accum: bool, *args: Any, **kwargs: Any) -> dict:
        config, fast = fp8_stage_config(stage, fast_accum)
        return (self.fast if fast else self.promoted)(*args, config=config, tuned=False, **kwargs)


def fp8_epilogue(**spec: Any) -> Callable[[Callable], Fp8Epilogue]:
    """`quack.epilogue.frontend.gemm_epilogue` for an FP8 stage: the decorated function becomes an
    `Fp8Epilogue`."""
    return lambda fn: Fp8Epilogue(fn, **spec)


def fp8_column_tiles(n: int, fast_accum: bool) -> int:
    """Column tiles of the FP8 F1/F3 stage over an output of width `n` (its per-tile partials)."""
    return -(-n // fp8_stage_config("fp8_residual_rms", fast_accum)[0].tile_n)


@fp8_epilogue(
    outputs=("resid_out",),
    ops={"gamma": RowVecLoad("gamma"), "ab_inv_scale": Scalar("ab_inv_scale"),
         "h_scale": Scalar("h_scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True), "amax": ColVecReduce("amax", combine="max_abs")},
)
def fp8_residual_rms_epi(acc, c, gamma, ab_inv_scale, h_scale):
    """F1/F3 on FP8 operands: x = acc/(s_a·s_b) + C in ``resid_out``, D = h·s_h with h = x⊙γ
    (stored in D's FP8 format, saturating), per-tile partials of x² and of max |h|."""
    x = acc * ab_inv_scale + c
    h = x * gamma
    return {"D": h * h_scale, "resid_out": x, "sqsum": (x, x), "amax": h}


@cute_op("codatrain::cute_fp8_gemm_residual_rms", mutates_args=("x", "h", "sq_partials", "amax_partials"),
         device_types="cuda")
def fp8_gemm_residual_rms(
    a: Tensor, weight: Tensor, ab_inv_scale: Tensor, residual: Tensor, gamma: Tensor, h_scale: Tensor,
    x: Tensor, h: Tensor, sq_partials: Tensor, amax_partials: Tensor, fast_accum: bool,
) -> None:
    """x = residual + (a·Wᵀ)/(s_a·s_b), h = FP8(x ⊙ γ · h_scale), sq_partials and amax_partials
    (M, fp8_column_tiles) fp32 of x² and max |x ⊙ γ|. a (M, K) and weight (N, K) FP8; `fast_accum`
    the run's block.fp8_fast_accum (as every FP8 stage's)."""
    fp8_residual_rms_epi(
        "fp8_residual_rms", fast_accum, a, weight.t(), residual, out={"D": h, "resid_out": x}, gamma=gamma,
        ab_inv_scale=ab_inv_scale, h_scale=h_scale, sqsum=sq_partials, amax=amax_partials,
    )


def fp8_gemm_residual_rms_outputs(a: Tensor, weight: Tensor, residual: Tensor, h_dtype: torch.dtype,
                                  fast_accum: bool):
    """Allocated outputs (x, h, sq_partials, amax_partials) of `fp8_gemm_residual_rms`."""
    m, n = a.shape[0], weight.shape[0]
    tiles = fp8_column_tiles(n, fast_accum)
    return (torch.empty_like(residual), torch.empty(m, n, dtype=h_dtype, device=a.device),
            torch.empty(m, tiles, dtype=torch.float32, device=a.device),
            torch.empty(m, tiles, dtype=torch.float32, device=a.device))


# F2 stores y in 16 bits: on sm_90 QuACK writes the half-width (gated) output of an acc_pair
# epilogue only in 16-bit types, so y reaches FP8 through `quantize.quantize_fp8`.
@fp8_epilogue(
    outputs=("postact",),
    ops={"rstd": ColVecLoad("rstd"), "ab_inv_scale": Scalar("ab_inv_scale")},
    mode="acc_pair",
)
def fp8_rstd_swiglu_epi(acc, rstd, ab_inv_scale):
    """F2 on FP8 operands: preact = rstd ⊙ acc/(s_a·s_b) in D (gate/up interleaved), y = silu(g)·u
    in ``postact``."""
    g, u = unpack(acc * (rstd * ab_inv_scale))
    return {"D": pack(g, u), "postact": swiglu(g, u)}


@cute_op("codatrain::cute_fp8_gemm_rstd_swiglu", mutates_args=("preact", "y"), device_types="cuda")
def fp8_gemm_rstd_swiglu(
    h: Tensor, weight: Tensor, ab_inv_scale: Tensor, rstd: Tensor, preact: Tensor, y: Tensor, fast_accum: bool
) -> None:
    """preact = rstd ⊙ (h·Wᵀ)/(s_h·s_w) and y = silu(g)·u, h (M, d) and weight (2F, d) FP8."""
    fp8_rstd_swiglu_epi(
        "fp8_rstd_swiglu", fast_accum, h, weight.t(), out={"D": preact, "postact": y}, rstd=rstd,
        ab_inv_scale=ab_inv_scale,
    )


_ROPE_OPS = {"pos": ColVecLoad("pos"), "freq": RowVecLoad("freq"), "rstd": ColVecLoad("rstd"),
             "ab_inv_scale": Scalar("ab_inv_scale")}


@fp8_epilogue(ops=_ROPE_OPS, mode="acc_pair")
def fp8_rstd_rope_epi(acc, pos, freq, rstd, ab_inv_scale):
    """F4 on FP8 operands: QuACK's `rstd_rope_posfreq_epi` (rows scaled by rstd, adjacent pairs
    rotated by pos·freq turns, the angle as a float-float sum) with the sum scaled by 1/(s_a·s_b)."""
    x1, x2 = unpack(acc * (rstd * ab_inv_scale))
    return {"D": rotate_pair(x1, x2, pos, freq)}


@fp8_epilogue(ops={**_ROPE_OPS, "bias": RowVecLoad("bias")}, mode="acc_pair")
def fp8_rstd_bias_rope_epi(acc, pos, freq, rstd, ab_inv_scale, bias):
    """F4 with a QKV bias (Qwen2) on FP8 operands: z = rstd ⊙ acc/(s_a·s_b) + bias, then RoPE."""
    x1, x2 = unpack(acc * (rstd * ab_inv_scale) + bias)
    return {"D": rotate_pair(x1, x2, pos, freq)}


# Qwen3's QK-norm on FP8 operands: the bf16 stage's epilogues (epilogues.rstd_qknorm_rope_epi) with
# the sum scaled by 1/(s_a·s_b) before the head statistic's prepass, which must see the same z.
def _fp8_qknorm_sq(acc, rstd, ab_inv_scale, eps):
    z = acc * (rstd * ab_inv_scale)
    return {"head_rstd": z * z + eps}


def _fp8_qknorm_sq_bias(acc, rstd, ab_inv_scale, bias, eps):
    z = acc * (rstd * ab_inv_scale) + bias
    return {"head_rstd": z * z + eps}


@fp8_epilogue(outputs=("z_even", "z_odd"),
              ops={**qknorm_ops(), "ab_inv_scale": Scalar("ab_inv_scale"),
                   "head_rstd": HeadRstd("head_rstd", eps=0.0)},
              prepass=_fp8_qknorm_sq, prepass_outs=("head_rstd",), mode="acc_pair")
def fp8_rstd_qknorm_rope_epi(acc, pos, freq, rstd, ab_inv_scale, head_rstd, norm_weight, eps):
    """F4 with the QK-norm on FP8 operands: z = rstd ⊙ acc/(s_a·s_b), each q and k head RMS-normed
    and scaled by its norm weight, then RoPE; z written as its pairs' two lanes (`norm_rope`)."""
    return norm_rope(acc * (rstd * ab_inv_scale), pos, freq, head_rstd, norm_weight)


@fp8_epilogue(outputs=("z_even", "z_odd"),
              ops={**qknorm_ops(), "ab_inv_scale": Scalar("ab_inv_scale"), "bias": RowVecLoad("bias"),
                   "head_rstd": HeadRstd("head_rstd", eps=0.0)},
              prepass=_fp8_qknorm_sq_bias, prepass_outs=("head_rstd",), mode="acc_pair")
def fp8_rstd_bias_qknorm_rope_epi(acc, pos, freq, rstd, ab_inv_scale, bias, head_rstd, norm_weight, eps):
    """`fp8_rstd_qknorm_rope_epi` with a QKV bias added before the norm."""
    return norm_rope(acc * (rstd * ab_inv_scale) + bias, pos, freq, head_rstd, norm_weight)


@cute_op("codatrain::cute_fp8_gemm_rstd_rope", mutates_args=("qkv",), device_types="cuda")
def fp8_gemm_rstd_rope(
    h: Tensor, weight: Tensor, ab_inv_scale: Tensor, rstd: Tensor, positions: Tensor, bias: Tensor | None,
    qkv: Tensor, head_dim: int, rope_heads: int, rope_theta: float, rope_type: str, rope_factor: float,
    rope_low_freq_factor: float, rope_high_freq_factor: float, rope_original_max_positions: int,
    fast_accum: bool,
) -> None:
    """qkv = rope(rstd ⊙ (h·Wᵀ)/(s_h·s_w) [+ bias]), h (M, d) and weight (N_qkv, d) FP8; the rope_*
    arguments as in `gemm_stages.gemm_rstd_rope`."""
    freq = rope_freq(head_dim, rope_heads, weight.shape[0], h.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    operands = {"pos": positions.to(torch.float32), "freq": freq, "rstd": rstd, "ab_inv_scale": ab_inv_scale}
    epilogue = fp8_rstd_rope_epi
    if bias is not None:
        epilogue, operands["bias"] = fp8_rstd_bias_rope_epi, aligned16(bias)
    epilogue("fp8_rstd_rope", fast_accum, h, weight.t(), out={"D": qkv}, **operands)


@cute_op("codatrain::cute_fp8_gemm_rstd_qknorm_rope", mutates_args=("qkv", "z_pairs"), device_types="cuda")
def fp8_gemm_rstd_qknorm_rope(
    h: Tensor, weight: Tensor, ab_inv_scale: Tensor, rstd: Tensor, positions: Tensor, bias: Tensor | None,
    q_weight: Tensor, k_weight: Tensor, qkv: Tensor, z_pairs: Tensor, head_dim: int, q_heads: int,
    rope_heads: int, eps: float, rope_theta: float, rope_type: str, rope_factor: float,
    rope_low_freq_factor: float, rope_high_freq_factor: float, rope_original_max_positions: int,
    fast_accum: bool,
) -> None:
    """`gemm_stages.gemm_rstd_qknorm_rope` on FP8 operands h (M, d) and weight (N_qkv, d), the sum
    scaled by 1/(s_h·s_w): qkv and the pre-norm z's column planes z_pairs (2, M, N/2)."""
    n = weight.shape[0]
    freq = rope_freq(head_dim, rope_heads, n, h.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    operands = {"pos": positions.to(torch.float32), "freq": freq, "rstd": rstd, "ab_inv_scale": ab_inv_scale,
                "head_rstd": head_dim, "eps": eps,
                "norm_weight": column_norm_weight(q_weight, k_weight, q_heads, rope_heads, n)}
    epilogue = fp8_rstd_qknorm_rope_epi
    if bias is not None:
        epilogue, operands["bias"] = fp8_rstd_bias_qknorm_rope_epi, aligned16(bias)
    epilogue("fp8_rstd_qknorm_rope", fast_accum, h, weight.t(),
             out={"D": qkv, "z_even": z_pairs[0], "z_odd": z_pairs[1]}, **operands)
