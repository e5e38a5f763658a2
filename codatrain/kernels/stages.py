"""The stage API of the CODA block (docs/design.md §3): one method per forward and per backward stage.

A CODA layer is a short sequence of *GEMM + epilogue* stages, attention, and tiny row
reductions. This module fixes what every stage takes and returns; backends implement it:

- ``reference`` (`codatrain.kernels.reference`): pure PyTorch, any device, the specification.
- ``cute`` (`codatrain.kernels.cute`): CuTeDSL/QuACK kernels for sm_90 GPUs.

Conventions shared by every stage
---------------------------------
- Activations are 2-D row-major ``(M, N)`` tensors, one row per token (M = B·T). Weights are
  ``(out, in)`` as stored in the model, so a GEMM computes ``D = A·Wᵀ``.
- All floating tensors passed to one call (activations and weights) share one dtype, the
  *activation dtype* (bf16 in training, fp32/fp64 in tests). Per-row and per-column statistics
  (``sq_partials``, ``rstd``, ``zdz``, ``lse``, ``target_logit``, ``dgamma_partials``, the
  head's ``loss``, ``dgamma`` and ``dweight``) use the *statistics dtype*
  `stat_dtype(activation dtype)`: fp32 for 16-bit inputs, the input dtype otherwise.
- Layouts are the CODA layouts, not the canonical (HF) ones: gate/up weight rows are interleaved
  ``[g0, u0, g1, u1, …]``; inside each q and k head the RoPE pairs are adjacent columns
  ``(2i, 2i+1)``, rotated by angle ``position · rope_inv_freq(head_dim, rope)[i]`` as
  ``(a, b) → (a·cos − b·sin, a·sin + b·cos)``. The fused QKV columns are
  ``[q heads | k heads | v heads]``, each head ``head_dim`` wide; the first ``rope_heads`` heads
  (h_q + h_kv) are rotated, the v heads are not.
- RMSNorm is split as in docs/design.md §3: the stage that produces the residual stream ``x`` writes
  ``h = x ⊙ γ`` and partial sums of x²; `rstd_from_partials` turns them into
  ``rstd = (mean_j x_j² + ε)^-1/2``; the consuming GEMM multiplies its accumulator rows by rstd.
- ``zdz`` is always the raw row dot product ``zdz[m] = Σ_n z[m, n] · dz[m, n]`` between the
  output ``z`` of the GEMM that consumes a norm and its gradient ``dz``. `gemm_rms_bwd` divides
  it by the norm width d (the ZdZ of docs/design.md §3 = zdz / d).
- No stage keeps state between calls; every input and output is explicit.

FP8 (block.precision=fp8; the numerics are `codatrain.kernels.fp8`'s)
-----------------------------------------------------------------------
- Every GEMM stage (the four layer GEMMs' forward, dgrad and wgrad: `gemm_rstd_rope`,
  `gemm_residual_rms`, `gemm_rstd_swiglu`, `gemm_rms_bwd(_fp8)`, `gemm_dswiglu`, `dgrad`,
  `wgrad`) takes both of its GEMM operands as `Fp8Tensor`s (data in FP8, its scale a 0-d fp32
  tensor) in place of activation-dtype tensors; it accumulates in fp32, multiplies by
  1/(s_a·s_b) and writes its outputs in the operands' nominal `Fp8Tensor.dtype`. Weights come
  from `quantize` (current scaling, once per optimizer step).
- A stage that produces a GEMM operand writes it in FP8 when asked by its ``*_fp8`` argument, a
  `QuantizeTo` (the format and the scale, a 0-d fp32 tensor, or None for current scaling): that
  output is then an `Fp8Tensor` carrying the amax of the values it quantized (its epilogue's
  fp32 values, rounded once to FP8). Producers: `entry` (h), `gemm_residual_rms` (h),
  `gemm_rstd_swiglu` (y), `rope_bwd` (dz), `gemm_rms_bwd_fp8` (n, and dx beside its
  activation-dtype copy), `gemm_dswiglu` (dpreact, y); `quantize` casts what no stage produces
  (attention's output, the LM head's dx, weights).
- Without ``*_fp8`` arguments and FP8 operands every stage is exactly the bf16 stage. Both
  backends have the FP8 forms; the cute stages take FP8 operands 16-byte aligned in both
  orientations (every size a multiple of 16).

Registering a backend
---------------------
A backend is a `StageBackend` subclass instance. Its module registers it on import with one line::

    register_backend("cute", CuteStages())

`get_backend(name, device)` imports the module that provides ``name`` (see `_PROVIDERS`) when it
is not registered yet. ``auto`` is not a backend: `codatrain.kernels.resolve.resolve_block`
decides it once, before a model is built.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, TypeVar

import torch

from codatrain.kernels.fp8 import Fp8Recipe, Fp8Tensor, QuantizeTo

T = TypeVar("T")

# Targets with this value count in no loss (PyTorch's cross-entropy default), in every model.
IGNORE_INDEX = -100

# Rows of the LM head processed at once (`lm_head_ce`) are chosen so that one chunk of logits
# (then dlogits, in place) holds at most about this many elements (512M: 1 GiB in bf16; 4096 rows
# at V = 128256), a fraction of the M×V logits (and their fp32 copies) an eager head keeps. Bigger
# chunks make the chunk's three GEMMs longer: the weight-gradient GEMM contracts over the chunk's
# rows and adds its V×d result into the fp32 dW once per chunk, which at a few hundred rows costs
# more than its arithmetic (docs/benchmarks.md measures the chunk sizes).
HEAD_CHUNK_ELEMENTS = 1 << 29
# Chunks are whole multiples of a 2-CTA cluster of 128-row tiles (so no tile is partly empty)
# and their per-row statistics start on 16-byte boundaries.
HEAD_CHUNK_MULTIPLE = 256


class RopeType(StrEnum):
    """RoPE's frequency schedules, named as Hugging Face's `rope_type`."""

    default = "default"  # θ^(-2i/d_h)
    linear = "linear"  # every rate divided by `factor` (position interpolation)
    llama3 = "llama3"  # Llama 3.1's: long wavelengths divided by `factor`, short ones kept, smoothed between


@dataclass(frozen=True)
class Rope:
    """What fixes RoPE's per-pair rotation rates: the base θ and the scaling (`rope_inv_freq`).
    Hashable, so a kernel's frequency table can be cached per value."""

    theta: float
    type: RopeType = RopeType.default
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3: the context length the model was pretrained at


def rope_inv_freq(head_dim: int, rope: Rope, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp64 (head_dim/2,): the rotation rate of RoPE pair i, theta^(-2i/head_dim) scaled as
    `rope.type` says (the formulas of transformers' ROPE_INIT_FUNCTIONS)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / rope.theta ** exponents
    if rope.type == RopeType.linear:
        return inv_freq / rope.factor
    if rope.type == RopeType.llama3:
        wavelength = 2 * math.pi / inv_freq
        context = rope.original_max_positions
        # Wavelengths longer than context / low_freq_factor are slowed by the factor, those shorter
        # than context / high_freq_factor kept; in between the two blend linearly in context / wavelength.
        smooth = ((context / wavelength - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    return inv_freq


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of statistics for activations of `dtype`: fp32 for 16-bit floats, else `dtype`."""
    return torch.promote_types(dtype, torch.float32)


# ---- stage outputs ---------------------------------------------------------------------------


class EntryOut(NamedTuple):
    x: torch.Tensor  # (M, d) activation dtype: the embedded tokens, the residual stream x0
    h: torch.Tensor | Fp8Tensor  # (M, d) activation dtype: x ⊙ γ_attn of layer 0 (FP8 with h_fp8)
    rstd: torch.Tensor  # (M,) stat dtype: (mean x² + ε)^-1/2 of x


class ResidualOut(NamedTuple):
    x: torch.Tensor  # (M, d) activation dtype: residual + A·Wᵀ, the new residual stream
    h: torch.Tensor | Fp8Tensor  # (M, d) activation dtype: x ⊙ γ, the next GEMM's A operand (FP8 with h_fp8)
    sq_partials: torch.Tensor  # (M, P) stat dtype: column-tile partial sums of x², Σ_p = Σ_j x_j²


class SwigluOut(NamedTuple):
    preact: torch.Tensor  # (M, 2F) activation dtype: rstd ⊙ (h·W_guᵀ), gate/up interleaved
    y: torch.Tensor | Fp8Tensor  # (M, F) activation dtype: silu(g) · u (FP8 with y_fp8)


class LseOut(NamedTuple):
    lse: torch.Tensor  # (M,) stat dtype: log Σ_v exp(logit_v)
    target_logit: torch.Tensor  # (M,) stat dtype: logit of the target; 0 where ignored


class RopeBwdOut(NamedTuple):
    dz: torch.Tensor | Fp8Tensor  # (M, N_qkv) activation dtype: gradient before RoPE (rotated back; FP8
    # with dz_fp8)
    zdz: torch.Tensor  # (M,) stat dtype: Σ_n (z − bias)·dz over all N_qkv columns (= Σ qkv·dqkv
    # without a bias): the ZdZ of the attention norm, whose GEMM output is z less the bias


class QkNormOut(NamedTuple):
    qkv: torch.Tensor  # (M, N_qkv) activation dtype: attention's input, as `gemm_rstd_rope` writes it
    z: torch.Tensor  # activation dtype: the pre-norm z = rstd ⊙ (h·Wᵀ) + bias that the backend's own
    # `qknorm_rope_bwd` reads, in its layout: the reference's (M, rope_heads·head_dim), the q and k
    # columns in column order; the cute backend's (2, M, N_qkv/2), the even and the odd column of
    # every RoPE pair, v columns included, as its epilogue writes them


class QkNormBwdOut(NamedTuple):
    dz: torch.Tensor  # (M, N_qkv) activation dtype: gradient of the GEMM output before the QK-norm
    zdz: torch.Tensor  # (M,) stat dtype: Σ_n (z − bias)·dz over all N_qkv columns (the attention
    # norm's ZdZ; RoPE is orthogonal but the QK-norm is not, so this is not Σ qkv·dqkv)
    dq_weight: torch.Tensor  # (head_dim,) stat dtype: gradient of the q heads' norm weight
    dk_weight: torch.Tensor  # (head_dim,) stat dtype: gradient of the k heads' norm weight


class HeadLossOut(NamedTuple):
    """The LM head's per-row loss and the gradients of Σ loss. The gradients are linear in the
    upstream gradient of Σ loss, which backward learns only later (a mean taken outside, gradient
    accumulation): computed here for a unit upstream gradient, they are scaled by it then."""

    loss: torch.Tensor  # (M,) stat dtype: lse − target logit; 0 where the target is ignored
    dx: torch.Tensor  # (M, d) activation dtype: ∂(Σ loss)/∂x, x the final norm's input
    dgamma: torch.Tensor  # (d,) stat dtype: ∂(Σ loss)/∂γ_final
    # ∂(Σ loss)/∂W_head (V, d) = dweight + last_dlogitsᵀ·last_n; `lm_head_dweight` forms it,
    # scaled and rounded, in one pass. A backend may leave its last chunk's weight-gradient GEMM to
    # that call (last_dlogits (rows, V) and last_n (rows, d) in the activation dtype), which saves
    # a read and write of the V×d stat-dtype sum; then dweight holds the other chunks (None if
    # there are none). Without a pending chunk, last_dlogits and last_n are None.
    dweight: torch.Tensor | None  # (V, d) stat dtype, summed over chunks unrounded
    last_dlogits: torch.Tensor | None
    last_n: torch.Tensor | None


class RmsBwdFp8Out(NamedTuple):
    dx: torch.Tensor  # (M, d) activation dtype: as RmsBwdOut.dx
    dx_fp8: Fp8Tensor | None  # (M, d): dx as an FP8 operand, when asked for
    n: Fp8Tensor  # (M, d): the recomputed normed input as the wgrad's FP8 operand
    dgamma_partials: torch.Tensor  # (P_m, d) stat dtype: as RmsBwdOut.dgamma_partials


class RmsBwdOut(NamedTuple):
    dx: torch.Tensor  # (M, d) activation dtype: gradient of the residual stream x
    n: torch.Tensor  # (M, d) activation dtype: the recomputed normed input rstd ⊙ x ⊙ γ
    dgamma_partials: torch.Tensor  # (P_m, d) stat dtype: row-tile partial sums of dγ; Σ over dim 0 = dγ


class DSwigluOut(NamedTuple):
    dpreact: torch.Tensor | Fp8Tensor  # (M, 2F) activation dtype: (dg, du) interleaved like preact
    y: torch.Tensor | Fp8Tensor  # (M, F) activation dtype: silu(g) · u recomputed, the A operand of dW_down
    zdz: torch.Tensor  # (M,) stat dtype: Σ_f (g·dg + u·du)


# ---- the stage interface ---------------------------------------------------------------------


class StageBackend(ABC):
    """One implementation of every CODA stage. Subclasses implement all abstract methods.

    Forward of one middle layer (docs/design.md §3): `gemm_residual_rms` (F1, out-proj) →
    `rstd_from_partials` (R1) → `gemm_rstd_swiglu` (F2) → `gemm_residual_rms` (F3, down) →
    `rstd_from_partials` (R2) → `gemm_rstd_rope` (F4, next layer's QKV) → attention.
    The model starts with `entry` + `gemm_rstd_rope` and ends with `lm_head_ce` (training: the loss
    and the head's gradients at once), `gemm_rstd_lse` (the loss alone, e.g. validation) or
    `gemm_rstd` (logits). The backward stages mirror the layers.
    """

    name: str

    def unsupported_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None when it can."""
        return None

    def for_fp8(self, recipe: Fp8Recipe) -> StageBackend:
        """This backend as a run of FP8 recipe `recipe` uses it (the kernels of some backends depend
        on the recipe; by default none do)."""
        del recipe
        return self

    def head_chunk_rows(self, vocab_size: int) -> int:
        """Rows per chunk of `lm_head_ce` for a vocabulary of `vocab_size`: about
        HEAD_CHUNK_ELEMENTS logits, in whole HEAD_CHUNK_MULTIPLEs."""
        rows = HEAD_CHUNK_ELEMENTS // vocab_size
        return max(HEAD_CHUNK_MULTIPLE, rows - rows % HEAD_CHUNK_MULTIPLE)

    # ---- forward ---------------------------------------------------------------------------

    @abstractmethod
    def entry(
        self,
        tokens: torch.Tensor,
        embedding: torch.Tensor,
        gamma: torch.Tensor,
        *,
        eps: float,
        h_fp8: QuantizeTo | None = None,
    ) -> EntryOut:
        """Model entry: embedding lookup and the first attention norm's statistics.

        tokens (M,) int64 token ids; embedding (V, d) and gamma (d,) = γ_attn of layer 0, in the
        activation dtype. Returns x = embedding[tokens], h = x ⊙ γ, rstd = (mean_j x_j² + eps)^-1/2.
        h_fp8: h is written as an `Fp8Tensor` (the QKV GEMM's FP8 operand).
        """

    @abstractmethod
    def gemm_residual_rms(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        gamma: torch.Tensor,
        *,
        h_fp8: QuantizeTo | None = None,
    ) -> ResidualOut:
        """F1 (out-projection) and F3 (down-projection): GEMM + residual add + norm statistics.

        a (M, K); weight (d, K); residual (M, d); gamma (d,) of the norm that follows.
        Returns x = residual + a·Wᵀ, h = x ⊙ γ and sq_partials (M, P): partial sums of x² (of x
        as written) over P ≥ 1 column tiles, as the backend's GEMM tiles them. Consumers rely
        only on Σ_p sq_partials[:, p]. a and weight may be `Fp8Tensor`s; h_fp8: h is written as
        an `Fp8Tensor` (the next GEMM's FP8 operand).
        """

    @abstractmethod
    def rstd_from_partials(self, sq_partials: torch.Tensor, *, dim: int, eps: float) -> torch.Tensor:
        """R: rstd (M,) = (Σ_p sq_partials[:, p] / dim + eps)^-1/2, in the stat dtype."""

    @abstractmethod
    def gemm_rstd_swiglu(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                         y_fp8: QuantizeTo | None = None) -> SwigluOut:
        """F2: row-scaled gate/up GEMM with SwiGLU.

        h (M, d); weight (2F, d) with gate/up rows interleaved; rstd (M,).
        Returns preact = rstd ⊙ (h·Wᵀ) (M, 2F), kept for the backward, and y = silu(g)·u (M, F)
        with g = preact[:, 0::2], u = preact[:, 1::2]. h and weight may be `Fp8Tensor`s;
        y_fp8: y is written as an `Fp8Tensor` (from the unrounded preact, as the bf16 y).
        """

    @abstractmethod
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
        """F4: row-scaled QKV GEMM with RoPE on the q and k heads.

        h (M, d); weight (N_qkv, d) in the CODA layout (RoPE pairs adjacent); rstd (M,);
        positions (M,) int64 position of each token within its sequence; rope: θ and the scaling
        that give pair i its rate `rope_inv_freq(head_dim, rope)[i]`; bias (N_qkv,) or None: the
        QKV bias (Qwen2), in the weight's row order, added before RoPE.
        Returns qkv (M, N_qkv) = rope(z), z = rstd ⊙ (h·Wᵀ) + bias, rotating adjacent pairs of the
        first rope_heads·head_dim columns (module docstring); the v columns pass through.
        h and weight may be `Fp8Tensor`s; qkv stays in the activation dtype (attention's input).
        """

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
        """F4 with Qwen3's QK-norm between the GEMM (and bias) and RoPE.

        As `gemm_rstd_rope`, but each of the first q_heads heads of z = rstd ⊙ (h·Wᵀ) + bias is
        RMS-normed and scaled by q_weight, each of the next rope_heads − q_heads (the k heads) by
        k_weight: n = z·(mean_j z_j² + eps)^-1/2 ⊙ γ over each head's head_dim columns, then RoPE.
        q_weight and k_weight (head_dim,) are in the CODA column order (RoPE pairs adjacent).
        Returns qkv and the pre-norm z (`QkNormOut`). The stage backend's own default
        refuses: a backend has the QK-norm when it overrides this and `qknorm_rope_bwd`.
        """
        raise NotImplementedError(f"stage backend {self.name!r} has no QK-norm epilogue")

    @abstractmethod
    def gemm_rstd(self, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        """Row-scaled GEMM without a further epilogue: z = rstd ⊙ (h·Wᵀ). Used for full logits
        (the model's forward without targets), not in training."""

    @abstractmethod
    def gemm_rstd_lse(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        targets: torch.Tensor,
        *,
        ignore_index: int = IGNORE_INDEX,
    ) -> LseOut:
        """LM head: row-scaled GEMM whose epilogue reduces log-sum-exp and the target logit.

        h (M, d) = x ⊙ γ_final; weight (V, d); rstd (M,); targets (M,) int64.
        logits = rstd ⊙ (h·Wᵀ) are never kept whole: at most a chunk of rows at a time.
        Returns lse (M,) and target_logit (M,), 0 where targets == ignore_index. The loss of a
        row is lse − target_logit.
        """

    @abstractmethod
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
        """Final RMSNorm, LM head and cross-entropy, forward and backward in one pass (the fused
        linear cross-entropy order): per chunk of `chunk_rows` rows, the logits GEMM once, then
        LSE, target logit, loss and dlogits in place of the logits, the dgrad and the weight
        gradient right away. Neither M×V logits nor a second logits GEMM ever exist.

        x (M, d) the residual stream the final norm reads; gamma (d,) = γ_final; weight (V, d);
        targets (M,) int64. With n = rstd ⊙ x ⊙ γ (rstd = (mean x² + eps)^-1/2) and logits = n·Wᵀ:
        dlogits = softmax(logits) − onehot(target) (zero rows where ignored), dn = dlogits·W,
        dW = Σ_chunks dlogitsᵀ·n, and the norm backward dx = rstd ⊙ (dn ⊙ γ − x ⊙ rstd · zdz/d)
        with zdz = Σ_k n·dn (= Σ_v logits·dlogits, the ZdZ identity), dγ = Σ_m dn ⊙ x ⊙ rstd.
        Returns `HeadLossOut` for a unit gradient of Σ loss; its weight gradient may be left
        partly to `lm_head_dweight`.
        """

    @abstractmethod
    def lm_head_dweight(
        self,
        dweight: torch.Tensor | None,
        last_dlogits: torch.Tensor | None,
        last_n: torch.Tensor | None,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The LM head's weight gradient for an upstream gradient `scale` (a 0-d stat-dtype tensor)
        of Σ loss, from `lm_head_ce`'s parts: scale · (dweight + last_dlogitsᵀ·last_n), (V, d) in
        `dtype` (the weight's), rounded once."""

    # ---- backward --------------------------------------------------------------------------

    @abstractmethod
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
        """Backward of F4's RoPE epilogue, with the ZdZ of the attention norm.

        dqkv (M, N_qkv) from attention's backward; qkv (M, N_qkv) the F4 output; positions, RoPE
        arguments and bias as in `gemm_rstd_rope`. Returns dz = the gradient rotated back by
        −angle and zdz = Σ_n qkv·dqkv, which equals Σ_n z·dz because RoPE is orthogonal; with a
        bias, zdz = Σ_n (z − bias)·dz (the norm's GEMM output excludes it; `bias_grad` gives
        the bias's own gradient). dz_fp8: dz is written as an `Fp8Tensor` (the QKV dgrad's and
        wgrad's FP8 operand; zdz is still formed from the unrounded values).
        """

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
        """Backward of `gemm_rstd_qknorm_rope`'s epilogue: RoPE rotated back, then the QK-norm's
        backward per head (with r the head's rstd, x̂ = z·r, dn the rotated-back gradient:
        dz = r·(dn⊙γ − x̂·mean_j(x̂_j·dn_j·γ_j))), and the attention norm's ZdZ.

        dqkv (M, N_qkv); qkv the stage's output (its v columns are z's); z the forward's `QkNormOut.z`
        (this backend's layout); the other arguments as in the forward.
        """
        raise NotImplementedError(f"stage backend {self.name!r} has no QK-norm epilogue")

    def bias_grad(self, dz: torch.Tensor) -> torch.Tensor:
        """The gradient (N,) of a bias added to a GEMM output whose gradient is dz (M, N): Σ_m dz,
        summed in the stat dtype (Qwen2's QKV bias)."""
        raise NotImplementedError(f"stage backend {self.name!r} has no bias epilogue")

    @abstractmethod
    def row_dot(self, z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        """zdz (M,) = Σ_n z·dz in the stat dtype: the ZdZ of a norm consumed by `gemm_rstd`."""

    @abstractmethod
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
        """RMSNorm backward in the epilogue of the dgrad GEMM of the norm's consumer (ZdZ identity).

        dz (M, N) gradient of the consumer's output z = rstd ⊙ ((x⊙γ)·Wᵀ); weight (N, d) the
        consumer's weight; x (M, d) the residual stream the norm read; gamma (d,); rstd (M,);
        zdz (M,) = Σ_n z·dz from the stage that produced dz; residual_grad (M, d) or None: the
        gradient reaching x through the residual path, added in the epilogue.
        With dn = dz·W: dx = rstd ⊙ (dn ⊙ γ − x ⊙ rstd · zdz/d) + residual_grad;
        n = rstd ⊙ x ⊙ γ (the A operand of the consumer's wgrad dW = dzᵀ·n);
        dgamma_partials (P_m, d): sums of dn ⊙ x ⊙ rstd over P_m ≥ 1 row tiles, as the backend's
        GEMM tiles them; dγ = dgamma_partials.sum(0). Consumers rely only on that sum.
        dz and weight may be `Fp8Tensor`s (`gemm_rms_bwd_fp8` also writes FP8 outputs).
        """

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
        """`gemm_rms_bwd` on FP8 operands, writing n as an `Fp8Tensor` (the consumer's wgrad
        operand) and, with dx_fp8, dx twice: in the activation dtype (the residual path, the
        embedding) and as an `Fp8Tensor` (the operand of the GEMMs whose output gradient it is)."""
        raise NotImplementedError(f"stage backend {self.name!r} has no FP8 stages")

    @abstractmethod
    def gemm_dswiglu(self, dout: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, *,
                     dpreact_fp8: QuantizeTo | None = None, y_fp8: QuantizeTo | None = None,
                     reuse_preact: bool = False) -> DSwigluOut:
        """Down-projection dgrad with the SwiGLU backward in its epilogue, and the MLP norm's ZdZ.

        dout (M, d) gradient of the down-projection output (the residual-stream gradient);
        weight (d, F) = W_down; preact (M, 2F) from `gemm_rstd_swiglu`.
        With dy = dout·W: dg = dy·u·silu'(g), du = dy·silu(g). Returns dpreact (interleaved like
        preact), y = silu(g)·u recomputed for dW_down = doutᵀ·y, and zdz = Σ_f (g·dg + u·du).
        dout and weight may be `Fp8Tensor`s (outputs in preact's dtype); dpreact_fp8 and y_fp8
        write dpreact and y as `Fp8Tensor`s (zdz from the unrounded values). The recomputed y
        takes the scale the forward's y had. `reuse_preact`: the caller reads preact no more, and
        its memory may hold dpreact's FP8 copies or be freed (a backend that keeps no such
        copies ignores it).
        """

    @abstractmethod
    def dgrad(self, dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Plain dgrad GEMM: dz (M, N), weight (N, K) → dz·W (M, K) (the out-projection's); both
        may be `Fp8Tensor`s."""

    @abstractmethod
    def wgrad(
        self, dz: torch.Tensor, a: torch.Tensor, *, accumulate_into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Plain wgrad GEMM: dz (M, N), a (M, K) → dzᵀ·a (N, K).

        With accumulate_into (N, K), adds the product into it in place and returns it (used to
        sum the LM-head weight gradient over row chunks); it may have the stat dtype, so that the
        sum over chunks is not rounded to the activation dtype at every step. dz and a may be
        `Fp8Tensor`s (the four layer GEMMs' weight gradients).
        """

    def quantize(self, x: torch.Tensor, to: QuantizeTo) -> Fp8Tensor:
        """x (any shape, activation dtype) as an `Fp8Tensor` standing for x's dtype, with its amax:
        the cast of a GEMM operand no stage epilogue writes (attention's output, the LM head's dx)
        and of the weights (current scaling, once per optimizer step)."""
        raise NotImplementedError(f"stage backend {self.name!r} has no FP8 stages")

    @abstractmethod
    def entry_bwd(self, dx: torch.Tensor, tokens: torch.Tensor, *, num_embeddings: int) -> torch.Tensor:
        """Embedding backward: dx (M, d), tokens (M,) → dembedding (num_embeddings, d) in dx's dtype,
        row v = Σ of dx rows whose token is v (accumulated in the stat dtype)."""


# ---- registry --------------------------------------------------------------------------------


class BackendUnavailableError(RuntimeError):
    """A stage backend (or attention implementation) was asked for but cannot run here."""


_BACKENDS: dict[str, StageBackend] = {}

# The module whose import registers each backend. `cute` needs the cuda extras
# (`pip install 'codatrain[cuda]'`) and registers itself in codatrain/kernels/cute/__init__.py.
_PROVIDERS = {"reference": "codatrain.kernels.reference", "cute": "codatrain.kernels.cute"}


def register_backend(name: str, backend: StageBackend) -> None:
    """Make `backend` available as `name` (called once by the backend's module on import)."""
    backend.name = name
    _BACKENDS[name] = backend


def load_registered(kind: str, name: str, registry: dict[str, T], providers: dict[str, str], hint: str) -> T:
    """`registry[name]`, first importing the module that registers it (`providers[name]`) if needed.

    Shared by the stage backends and the attention implementations; `kind` names them in errors.
    """
    if name not in registry:
        if name not in providers:
            known = ", ".join(sorted({*providers, *registry}))
            raise ValueError(f"unknown {kind} {name!r}; known: {known}")
        try:
            importlib.import_module(providers[name])
        except ImportError as exc:
            raise BackendUnavailableError(f"{kind} {name!r} is unavailable: {exc}. {hint}") from exc
        if name not in registry:
            raise BackendUnavailableError(
                f"{kind} {name!r} is unavailable: {providers[name]} did not register it. {hint}"
            )
    return registry[name]


def _load(name: str) -> StageBackend:
    hint = (
        "It needs an sm_90 GPU and the cuda extras (pip install 'codatrain[cuda]'); "
        "block.backend=reference runs anywhere."
    )
    return load_registered("stage backend", name, _BACKENDS, _PROVIDERS, hint)


def is_sm90(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.0 (Hopper), the target of the cute kernels."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def get_backend(name: str, device: torch.device | str | None = None) -> StageBackend:
    """The stage backend `name` (reference | cute) for tensors on `device`.

    Raises BackendUnavailableError when the backend cannot be loaded, or cannot run on `device`
    (None: not checked, as for a model built on the meta device).
    """
    backend = _load(name)
    if device is None:
        return backend
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = backend.unsupported_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"stage backend {name!r} cannot run on {device}: {reason}")
    return backend
