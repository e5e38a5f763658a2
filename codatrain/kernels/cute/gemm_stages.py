"""The GEMM + epilogue forward stages of the CODA block on QuACK's SM90 GEMM.

Each stage is a torch custom op (`codatrain::cute_*`, see torch_op.py) whose fake implementation
only allocates the outputs, so `torch.compile` traces a model through the stages without graph
breaks and without compiling kernels at trace time. The real implementation allocates the
outputs and launches one QuACK epilogue GEMM into them; QuACK compiles each (epilogue, config,
dtypes) kernel once and keeps it in its on-disk cache.

Weights arrive (out, in) as the model stores them; QuACK's torch-facing call takes B as a
(K, N) view, so `weight.t()` passes the same memory with no copy.
"""

from __future__ import annotations

import functools
import math

import torch
from quack.epilogue.library import rms_partial_epi
from quack.epilogue.rotary import make_interleaved_inv_freq, rstd_rope_posfreq_epi
from quack.gemm_config import GemmConfig
from quack.rms_final_reduce import rms_final_reduce
from torch import Tensor

from codatrain.kernels.cute.epilogues import rstd_epi, rstd_lse_target_epi, rstd_swiglu_epi
from codatrain.kernels.cute.torch_op import stage_op
from codatrain.kernels.stages import rope_inv_freq


def sm90_config(tile_m: int, tile_n: int, *, pingpong: bool, cluster_m: int, cluster_n: int) -> GemmConfig:
    """A Hopper GEMM config with the static persistent tile scheduler (QuACK's SM90 default)."""
    return GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        pingpong=pingpong,
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        is_dynamic_persistent=False,
        device_capacity=9,
    )


# GEMM config of each stage, the fastest of `scripts/bench_block.py --sweep` on an H200 at
# Llama-3-8B widths, M = 8192 (docs/benchmarks.md). QuACK keys its launch cache on the config
# object's identity, so these stay module constants.
_PINGPONG_128x192 = sm90_config(128, 192, pingpong=True, cluster_m=2, cluster_n=1)
_PINGPONG_192x128 = sm90_config(192, 128, pingpong=True, cluster_m=1, cluster_n=2)
CONFIGS: dict[str, GemmConfig] = {
    "residual_rms": _PINGPONG_128x192,
    "rstd_swiglu": _PINGPONG_192x128,
    "rstd_rope": _PINGPONG_192x128,
    "rstd": _PINGPONG_128x192,
    "rstd_lse": _PINGPONG_128x192,
}


def _empty(*shape: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


# ---- F1 / F3: GEMM + residual + x² partials + γ ------------------------------------------------


def _residual_rms_outputs(a: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    m, n = a.shape[0], weight.shape[0]
    tiles = math.ceil(n / CONFIGS["residual_rms"].tile_n)
    return _empty(m, n, like=a), _empty(m, n, like=a), _empty(m, tiles, like=a, dtype=torch.float32)


def _residual_rms_fake(a: Tensor, weight: Tensor, residual: Tensor, gamma: Tensor):
    return _residual_rms_outputs(a, weight)


@stage_op("cute_gemm_residual_rms", _residual_rms_fake)
def gemm_residual_rms(
    a: Tensor, weight: Tensor, residual: Tensor, gamma: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """x = residual + a·Wᵀ, h = x ⊙ γ, sq_partials (M, ceil(d / tile_n)) fp32 of x².

    The epilogue sums x² of the fp32 value before it is rounded to the output dtype."""
    x, h, sq_partials = _residual_rms_outputs(a, weight)
    # Passing the `sqsum` buffer makes QuACK return the raw per-column-tile partials (it would
    # otherwise sum them on the host); the R stage folds them into rstd.
    rms_partial_epi(
        a,
        weight.t(),
        residual,
        out={"D": h, "resid_out": x},
        config=CONFIGS["residual_rms"],
        tuned=False,
        weight=gamma,
        sqsum=sq_partials,
    )
    return x, h, sq_partials


# ---- R: rstd from the partials -----------------------------------------------------------------


def rstd_from_partials(sq_partials: Tensor, *, dim: int, eps: float) -> Tensor:
    """rstd (M,) fp32 = (Σ_p sq_partials / dim + eps)^-1/2, one row per thread group."""
    return rms_final_reduce(sq_partials.contiguous(), 1.0 / dim, eps)


# ---- F2: gate/up GEMM · rstd + SwiGLU ----------------------------------------------------------


def _swiglu_outputs(h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    m, n = h.shape[0], weight.shape[0]
    return _empty(m, n, like=h), _empty(m, n // 2, like=h)


def _swiglu_fake(h: Tensor, weight: Tensor, rstd: Tensor):
    return _swiglu_outputs(h, weight)


@stage_op("cute_gemm_rstd_swiglu", _swiglu_fake)
def gemm_rstd_swiglu(h: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """preact = rstd ⊙ (h·Wᵀ) (gate/up interleaved) and y = silu(g)·u from the fp32 accumulator."""
    preact, y = _swiglu_outputs(h, weight)
    rstd_swiglu_epi(
        h, weight.t(), out={"D": preact, "postact": y}, config=CONFIGS["rstd_swiglu"], tuned=False, rstd=rstd
    )
    return preact, y


# ---- F4: QKV GEMM · rstd + RoPE ----------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def rope_freq(head_dim: int, rope_heads: int, n: int, rope_theta: float, device: torch.device) -> Tensor:
    """Per-column inverse frequency as QuACK's float-float table (hi, lo per pair, in turns):
    pair i of each of the first rope_heads heads gets rope_theta^(-2i/head_dim), the v columns
    zero (angle 0 is an exact identity). Built in fp64, once per shape."""
    inv_freq = rope_inv_freq(head_dim, rope_theta)
    rope_cols = rope_heads * head_dim
    return make_interleaved_inv_freq(inv_freq, rope_cols, n - rope_cols).to(device)


def _rope_fake(h, weight, rstd, positions, head_dim, rope_heads, rope_theta):
    return _empty(h.shape[0], weight.shape[0], like=h)


@stage_op("cute_gemm_rstd_rope", _rope_fake)
def _gemm_rstd_rope(
    h: Tensor,
    weight: Tensor,
    rstd: Tensor,
    positions: Tensor,
    head_dim: int,
    rope_heads: int,
    rope_theta: float,
) -> Tensor:
    qkv = _empty(h.shape[0], weight.shape[0], like=h)
    rstd_rope_posfreq_epi(
        h,
        weight.t(),
        out={"D": qkv},
        config=CONFIGS["rstd_rope"],
        tuned=False,
        # Positions are exact in fp32 up to 2^24; the epilogue forms the angle in float-float.
        pos=positions.to(torch.float32),
        freq=rope_freq(head_dim, rope_heads, weight.shape[0], rope_theta, h.device),
        rstd=rstd,
    )
    return qkv


def gemm_rstd_rope(
    h: Tensor,
    weight: Tensor,
    rstd: Tensor,
    positions: Tensor,
    *,
    head_dim: int,
    rope_heads: int,
    rope_theta: float,
) -> Tensor:
    """qkv = rope(rstd ⊙ (h·Wᵀ)) on adjacent pairs of the first rope_heads heads."""
    return _gemm_rstd_rope(h, weight, rstd, positions, head_dim, rope_heads, float(rope_theta))


# ---- LM head: GEMM · rstd (logits), or · rstd + LSE + target logit (loss) ---------------------


def _rstd_fake(h: Tensor, weight: Tensor, rstd: Tensor):
    return _empty(h.shape[0], weight.shape[0], like=h)


@stage_op("cute_gemm_rstd", _rstd_fake)
def gemm_rstd(h: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
    """z = rstd ⊙ (h·Wᵀ)."""
    z = _empty(h.shape[0], weight.shape[0], like=h)
    rstd_epi(h, weight.t(), out={"D": z}, config=CONFIGS["rstd"], tuned=False, rstd=rstd)
    return z


def _lse_fake(h, weight, rstd, targets, ignore_index):
    return _empty(h.shape[0], like=h, dtype=torch.float32), _empty(h.shape[0], like=h, dtype=torch.float32)


@stage_op("cute_gemm_rstd_lse", _lse_fake)
def _gemm_rstd_lse(
    h: Tensor, weight: Tensor, rstd: Tensor, targets: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    m, vocab = h.shape[0], weight.shape[0]
    # Per-column-tile (max-shifted) log-sum-exps, folded below: M × V/tile_n floats.
    lse_partials = _empty(m, math.ceil(vocab / CONFIGS["rstd_lse"].tile_n), like=h, dtype=torch.float32)
    target_logit = _empty(m, like=h, dtype=torch.float32)
    # The select writes only rows whose index lies in [0, V); ignored rows get a zero below.
    valid = targets != ignore_index
    rstd_lse_target_epi(
        h,
        weight.t(),
        store_d=False,
        config=CONFIGS["rstd_lse"],
        tuned=False,
        rstd=rstd,
        target=torch.where(valid, targets, -1),
        lse=lse_partials,
        target_logit=target_logit,
    )
    return torch.logsumexp(lse_partials, dim=-1), torch.where(valid, target_logit, 0.0)


def gemm_rstd_lse(
    h: Tensor, weight: Tensor, rstd: Tensor, targets: Tensor, *, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """lse and target logit (M,) fp32 of logits = rstd ⊙ (h·Wᵀ), which never reach memory."""
    return _gemm_rstd_lse(h, weight, rstd, targets, ignore_index)
