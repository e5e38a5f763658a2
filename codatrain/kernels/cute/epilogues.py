"""The GEMM epilogues of the CODA stages that `quack.epilogue.library` does not ship.

Each is a `@gemm_epilogue` function: QuACK calls it once per fp32 accumulator element (or
adjacent-column pair in ``acc_pair`` mode) while the output tile is still in registers, and
mints, compiles and caches one SM90 GEMM kernel per function. The epilogues the stages take
from QuACK as they are:

- F1/F3 `quack.epilogue.library.rms_partial_epi`: D = (acc + C)·γ, aux ``resid_out`` = acc + C,
  per-column-tile partial sums of (acc + C)².
- F4 `quack.epilogue.rotary.rstd_rope_posfreq_epi` (with a QKV bias: `rstd_bias_rope_epi` here):
  rows scaled by rstd, then adjacent pairs rotated by angle pos·freq, with sin/cos computed in the
  epilogue from a per-row position and a per-column frequency (zero frequency on the v columns, so
  they pass through unrotated).
- F4 with Qwen3's QK-norm (`rstd_qknorm_rope_epi` here, `rstd_bias_qknorm_rope_epi` with a QKV
  bias): QuACK's per-head RMS statistic `quack.epilogue.head_rmsnorm.HeadRstd`, summed by an
  accumulator prepass over each head's columns (tiles cover whole heads), then the norm weight
  and the rotation of `rstd_rope_posfreq_epi`.
- dSwiGLU `quack.epilogue.library.dswiglu_dpreact_mod`: acc = dy, C = the (scaled) pre-activation
  pairs (g, u); D = (dg, du) interleaved, ``postact`` = silu(g)·u, ``dsum`` = Σ g·dg + u·du, which
  is exactly the stage API's zdz because the stage API keeps the rstd-scaled pre-activation.

These functions must stay module globals (QuACK re-mints a kernel class in its compile workers
by importing the EpiMod by name) and reference only simple globals: QuACK fingerprints the
function source and everything it references to key its kernel cache.
"""

from __future__ import annotations

import cutlass.cute as cute
from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue, pack, unpack
from quack.epilogue.head_rmsnorm import HeadRstd
from quack.epilogue.ops import (
    ColVecLoad,
    ColVecSelect,
    OnlineLSEReduce,
    RowVecLoad,
    RowVecReduce,
    TileLoad,
)

from codatrain.kernels.cute.pins import sincos_turns


@gemm_epilogue(outputs=("postact",), ops={"rstd": ColVecLoad("rstd")}, mode="acc_pair")
def rstd_swiglu_epi(acc, rstd):
    """F2: scale rows by rstd, store the *scaled* pre-activation (the stage API's ``preact``,
    gate/up interleaved as the accumulator pairs) in D and silu(g)·u in ``postact``.

    QuACK's `rstd_swiglu_preact_epi` stores the unscaled accumulator instead; the stage API
    keeps rstd ⊙ (h·Wᵀ) so that the backward does not need rstd again."""
    g, u = unpack(acc * rstd)
    return {"D": pack(g, u), "postact": swiglu(g, u)}


def rotate_pair(x1, x2, pos, freq):
    """The adjacent pair (x1, x2) rotated by pos·freq turns, as QuACK's `rstd_rope_posfreq_epi`
    rotates it (the angle as a float-float sum of freq's (hi, lo) pair); a packed pair."""
    fh, fl = unpack(freq)
    t = pos * fh
    lo = cute.math.fma(pos, fl, cute.math.fma(pos, fh, -t))
    s, c = sincos_turns(t, lo)
    return pack(x1 * c - x2 * s, x1 * s + x2 * c)


@gemm_epilogue(
    ops={"pos": ColVecLoad("pos"), "freq": RowVecLoad("freq"), "rstd": ColVecLoad("rstd"),
         "bias": RowVecLoad("bias")},
    mode="acc_pair",
)
def rstd_bias_rope_epi(acc, pos, freq, rstd, bias):
    """F4 with a QKV bias (Qwen2): QuACK's `rstd_rope_posfreq_epi` with the bias added after the
    row scale and before the rotation: z = rstd ⊙ acc + bias, then adjacent pairs rotated by
    pos·freq turns."""
    x1, x2 = unpack(acc * rstd + bias)
    return {"D": rotate_pair(x1, x2, pos, freq)}


def norm_rope(z, pos, freq, head_rstd, norm_weight):
    """The QK-norm and RoPE of F4's pre-norm pair z: q and k columns become z·r·γ (r their head's
    rstd, γ = norm_weight), v columns stay z (γ 0, passthrough 1); then adjacent pairs rotate by
    pos·freq turns (`rotate_pair`). z is also written, as the two lanes of each pair: the
    backward reads it.

    The v columns are told apart by their frequency, 0 there and at least ~1e-10 turns on every q
    and k column (any θ < 1e20, any RoPE scaling): one per-column vector fewer than a passthrough
    operand, in an epilogue whose registers spill (scripts/kernel_report.py)."""
    fh, _ = unpack(freq)
    passthrough = 1.0 - cute.arch.fmin(fh * 1e30, 1.0)
    x1, x2 = unpack(z * (head_rstd * norm_weight + passthrough))
    z1, z2 = unpack(z)
    return {"D": rotate_pair(x1, x2, pos, freq), "z_even": z1, "z_odd": z2}


def qknorm_ops() -> dict:
    """The operands of a QK-norm epilogue but its statistic: position, frequency, rstd and the
    per-column norm weight."""
    return {"pos": ColVecLoad("pos"), "freq": RowVecLoad("freq"), "rstd": ColVecLoad("rstd"),
            "norm_weight": RowVecLoad("norm_weight")}


# The per-(row, head) statistic takes ε as a run-time operand rather than as HeadRstd's constant:
# the prepass sums z² + ε over a head's head_dim columns, whose mean is mean z² + ε, so one kernel
# serves every model's ε. Each epilogue owns its op instance, as QuACK's library mods do.
_QKNORM_OPS = qknorm_ops()
_head_rstd = HeadRstd("head_rstd", eps=0.0)
_head_rstd_bias = HeadRstd("head_rstd", eps=0.0)


def _qknorm_sq(acc, rstd, eps):
    z = acc * rstd
    return {"head_rstd": z * z + eps}


def _qknorm_sq_bias(acc, rstd, bias, eps):
    z = acc * rstd + bias
    return {"head_rstd": z * z + eps}


@gemm_epilogue(outputs=("z_even", "z_odd"), ops={**_QKNORM_OPS, "head_rstd": _head_rstd},
               prepass=_qknorm_sq, prepass_outs=("head_rstd",), mode="acc_pair")
def rstd_qknorm_rope_epi(acc, pos, freq, rstd, head_rstd, norm_weight, eps):
    """F4 with Qwen3's QK-norm: z = rstd ⊙ acc, each q and k head RMS-normed (its rstd from the
    prepass, `eps` folded into it) and scaled by its norm weight, then RoPE (`norm_rope`)."""
    return norm_rope(acc * rstd, pos, freq, head_rstd, norm_weight)


@gemm_epilogue(outputs=("z_even", "z_odd"),
               ops={**_QKNORM_OPS, "bias": RowVecLoad("bias"), "head_rstd": _head_rstd_bias},
               prepass=_qknorm_sq_bias, prepass_outs=("head_rstd",), mode="acc_pair")
def rstd_bias_qknorm_rope_epi(acc, pos, freq, rstd, bias, head_rstd, norm_weight, eps):
    """`rstd_qknorm_rope_epi` with a QKV bias added before the norm: z = rstd ⊙ acc + bias."""
    return norm_rope(acc * rstd + bias, pos, freq, head_rstd, norm_weight)


@gemm_epilogue(ops={"rstd": ColVecLoad("rstd")})
def rstd_epi(acc, rstd):
    """Row-scaled GEMM: D = rstd ⊙ acc (full logits of the LM head, outside training)."""
    return {"D": acc * rstd}


# The per-row target column, staged by the companion load that ColVecSelect reads; the function
# itself never sees it.
_target_index = ColVecLoad("target")


@gemm_epilogue(
    ops={"rstd": ColVecLoad("rstd")},
    outs={
        "lse": OnlineLSEReduce("lse"),
        "target_logit": ColVecSelect("target_logit", idx_op=_target_index),
    },
    extra_ops=(_target_index,),
)
def rstd_lse_target_epi(acc, rstd):
    """LM head for the loss: logits = rstd ⊙ acc feed an online (max, sum) log-sum-exp per
    column tile and the select of each row's target logit. Called without a D tensor, so the
    M×V logits never reach memory (the per-tile LSE partials are M × V/tile_n floats)."""
    logits = acc * rstd
    return {"lse": logits, "target_logit": logits}


# ---- backward ------------------------------------------------------------------------------------

# The RMSNorm-backward epilogue of the dgrad GEMM dn = dz·W of a norm's consumer (docs/design.md §3, the ZdZ
# identity). Operands: x the residual stream the norm read (a tile load), γ, and per row rstd and
# the raw zdz = Σ z·dz of the consumer; inv_dim = 1/d turns zdz into the ZdZ of docs/design.md §3. Outputs:
# D = dx = rstd·(dn⊙γ − x·rstd·ZdZ) [+ C, the residual-path gradient], ``n`` = rstd·x⊙γ (the
# A operand of the consumer's wgrad) and per-row-tile partials of dγ = Σ_m dn·x·rstd.
# Two functions because an absent C must be absent from the signature to be compiled out.
_RMS_BWD_OPS = {
    "x": TileLoad("x"),
    "gamma": RowVecLoad("gamma"),
    "rstd": ColVecLoad("rstd"),
    "zdz": ColVecLoad("zdz"),
}


@gemm_epilogue(outputs=("n",), ops=_RMS_BWD_OPS, reduces={"dgamma": RowVecReduce("dgamma", scaled=True)})
def rms_bwd_epi(acc, x, gamma, rstd, zdz, inv_dim):
    """RMSNorm backward with no residual path (the final norm, before the LM head)."""
    xr = x * rstd
    return {"D": rstd * (acc * gamma - xr * (zdz * inv_dim)), "n": xr * gamma, "dgamma": (acc, xr)}


@gemm_epilogue(outputs=("n",), ops=_RMS_BWD_OPS, reduces={"dgamma": RowVecReduce("dgamma", scaled=True)})
def rms_bwd_residual_epi(acc, c, x, gamma, rstd, zdz, inv_dim):
    """RMSNorm backward plus the residual-path gradient C of the same x."""
    xr = x * rstd
    return {"D": rstd * (acc * gamma - xr * (zdz * inv_dim)) + c, "n": xr * gamma, "dgamma": (acc, xr)}
