"""The GEMM stages of the CODA backward on QuACK's SM90 GEMM, and the plain dgrad/wgrad GEMMs.

Like the forward (gemm_stages.py), each fused stage is a torch custom op whose fake implementation
only allocates the outputs, and whose real implementation launches one QuACK GEMM into them. The
GEMMs with no epilogue to fuse (dgrad, wgrad) are cuBLAS calls.

Operand orientation: QuACK's torch-facing calls take A (M, K) and B as a (K, N) view. A dgrad
dz·W (W stored (N_out, K_in)) passes W itself as B; a wgrad dzᵀ·a passes the transposed view dzᵀ
as A (M-major) and the activation a as B. No operand is copied.
"""

from __future__ import annotations

import math

import torch
from quack.epilogue.library import dswiglu_dpreact_mod
from quack.gemm_config import cta_tile_shape_m
from quack.gemm_interface import gemm_add_inplace
from torch import Tensor

from codatrain.kernels.cute.epilogues import rms_bwd_epi, rms_bwd_residual_epi, rstd_ce_bwd_epi
from codatrain.kernels.cute.gemm_stages import sm90_config
from codatrain.kernels.cute.torch_op import stage_op

# Tile configs from `scripts/bench_block.py --sweep Bdswiglu Brms_gu Brms_qkv Bce` on an H200 at
# Llama-3.2-1B (M = 32768) and Llama-3-8B (M = 16384) widths (docs/benchmarks.md). dSwiGLU's
# epilogue reads the pre-activation and writes two tensors per output element of a short (K = d)
# mainloop; 128×128 tiles hide that traffic behind the next tile's mainloop far better than
# 192×128 (1.14 against 1.78 × the GEMM alone at 1B widths).
# The RMSNorm backward's largest instance (the gate/up dgrad, K = 2F) is fastest at 192×128 at
# both widths; the smaller QKV dgrad is equal there at 1B and 6% slower at 8B.
# Module constants: QuACK keys its launch cache on the config object's identity.
_PINGPONG_128x192 = sm90_config(128, 192, pingpong=True, cluster_m=2, cluster_n=1)
_PINGPONG_192x128 = sm90_config(192, 128, pingpong=True, cluster_m=1, cluster_n=2)
_PINGPONG_128x128 = sm90_config(128, 128, pingpong=True, cluster_m=1, cluster_n=2)
CONFIGS = {
    "rms_bwd": _PINGPONG_192x128,
    "dswiglu": _PINGPONG_128x128,
    "ce_bwd": _PINGPONG_128x192,
}


def _empty(*shape: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _aligned(vector: Tensor) -> Tensor:
    """`vector`, copied if it does not start on a 16-byte boundary. QuACK's row/column vector
    loads assume that alignment (they move 16-byte vectors), and the LM-head backward passes row
    slices of per-row statistics, which start wherever the chunk does."""
    return vector if vector.data_ptr() % 16 == 0 else vector.clone()


# ---- RMSNorm backward in the consumer's dgrad ----------------------------------------------------


def _rms_bwd_outputs(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    m, d = x.shape
    cfg = CONFIGS["rms_bwd"]
    tiles = math.ceil(m / cta_tile_shape_m(cfg.tile_m, cfg.cluster_m, cfg.device_capacity))
    return _empty(m, d, like=x), _empty(m, d, like=x), _empty(tiles, d, like=x, dtype=torch.float32)


def _rms_bwd_fake(dz, weight, x, gamma, rstd, zdz, residual_grad):
    return _rms_bwd_outputs(x)


@stage_op("cute_gemm_rms_bwd", _rms_bwd_fake)
def _gemm_rms_bwd(
    dz: Tensor, weight: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    residual_grad: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, n, dgamma_partials = _rms_bwd_outputs(x)
    epilogue = rms_bwd_epi if residual_grad is None else rms_bwd_residual_epi
    # Passing the dgamma buffer makes QuACK leave the per-row-tile partials as they are; the
    # model sums them (with the other chunks' partials, for the LM head).
    epilogue(
        dz,
        weight,
        residual_grad,
        out={"D": dx, "n": n},
        config=CONFIGS["rms_bwd"],
        tuned=False,
        x=x,
        gamma=_aligned(gamma),
        rstd=_aligned(rstd),
        zdz=_aligned(zdz),
        inv_dim=1.0 / x.shape[1],
        dgamma=dgamma_partials,
    )
    return dx, n, dgamma_partials


def gemm_rms_bwd(
    dz: Tensor, weight: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    residual_grad: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dn = dz·W; dx = rstd·(dn⊙γ − x·rstd·zdz/d) (+ residual_grad), n = rstd·x⊙γ, and dγ
    partials (P_m, d) fp32 over the kernel's row tiles, all from the fp32 accumulator."""
    return _gemm_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)


# ---- dSwiGLU in the down-projection's dgrad -------------------------------------------------------


def _dswiglu_outputs(preact: Tensor) -> tuple[Tensor, Tensor]:
    m, f2 = preact.shape
    return _empty(m, f2, like=preact), _empty(m, f2 // 2, like=preact)


def _dswiglu_fake(dout, weight, preact):
    return *_dswiglu_outputs(preact), _empty(preact.shape[0], like=preact, dtype=torch.float32)


@stage_op("cute_gemm_dswiglu", _dswiglu_fake)
def gemm_dswiglu(dout: Tensor, weight: Tensor, preact: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dy = dout·W_down; (dg, du) interleaved like preact, y = silu(g)·u and zdz = Σ g·dg + u·du,
    with g, u read from the pre-activation in the epilogue (GEMM N = F, C and D at 2F)."""
    dpreact, y = _dswiglu_outputs(preact)
    result = dswiglu_dpreact_mod(
        dout, weight, preact, out={"D": dpreact, "postact": y}, config=CONFIGS["dswiglu"], tuned=False
    )
    # QuACK sums the per-column-tile partials of dsum into the (M,) row sum.
    return dpreact, y, result["dsum"]


# ---- cross-entropy backward of the LM head ------------------------------------------------------


def _ce_bwd_fake(h, weight, rstd, targets, lse, grad_scale, ignore_index):
    m = h.shape[0]
    return _empty(m, weight.shape[0], like=h), _empty(m, like=h, dtype=torch.float32)


@stage_op("cute_gemm_rstd_ce_bwd", _ce_bwd_fake)
def _gemm_rstd_ce_bwd(
    h: Tensor, weight: Tensor, rstd: Tensor, targets: Tensor, lse: Tensor, grad_scale: Tensor,
    ignore_index: int,
) -> tuple[Tensor, Tensor]:
    m = h.shape[0]
    dlogits = _empty(m, weight.shape[0], like=h)
    valid = targets != ignore_index
    scale = torch.where(valid, grad_scale, 0.0).to(torch.float32)
    # The select writes only rows whose target lies in [0, V): ignored rows keep this zero.
    target_logit = torch.zeros(m, dtype=torch.float32, device=h.device)
    result = rstd_ce_bwd_epi(
        h,
        weight.t(),
        out={"D": dlogits},
        config=CONFIGS["ce_bwd"],
        tuned=False,
        rstd=_aligned(rstd),
        lse=_aligned(lse),
        scale=scale,
        target=torch.where(valid, targets, -1),
        target_logit=target_logit,
    )
    # The one-hot term −scale at each row's target column: the epilogue wrote scale·p_t there,
    # rewrite it as scale·(p_t − 1) from the fp32 target logit (one rounding, as in the
    # reference), and take scale·ℓ_t off Σ ℓ·dℓ. Ignored rows have scale 0: they write 0 to
    # column 0, which already holds 0.
    column = torch.where(valid, targets, 0)[:, None]
    onehot_grad = scale * torch.expm1(target_logit - lse)
    dlogits.scatter_(1, column, onehot_grad[:, None].to(dlogits.dtype))
    return dlogits, result["zdz"] - scale * target_logit


def gemm_rstd_ce_bwd(
    h: Tensor, weight: Tensor, rstd: Tensor, targets: Tensor, lse: Tensor, grad_scale: Tensor,
    *, ignore_index: int,
) -> tuple[Tensor, Tensor]:
    """dlogits = grad_scale·(softmax(rstd ⊙ h·Wᵀ) − onehot(target)) (zero on ignored rows) and
    zdz = Σ_v logits·dlogits, with the logits recomputed in the GEMM and never written."""
    return _gemm_rstd_ce_bwd(h, weight, rstd, targets, lse, grad_scale, ignore_index)


# ---- plain dgrad and wgrad ----------------------------------------------------------------------
# A GEMM with nothing to fuse goes to cuBLAS: at every shape of the layer it is faster than QuACK's
# default config (untuned, since autotuning has no place in a training step), by up to 1.6× on
# the out-projection's wgrad, whose small (d × d) output underfills the GPU without split-K
# (docs/benchmarks.md, the "B ... wgrad" rows of scripts/bench_block.py).


def dgrad(dz: Tensor, weight: Tensor) -> Tensor:
    """dz (M, N) · W (N, K) → (M, K)."""
    return torch.mm(dz, weight)


def wgrad(dz: Tensor, a: Tensor) -> Tensor:
    """dzᵀ (N, M) · a (M, K) → (N, K), contracting over the tokens."""
    return torch.mm(dz.t(), a)


def _wgrad_accumulate_fake(dz, a, out):
    return None


@stage_op("cute_wgrad_accumulate", _wgrad_accumulate_fake, mutates_args=("out",))
def wgrad_accumulate(dz: Tensor, a: Tensor, out: Tensor) -> None:
    """out (N, K) += dzᵀ·a in place; out may be fp32 (the GEMM's accumulator is added into it
    by the TMA reduce-add store, so the sum is never rounded to the activation dtype)."""
    gemm_add_inplace(dz.t(), a, out, tuned=False)
