"""The GEMM + epilogue forward stages of the CODA block on QuACK's SM90 GEMM.

Each stage is an out-style torch custom op (`codatrain::cute_*`, QuACK's `cute_op`): `CuteStages`
allocates the outputs, and the op launches one QuACK epilogue GEMM into them. QuACK compiles
each (epilogue, config, dtypes) kernel once and keeps it in its on-disk cache; the tile configs
are in configs.py.

Weights arrive (out, in) as the model stores them; QuACK's torch-facing call takes B as a
(K, N) view, so `weight.t()` passes the same memory with no copy.
"""

from __future__ import annotations

import functools

import torch
from quack.dsl.torch_library_op import cute_op
from quack.epilogue.library import rms_partial_epi
from quack.epilogue.rotary import make_interleaved_inv_freq, rstd_rope_posfreq_epi
from quack.rms_final_reduce import rms_final_reduce
from torch import Tensor

from codatrain.kernels.cute.common import aligned16, empty
from codatrain.kernels.cute.configs import gemm_config
from codatrain.kernels.cute.epilogues import (
    rstd_bias_qknorm_rope_epi,
    rstd_bias_rope_epi,
    rstd_epi,
    rstd_lse_target_epi,
    rstd_qknorm_rope_epi,
    rstd_swiglu_epi,
)
from codatrain.kernels.stages import Rope, RopeType, rope_inv_freq


def column_tiles(stage: str, n: int) -> int:
    """Column tiles of `stage`'s GEMM over an output of width `n` (its per-tile partials)."""
    tile_n = gemm_config(stage).tile_n
    return (n + tile_n - 1) // tile_n


# ---- F1 / F3: GEMM + residual + x² partials + γ ------------------------------------------------


def residual_rms_stage(k: int, n: int) -> str:
    """The config key of a residual + RMS GEMM of K = `k` into N = `n` columns: F1 (out-proj,
    K ≤ N) and F3 (down-proj, K = F > N) tile differently (configs.py)."""
    return "residual_rms_short_k" if k <= n else "residual_rms"


@cute_op("codatrain::cute_gemm_residual_rms", mutates_args=("x", "h", "sq_partials"), device_types="cuda")
def gemm_residual_rms(
    a: Tensor, weight: Tensor, residual: Tensor, gamma: Tensor, x: Tensor, h: Tensor, sq_partials: Tensor
) -> None:
    """x = residual + a·Wᵀ, h = x ⊙ γ, sq_partials (M, column_tiles) fp32 of x².

    The epilogue sums x² of the fp32 value before it is rounded to the output dtype."""
    # Passing the `sqsum` buffer makes QuACK return the raw per-column-tile partials (it would
    # otherwise sum them on the host); the R stage folds them into rstd.
    rms_partial_epi(
        a,
        weight.t(),
        residual,
        out={"D": h, "resid_out": x},
        config=gemm_config(residual_rms_stage(a.shape[1], weight.shape[0])),
        tuned=False,
        weight=gamma,
        sqsum=sq_partials,
    )


# ---- R: rstd from the partials -----------------------------------------------------------------


def rstd_from_partials(sq_partials: Tensor, *, dim: int, eps: float) -> Tensor:
    """rstd (M,) fp32 = (Σ_p sq_partials / dim + eps)^-1/2, one row per thread group."""
    return rms_final_reduce(sq_partials.contiguous(), 1.0 / dim, eps)


# ---- F2: gate/up GEMM · rstd + SwiGLU ----------------------------------------------------------


@cute_op("codatrain::cute_gemm_rstd_swiglu", mutates_args=("preact", "y"), device_types="cuda")
def gemm_rstd_swiglu(h: Tensor, weight: Tensor, rstd: Tensor, preact: Tensor, y: Tensor) -> None:
    """preact = rstd ⊙ (h·Wᵀ) (gate/up interleaved) and y = silu(g)·u from the fp32 accumulator."""
    rstd_swiglu_epi(
        h, weight.t(), out={"D": preact, "postact": y}, config=gemm_config("rstd_swiglu"), tuned=False,
        rstd=rstd,
    )


# ---- F4: QKV GEMM · rstd + RoPE ----------------------------------------------------------------


# Custom ops take tensors and scalars only: a `Rope` crosses them as its fields, in order.
RopeArgs = tuple[float, str, float, float, float, int]


def rope_args(rope: Rope) -> RopeArgs:
    """`rope` as the scalar arguments of the RoPE custom ops (`rope_freq` turns them back)."""
    return (rope.theta, rope.type.value, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_positions)


@functools.lru_cache(maxsize=16)
def rope_freq(head_dim: int, rope_heads: int, n: int, device: torch.device, *rope: object) -> Tensor:
    """Per-column inverse frequency as QuACK's float-float table (hi, lo per pair, in turns):
    pair i of each of the first rope_heads heads gets rope_inv_freq(head_dim, Rope(*rope))[i],
    the v columns zero (angle 0 is an exact identity). Built in fp64, once per shape and RoPE."""
    theta, rope_type, *scaling = rope
    inv_freq = rope_inv_freq(head_dim, Rope(theta, RopeType(rope_type), *scaling))
    # Every rotated pair's frequency is positive (θ > 0 and the scaling factors, as LlamaConfig
    # checks them): zero marks the v columns, which the QK-norm epilogue passes (`_norm_rope`).
    rope_cols = rope_heads * head_dim
    return make_interleaved_inv_freq(inv_freq, rope_cols, n - rope_cols).to(device)


@cute_op("codatrain::cute_gemm_rstd_rope", mutates_args=("qkv",), device_types="cuda")
def gemm_rstd_rope(
    h: Tensor, weight: Tensor, rstd: Tensor, positions: Tensor, bias: Tensor | None, qkv: Tensor,
    head_dim: int, rope_heads: int, rope_theta: float, rope_type: str, rope_factor: float,
    rope_low_freq_factor: float, rope_high_freq_factor: float, rope_original_max_positions: int,
) -> None:
    """qkv = rope(rstd ⊙ (h·Wᵀ) [+ bias]) on adjacent pairs of the first rope_heads heads; the
    rope_* arguments are `rope_args` of the model's `Rope`."""
    freq = rope_freq(head_dim, rope_heads, weight.shape[0], h.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    # Positions are exact in fp32 up to 2^24; the epilogue forms the angle in float-float.
    operands = {"pos": positions.to(torch.float32), "freq": freq, "rstd": rstd}
    if bias is None:
        rstd_rope_posfreq_epi(h, weight.t(), out={"D": qkv}, config=gemm_config("rstd_rope"), tuned=False,
                              **operands)
    else:
        rstd_bias_rope_epi(h, weight.t(), out={"D": qkv}, config=gemm_config("rstd_rope"), tuned=False,
                           bias=aligned16(bias), **operands)


def column_norm_weight(q_weight: Tensor, k_weight: Tensor, q_heads: int, rope_heads: int, n: int) -> Tensor:
    """fp32 (n,): the QK-norm weight of each QKV column, q_weight on the q heads, k_weight on the k
    heads, 0 on the v columns. Two launches: it is rebuilt at every forward (the weights change
    each step), and a host path that outlasts the GPU's queue shows in the step."""
    head_dim = q_weight.shape[0]
    columns = empty(n // head_dim, head_dim, like=q_weight, dtype=torch.float32)
    torch.cat((q_weight.expand(q_heads, head_dim), k_weight.expand(rope_heads - q_heads, head_dim)),
              out=columns[:rope_heads])
    columns[rope_heads:].zero_()
    return columns.view(n)


@cute_op("codatrain::cute_gemm_rstd_qknorm_rope", mutates_args=("qkv", "z_pairs"), device_types="cuda")
def gemm_rstd_qknorm_rope(
    h: Tensor, weight: Tensor, rstd: Tensor, positions: Tensor, bias: Tensor | None, q_weight: Tensor,
    k_weight: Tensor, qkv: Tensor, z_pairs: Tensor, head_dim: int, q_heads: int, rope_heads: int, eps: float,
    rope_theta: float, rope_type: str, rope_factor: float, rope_low_freq_factor: float,
    rope_high_freq_factor: float, rope_original_max_positions: int,
) -> None:
    """qkv = rope(QK-norm(rstd ⊙ (h·Wᵀ) [+ bias])) and z_pairs (2, M, N/2): the pre-norm z, the even
    columns of each RoPE pair in z_pairs[0], the odd in z_pairs[1] (QuACK's paired epilogue writes
    extra outputs one value per pair). q_weight, k_weight (head_dim,): the norm weights of the
    q_heads q heads and of the rope_heads − q_heads k heads; the rope_* arguments as in
    `gemm_rstd_rope`."""
    n = weight.shape[0]
    freq = rope_freq(head_dim, rope_heads, n, h.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    operands = {"pos": positions.to(torch.float32), "freq": freq, "rstd": rstd, "head_rstd": head_dim,
                "norm_weight": column_norm_weight(q_weight, k_weight, q_heads, rope_heads, n), "eps": eps}
    epilogue = rstd_qknorm_rope_epi
    if bias is not None:
        epilogue, operands["bias"] = rstd_bias_qknorm_rope_epi, aligned16(bias)
    epilogue(h, weight.t(), out={"D": qkv, "z_even": z_pairs[0], "z_odd": z_pairs[1]},
             config=gemm_config("rstd_qknorm_rope"), tuned=False, **operands)


# ---- LM head: GEMM · rstd (logits), or · rstd + LSE + target logit (loss) ---------------------


@cute_op("codatrain::cute_gemm_rstd", mutates_args=("z",), device_types="cuda")
def gemm_rstd(h: Tensor, weight: Tensor, rstd: Tensor, z: Tensor) -> None:
    """z = rstd ⊙ (h·Wᵀ)."""
    rstd_epi(h, weight.t(), out={"D": z}, config=gemm_config("rstd"), tuned=False, rstd=rstd)


@cute_op("codatrain::cute_gemm_rstd_lse", mutates_args=("lse", "target_logit"), device_types="cuda")
def gemm_rstd_lse(
    h: Tensor, weight: Tensor, rstd: Tensor, targets: Tensor, lse: Tensor, target_logit: Tensor,
    ignore_index: int,
) -> None:
    """lse and target logit (M,) fp32 of logits = rstd ⊙ (h·Wᵀ), which never reach memory;
    target_logit 0 where targets == ignore_index."""
    # Per-column-tile (max-shifted) log-sum-exps, folded below: M × V/tile_n floats.
    lse_partials = empty(h.shape[0], column_tiles("rstd_lse", weight.shape[0]), like=h, dtype=torch.float32)
    # The select writes only rows whose index lies in [0, V); ignored rows get a zero below.
    valid = targets != ignore_index
    rstd_lse_target_epi(
        h,
        weight.t(),
        store_d=False,
        config=gemm_config("rstd_lse"),
        tuned=False,
        rstd=rstd,
        target=torch.where(valid, targets, -1),
        lse=lse_partials,
        target_logit=target_logit,
    )
    torch.logsumexp(lse_partials, dim=-1, out=lse)
    target_logit.masked_fill_(~valid, 0.0)
