"""The GEMM stages of the CODA backward on QuACK's SM90 GEMM, and the plain dgrad/wgrad GEMMs.

Like the forward (gemm_stages.py), each fused stage is an out-style torch custom op that launches
one QuACK GEMM into the outputs `CuteStages` allocated. The GEMMs with no epilogue to fuse
(dgrad, wgrad) are cuBLAS calls.

Operand orientation: QuACK's torch-facing calls take A (M, K) and B as a (K, N) view. A dgrad
dz·W (W stored (N_out, K_in)) passes W itself as B; a wgrad dzᵀ·a passes the transposed view dzᵀ
as A (M-major) and the activation a as B. No operand is copied.
"""

from __future__ import annotations

import torch
from quack.dsl.torch_library_op import cute_op
from quack.epilogue.library import dswiglu_dpreact_mod
from quack.gemm_config import GemmConfig, cta_tile_shape_m
from quack.gemm_interface import gemm_add_inplace
from torch import Tensor

from codatrain.kernels.cute.common import aligned16
from codatrain.kernels.cute.configs import gemm_config
from codatrain.kernels.cute.epilogues import rms_bwd_epi, rms_bwd_residual_epi

# ---- RMSNorm backward in the consumer's dgrad ----------------------------------------------------


def rms_bwd_row_tiles(m: int, cfg: GemmConfig | None = None) -> int:
    """Row tiles over m rows (its dγ partials) of the RMSNorm backward's GEMM in tile config `cfg`
    (None: the bf16 stage's)."""
    cfg = cfg or gemm_config("rms_bwd")
    tile_m = cta_tile_shape_m(cfg.tile_m, cfg.cluster_m, cfg.device_capacity)
    return (m + tile_m - 1) // tile_m


@cute_op("codatrain::cute_gemm_rms_bwd", mutates_args=("dx", "n", "dgamma_partials"), device_types="cuda")
def gemm_rms_bwd(
    dz: Tensor, weight: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    residual_grad: Tensor | None, dx: Tensor, n: Tensor, dgamma_partials: Tensor,
) -> None:
    """dn = dz·W; dx = rstd·(dn⊙γ − x·rstd·zdz/d) (+ residual_grad), n = rstd·x⊙γ, and dγ
    partials (rms_bwd_row_tiles, d) fp32 over the kernel's row tiles, all from the fp32
    accumulator."""
    epilogue = rms_bwd_epi if residual_grad is None else rms_bwd_residual_epi
    # Passing the dgamma buffer makes QuACK leave the per-row-tile partials as they are; the
    # model sums them (with the other chunks' partials, for the LM head).
    epilogue(
        dz,
        weight,
        residual_grad,
        out={"D": dx, "n": n},
        config=gemm_config("rms_bwd"),
        tuned=False,
        x=x,
        gamma=aligned16(gamma),
        rstd=aligned16(rstd),
        zdz=aligned16(zdz),
        inv_dim=1.0 / x.shape[1],
        dgamma=dgamma_partials,
    )


# ---- dSwiGLU in the down-projection's dgrad -------------------------------------------------------


@cute_op("codatrain::cute_gemm_dswiglu", mutates_args=("dpreact", "y", "zdz"), device_types="cuda")
def gemm_dswiglu(
    dout: Tensor, weight: Tensor, preact: Tensor, dpreact: Tensor, y: Tensor, zdz: Tensor
) -> None:
    """dy = dout·W_down; (dg, du) interleaved like preact, y = silu(g)·u and zdz = Σ g·dg + u·du,
    with g, u read from the pre-activation in the epilogue (GEMM N = F, C and D at 2F)."""
    result = dswiglu_dpreact_mod(
        dout, weight, preact, out={"D": dpreact, "postact": y}, config=gemm_config("dswiglu"), tuned=False
    )
    # QuACK sums the per-column-tile partials of dsum into the (M,) row sum.
    zdz.copy_(result["dsum"])


# ---- plain dgrad and wgrad ----------------------------------------------------------------------
# A GEMM with nothing to fuse goes to cuBLAS: at every shape of the layer it is faster than QuACK's
# default config (untuned, since autotuning has no place in a training step), most of all on the
# out-projection's wgrad, whose small (d × d) output underfills the GPU without split-K
# (docs/benchmarks.md, the "B ... wgrad" rows of scripts/bench_block.py).


def dgrad(dz: Tensor, weight: Tensor) -> Tensor:
    """dz (M, N) · W (N, K) → (M, K)."""
    return torch.mm(dz, weight)


def wgrad(dz: Tensor, a: Tensor) -> Tensor:
    """dzᵀ (N, M) · a (M, K) → (N, K), contracting over the tokens."""
    return torch.mm(dz.t(), a)


@cute_op("codatrain::cute_wgrad_accumulate", mutates_args=("out",), device_types="cuda")
def wgrad_accumulate(dz: Tensor, a: Tensor, out: Tensor) -> None:
    """out (N, K) += dzᵀ·a in place; out may be fp32 (the GEMM's accumulator is added into it
    by the TMA reduce-add store, so the sum is never rounded to the activation dtype)."""
    gemm_add_inplace(dz.t(), a, out, tuned=False)
