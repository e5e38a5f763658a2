"""The GEMM epilogues of the CODA forward stages that `quack.epilogue.library` does not ship.

Each is a `@gemm_epilogue` function: QuACK calls it once per fp32 accumulator element (or
adjacent-column pair in ``acc_pair`` mode) while the output tile is still in registers, and
mints, compiles and caches one SM90 GEMM kernel per function. The epilogues the stages take
from QuACK as they are:

- F1/F3 `quack.epilogue.library.rms_partial_epi`: D = (acc + C)·γ, aux ``resid_out`` = acc + C,
  per-column-tile partial sums of (acc + C)².
- F4 `quack.epilogue.rotary.rstd_rope_posfreq_epi`: rows scaled by rstd, then adjacent pairs
  rotated by angle pos·freq, with sin/cos computed in the epilogue from a per-row position and a
  per-column frequency (zero frequency on the v columns, so they pass through unrotated).

These functions must stay module globals (QuACK re-mints a kernel class in its compile workers
by importing the EpiMod by name) and reference only simple globals: QuACK fingerprints the
function source and everything it references to key its kernel cache.
"""

from __future__ import annotations

from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue, pack, unpack
from quack.epilogue.ops import ColVecLoad, ColVecSelect, OnlineLSEReduce


@gemm_epilogue(outputs=("postact",), ops={"rstd": ColVecLoad("rstd")}, mode="acc_pair")
def rstd_swiglu_epi(acc, rstd):
    """F2: scale rows by rstd, store the *scaled* pre-activation (the stage API's ``preact``,
    gate/up interleaved as the accumulator pairs) in D and silu(g)·u in ``postact``.

    QuACK's `rstd_swiglu_preact_epi` stores the unscaled accumulator instead; the stage API
    keeps rstd ⊙ (h·Wᵀ) so that the backward does not need rstd again."""
    g, u = unpack(acc * rstd)
    return {"D": pack(g, u), "postact": swiglu(g, u)}


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
