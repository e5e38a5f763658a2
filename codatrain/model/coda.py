"""The CODA Llama: the same model as `codatrain.model.llama.Llama`, computed as GEMM + epilogue stages.

Every memory-bound operator (RMSNorm, RoPE, residual adds, SwiGLU, the LM-head cross-entropy)
runs inside a stage of `codatrain.kernels.stages` (docs/design.md §3). Custom autograd Functions call the
forward stages and, in backward, the backward stages: autograd never differentiates through
stage math, only through attention, which sits between Functions.

Module structure follows the stage boundaries. F3 (down-projection) writes h = x ⊙ γ for the
*next* layer's attention norm and F4 is the next layer's QKV GEMM, so each module owns the
parameters its stages touch ("shifted" layers), and FSDP2 can shard one module at a time (the
QKV bias b_qkv of Qwen2 goes with its weight, into F4's epilogue before RoPE):

    entry     embedding, γ_attn₀, W_qkv₀ (b_qkv₀)                             entry → F4₀
    layers[i] W_oᵢ, γ_mlpᵢ, W_guᵢ, W_downᵢ, γ_attnᵢ₊₁, W_qkvᵢ₊₁ (b_qkvᵢ₊₁)
                                                           attention → F1 R1 F2 F3 R2 → F4ᵢ₊₁
    last      W_o, γ_mlp, W_gu, W_down, γ_final, W_lm_head    attention → F1 R1 F2 F3 R2 → LM head

With tied embeddings one (V, d) matrix is the entry's embedding and the last layer's head. It
belongs to neither: `CodaLlama` owns it and hands it to both, so FSDP2 gathers it in the root's
group for the whole step (per-block groups could not share it), and autograd adds the head's
weight gradient into the embedding's.

The checkpoint format stays canonical (eager names and layouts): `CodaLlama.layout()` maps each
parameter to its canonical tensor and row order (RoPE pairs adjacent inside each q/k head, gate/up
rows interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from codatrain.kernels.attention import AttentionFn, Documents, causal_attention, forward_documents
from codatrain.kernels.fp8 import Fp8Recipe, Fp8Scaling, Fp8Step, Fp8Tensor, Fp8Weight, Operand, QuantizeTo
from codatrain.kernels.resolve import ResolvedBlock, portable_block
from codatrain.kernels.stages import IGNORE_INDEX, Rope, StageBackend
from codatrain.model.config import LlamaConfig
from codatrain.model.init import init_canonical_weights
from codatrain.model.layout import Canonical, Layout


@dataclass(frozen=True)
class _Consts:
    """Non-tensor stage arguments fixed by the model config."""

    dim: int
    eps: float
    head_dim: int
    q_heads: int
    rope_heads: int
    rope_config: Rope

    @property
    def rope(self) -> dict:
        return {"head_dim": self.head_dim, "rope_heads": self.rope_heads, "rope": self.rope_config}


@dataclass(frozen=True)
class ForwardStep:
    """What every module needs for one forward pass (`of`), made once per forward by `CodaLlama`
    and by whoever runs one module alone (scripts/bench_block.py)."""

    stages: StageBackend
    attention: AttentionFn
    positions: torch.Tensor  # (M,) int64: position of each token row within its sequence (its
    # document, when there are documents)
    batch: int
    documents: Documents | None = None  # attention stays within these documents when given
    fp8: Fp8Step | None = None  # the layer GEMMs' FP8 scales and amax records (block.precision=fp8)

    @classmethod
    def of(
        cls, stages: StageBackend, attention: AttentionFn, batch: int, seq_len: int, device: torch.device,
        documents: Documents | None = None, fp8: Fp8Step | None = None,
    ) -> ForwardStep:
        """The step of `batch` sequences of `seq_len` tokens on `device`, rows in sequence order,
        packed with `documents` (None: each row is one sequence)."""
        if torch.is_autocast_enabled(device.type):
            # The stages compute in the parameters' dtype, which FSDP2's MixedPrecisionPolicy sets
            # (codatrain/train/parallelize.py); custom Functions under autocast would mix dtypes.
            raise RuntimeError("the CODA model computes in its parameters' dtype and does not run "
                               "under torch.autocast: give it parameters of the compute dtype")
        if documents is None:
            positions = torch.arange(seq_len, device=device).repeat(batch)
        else:
            positions = documents.positions
        return cls(
            stages=stages,
            attention=attention,
            positions=positions,
            batch=batch,
            documents=documents,
            fp8=fp8,
        )


def _dgamma(partials: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return partials.sum(0).to(gamma.dtype)


# ---- FP8 (block.precision=fp8): which operand a stage writes in FP8, and its amax ----------------
# With `f` None (bf16) the stages get no FP8 argument and the weights stay as they are.


def _fp8_arg(f: Fp8Step | None, layer: int, operand: Operand, key: str) -> dict[str, QuantizeTo]:
    """The keyword that asks a producer stage for `operand` in FP8, or none."""
    return {} if f is None else {key: f.to(layer, operand)}


def _record(f: Fp8Step | None, layer: int, operand: Operand, quantized: Fp8Tensor) -> None:
    if f is not None:
        f.record(layer, operand, quantized)


def _weights(s: StageBackend, f: Fp8Step | None, *weights: torch.Tensor, for_dgrad: bool,
             scales: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor | Fp8Tensor]:
    """The GEMM operands of `weights` in the forward or (`for_dgrad`) the backward: FP8 copies from
    their current amax, or the weights. The backward passes the forward's `scales` (`_scales`):
    the weights have not changed since, so their amax has not either, and a pass over them is
    saved. A weight FSDP2 gathered in FP8 (`Fp8Weight`) is its own operand: quantized by the same
    rule before the gather, with the same scale in forward and backward."""
    if f is None:
        return list(weights)
    tos = [f.recipe.weight(for_dgrad=for_dgrad)] * len(weights)
    if scales is not None:
        tos = [to._replace(scale=scale) for to, scale in zip(tos, scales, strict=True)]
    return [w.operand(for_dgrad=for_dgrad) if isinstance(w, Fp8Weight) else s.quantize(w, to)
            for w, to in zip(weights, tos, strict=True)]


def _scales(quantized: list[torch.Tensor | Fp8Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The FP8 scales (0-d) of the forward's weight operands, for the backward's `_weights`; Nones
    without FP8."""
    return tuple(w.scale if isinstance(w, Fp8Tensor) else None for w in quantized)


def _wgrad_fp8(f: Fp8Step | None) -> bool:
    """Whether the weight gradients multiply FP8 operands (else activation-dtype tensors)."""
    return f is not None and f.recipe.wgrad_fp8


def _rows_alone(to: QuantizeTo) -> QuantizeTo:
    """`to` without the token-contiguous copy the recipe may ask for."""
    return QuantizeTo(to.dtype, to.scale, to.margin)


def _quantize(s: StageBackend, f: Fp8Step | None, layer: int, operand: Operand,
              x: torch.Tensor, *, transposed: bool = True) -> torch.Tensor | Fp8Tensor:
    """x as a GEMM operand that no stage epilogue writes (attention's output, the head's dx);
    `transposed=False` leaves out the token-contiguous copy the recipe would ask for."""
    if f is None:
        return x
    to = f.to(layer, operand)
    quantized = s.quantize(x, to if transposed else _rows_alone(to))
    _record(f, layer, operand, quantized)
    return quantized


# ---- the MLP half of a shifted layer, shared by the middle and the last layer ------------------


def _mlp_forward(
    s: StageBackend, c: _Consts, o: torch.Tensor, x_in: torch.Tensor, w_o: torch.Tensor,
    gamma_mlp: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor, gamma_out: torch.Tensor,
    f: Fp8Step | None, layer: int, h_out_fp8: bool,
) -> tuple[tuple[torch.Tensor | None, ...], torch.Tensor, torch.Tensor | Fp8Tensor, torch.Tensor]:
    """F1 R1 F2 F3 R2 of `layer`. Returns (tensors the backward needs, x_out, h_out = x_out ⊙ γ_out,
    rstd_out); with FP8, h_out is the next layer's QKV operand when `h_out_fp8`, else (the LM head's
    input) in the activation dtype."""
    wq = _weights(s, f, w_o, w_gu, w_down, for_dgrad=False)
    wq_o, wq_gu, wq_down = wq
    # The out-projection reads o's rows; its weight gradient gets a token-contiguous copy later.
    oq = _quantize(s, f, layer, Operand.out_in, o, transposed=False)
    x1, h1, sq1 = s.gemm_residual_rms(oq, wq_o, x_in, gamma_mlp,
                                      **_fp8_arg(f, layer, Operand.gate_up_in, "h_fp8"))
    r1 = s.rstd_from_partials(sq1, dim=c.dim, eps=c.eps)
    preact, y = s.gemm_rstd_swiglu(h1, wq_gu, r1, **_fp8_arg(f, layer, Operand.down_in, "y_fp8"))
    h_out = _fp8_arg(f, layer + 1, Operand.qkv_in, "h_fp8") if h_out_fp8 else {}
    x2, h2, sq2 = s.gemm_residual_rms(y, wq_down, x1, gamma_out, **h_out)
    r2 = s.rstd_from_partials(sq2, dim=c.dim, eps=c.eps)
    if f is None:
        return (o, None, None, None, None, None, x1, r1, preact, w_o, gamma_mlp, w_gu, w_down), x2, h2, r2
    f.record(layer, Operand.gate_up_in, h1)
    f.record(layer, Operand.down_in, y)
    if h_out_fp8:
        f.record(layer + 1, Operand.qkv_in, h2)
    # o is kept for its wgrad: the tensor attention keeps for its own backward, so no memory of its
    # own. With FP8 weight gradients the backward quantizes it token-contiguous with the forward's
    # scale (the same FP8 values), rather than an FP8 copy living through the step. The backward
    # recomputes y with the forward's scale too.
    return (o, oq.scale, y.scale, *_scales(wq), x1, r1, preact, w_o, gamma_mlp, w_gu, w_down), x2, h2, r2


def _mlp_backward(
    s: StageBackend, saved: tuple[torch.Tensor | None, ...], dx2: torch.Tensor,
    dx2_operand: torch.Tensor | Fp8Tensor, f: Fp8Step | None, layer: int,
) -> tuple[torch.Tensor, ...]:
    """Backward of `_mlp_forward` given dx2, the full gradient of x_out, and dx2_operand, the same
    as the down-projection's GEMM operand (dx2 itself, or its FP8 copy). The FP8 copy holds dx2's
    rows alone: the token-contiguous one, which only the down-projection's FP8 weight gradient
    reads, is made here after dSwiGLU, so that it is not alive beside dSwiGLU's buffers (the last
    layers' dSwiGLU is where FP8 CODA's step peaks; scripts/memory_report.py --snapshot).

    Returns (do, dx_in, dW_o, dγ_mlp, dW_gu, dW_down).
    """
    (o, o_scale, y_scale, w_o_scale, w_gu_scale, w_down_scale, x1, r1, preact, w_o, gamma_mlp, w_gu,
     w_down) = saved

    def dgrad_operand(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | Fp8Tensor:
        # Each FP8 copy made where it is read, so that at most one lives at a time: the backward of
        # the last layer runs beside the LM head's buffers, at the step's peak memory.
        return _weights(s, f, weight, for_dgrad=True, scales=(scale,))[0]

    wgrad_fp8 = _wgrad_fp8(f)
    fp8_args = {}
    if wgrad_fp8:
        # y is read by its weight gradient only: the token-contiguous copy alone.
        fp8_args = {"y_fp8": QuantizeTo(f.recipe.format_of(Operand.down_in), y_scale, transposed=True,
                                        rows=False),
                    **_fp8_arg(f, layer, Operand.gate_up_grad, "dpreact_fp8")}
    # preact is read here for the last time: its memory may hold dpreact's FP8 copies, or be freed.
    dpreact, y, zdz = s.gemm_dswiglu(dx2_operand, dgrad_operand(w_down, w_down_scale), preact, **fp8_args,
                                     reuse_preact=True)
    if wgrad_fp8:
        # dW_down reads dx2 token-contiguous: that copy is made now, from dx2 with its rows' scale
        # (the same FP8 values).
        dx2_operand = s.quantize(dx2, QuantizeTo(f.recipe.format_of(Operand.down_grad), dx2_operand.scale,
                                                 transposed=True, rows=False))
    dw_down = s.wgrad(dx2_operand if wgrad_fp8 else dx2, y)
    del y  # read by nothing else: not alive beside the gate/up dgrad's buffers (the step's peak)
    wq_gu = dgrad_operand(w_gu, w_gu_scale)
    # x1 feeds both the MLP norm and the residual path to x2, whose gradient the epilogue adds.
    if f is None:
        dx1, n1, dgamma = s.gemm_rms_bwd(dpreact, wq_gu, x1, gamma_mlp, r1, zdz, dx2)
        dx1_operand = dx1
    elif wgrad_fp8:
        _record(f, layer, Operand.gate_up_grad, dpreact)
        dx1, dx1_operand, n1, dgamma = s.gemm_rms_bwd_fp8(
            dpreact, wq_gu, x1, gamma_mlp, r1, zdz, dx2, n_fp8=f.to(layer, Operand.gate_up_wgrad_in),
            dx_fp8=f.to(layer, Operand.out_grad))
        _record(f, layer, Operand.gate_up_wgrad_in, n1)
        _record(f, layer, Operand.out_grad, dx1_operand)
    else:
        # The dgrads on FP8 operands, the weight gradients on dpreact, n1, dx1 as they are.
        dpreact_operand = _quantize(s, f, layer, Operand.gate_up_grad, dpreact)
        dx1, n1, dgamma = s.gemm_rms_bwd(dpreact_operand, wq_gu, x1, gamma_mlp, r1, zdz, dx2)
        dx1_operand = _quantize(s, f, layer, Operand.out_grad, dx1)
    del wq_gu  # before W_o's copy is made
    dw_gu = s.wgrad(dpreact, n1)
    do = s.dgrad(dx1_operand, dgrad_operand(w_o, w_o_scale))
    if wgrad_fp8:
        # o is read by its weight gradient only: the token-contiguous copy alone.
        o = s.quantize(o, QuantizeTo(f.recipe.format_of(Operand.out_in), o_scale, transposed=True,
                                     rows=False))
    dw_o = s.wgrad(dx1_operand if wgrad_fp8 else dx1, o)
    # x1 = x_in + o·W_oᵀ: x_in's gradient is dx1 itself.
    return do, dx1, dw_o, _dgamma(dgamma, gamma_mlp), dw_gu, dw_down


_MLP_SAVED = 13  # number of tensors `_mlp_forward` hands to the backward


def _head_mlp_backward(s: StageBackend, saved: tuple[torch.Tensor | None, ...], dx2: torch.Tensor,
                       f: Fp8Step | None, layer: int) -> tuple[torch.Tensor, ...]:
    """`_mlp_backward` of the last layer, given dx2 from the LM head (with FP8, its copy holds
    its rows alone, as `_mlp_backward` takes it)."""
    dx2_operand = _quantize(s, f, layer, Operand.down_grad, dx2, transposed=False)
    return _mlp_backward(s, saved, dx2, dx2_operand, f, layer)


# ---- F4, the QKV GEMM with its epilogue, shared by the entry and the middle layers -------------


def _qkv_forward(s: StageBackend, c: _Consts, h: torch.Tensor, w_qkv: torch.Tensor, rstd: torch.Tensor,
                 positions: torch.Tensor, b_qkv: torch.Tensor | None, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """F4: (qkv = RoPE(QK-norm(rstd ⊙ (h·W_qkvᵀ) + b_qkv)), the pre-norm q and k columns or None).
    The bias and the QK-norm go to the stages only when the model has them, so a backend without
    those epilogues runs every other model."""
    bias = {} if b_qkv is None else {"bias": b_qkv}
    if q_norm is None:
        return s.gemm_rstd_rope(h, w_qkv, rstd, positions, **c.rope, **bias), None
    return s.gemm_rstd_qknorm_rope(h, w_qkv, rstd, positions, **c.rope, q_heads=c.q_heads, q_weight=q_norm,
                                   k_weight=k_norm, eps=c.eps, **bias)


def _qkv_backward(
    s: StageBackend, c: _Consts, dqkv: torch.Tensor, qkv: torch.Tensor, z: torch.Tensor | None,
    positions: torch.Tensor, b_qkv: torch.Tensor | None, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, f: Fp8Step | None, layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """F4's epilogue backward: (dz, the attention norm's zdz, db_qkv, dq_norm, dk_norm), None for
    what the model lacks; dz in FP8 when the weight gradients are. The RoPE backward writes that
    FP8 dz itself; the bias gradient is a column sum of the unrounded dz and the QK-norm's
    backward writes it in the activation dtype, so with either dz reaches FP8 after them."""
    bias = {} if b_qkv is None else {"bias": b_qkv}
    dq_norm = dk_norm = None
    if q_norm is None:
        dz_fp8 = _fp8_arg(f, layer, Operand.qkv_grad, "dz_fp8") if _wgrad_fp8(f) and b_qkv is None else {}
        dz, zdz = s.rope_bwd(dqkv, qkv, positions, **c.rope, **bias, **dz_fp8)
        if dz_fp8:
            _record(f, layer, Operand.qkv_grad, dz)
    else:
        dz, zdz, dq, dk = s.qknorm_rope_bwd(dqkv, qkv, z, positions, **c.rope, q_heads=c.q_heads,
                                            q_weight=q_norm, k_weight=k_norm, eps=c.eps, **bias)
        dq_norm, dk_norm = dq.to(q_norm.dtype), dk.to(k_norm.dtype)
    db_qkv = None if b_qkv is None else s.bias_grad(dz).to(b_qkv.dtype)
    if _wgrad_fp8(f) and not isinstance(dz, Fp8Tensor):
        dz = _quantize(s, f, layer, Operand.qkv_grad, dz)
    return dz, zdz, db_qkv, dq_norm, dk_norm


def _qkv_gemm_backward(
    s: StageBackend, f: Fp8Step | None, layer: int, dz: torch.Tensor | Fp8Tensor, w_qkv: torch.Tensor,
    w_scale: torch.Tensor | None, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor, zdz: torch.Tensor,
    dx_residual: torch.Tensor | None, dx_fp8: QuantizeTo | None,
) -> tuple[torch.Tensor, torch.Tensor | Fp8Tensor, torch.Tensor, torch.Tensor]:
    """The QKV dgrad with the attention norm's backward, and the QKV wgrad, of `layer` (`w_scale`:
    the forward's `_scales` of W_qkv). Returns (dx, dx as the down-projection's GEMM operand (FP8
    when `dx_fp8`), dγ partials, dW_qkv)."""
    if f is None:
        dx, n, dgamma = s.gemm_rms_bwd(dz, w_qkv, x, gamma, rstd, zdz, dx_residual)
        return dx, dx, dgamma, s.wgrad(dz, n)
    (wq,) = _weights(s, f, w_qkv, for_dgrad=True, scales=(w_scale,))
    if not f.recipe.wgrad_fp8:
        # dz arrives in the activation dtype: the dgrad takes its FP8 copy, the weight gradient dz.
        dx, n, dgamma = s.gemm_rms_bwd(_quantize(s, f, layer, Operand.qkv_grad, dz), wq, x, gamma, rstd, zdz,
                                       dx_residual)
        dx_operand = dx if dx_fp8 is None else s.quantize(dx, dx_fp8)
        return dx, dx_operand, dgamma, s.wgrad(dz, n)
    dx, dx_operand, n, dgamma = s.gemm_rms_bwd_fp8(dz, wq, x, gamma, rstd, zdz, dx_residual,
                                                   n_fp8=f.to(layer, Operand.qkv_wgrad_in), dx_fp8=dx_fp8)
    _record(f, layer, Operand.qkv_wgrad_in, n)
    return dx, dx_operand, dgamma, s.wgrad(dz, n)


def _unpack(ctx) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(the tensors `_mlp_forward` saved, the Function's own). Reads ctx.saved_tensors once:
    under activation checkpointing a second read is an error."""
    saved = ctx.saved_tensors
    return saved[:_MLP_SAVED], saved[_MLP_SAVED:]


# ---- autograd Functions: forward stages in forward, backward stages in backward ----------------
# Activations take the parameters' dtype (the compute dtype); statistics the stages' stat dtype.


class _EntryFn(torch.autograd.Function):
    """tokens → (x0, qkv0): entry, then layer 0's F4."""

    @staticmethod
    def forward(ctx, tokens, positions, embedding, gamma, w_qkv, b_qkv, q_norm, k_norm, s, c, f):
        x, h, rstd = s.entry(tokens, embedding, gamma, eps=c.eps, **_fp8_arg(f, 0, Operand.qkv_in, "h_fp8"))
        _record(f, 0, Operand.qkv_in, h)
        wq_qkv = _weights(s, f, w_qkv, for_dgrad=False)
        qkv, z = _qkv_forward(s, c, h, wq_qkv[0], rstd, positions, b_qkv, q_norm, k_norm)
        ctx.save_for_backward(tokens, positions, x, rstd, qkv, z, gamma, w_qkv, *_scales(wq_qkv), b_qkv,
                              q_norm, k_norm)
        ctx.s, ctx.c, ctx.f, ctx.vocab_size = s, c, f, embedding.shape[0]
        return x, qkv

    @staticmethod
    def backward(ctx, dx_residual, dqkv):
        tokens, positions, x, rstd, qkv, z, gamma, w_qkv, w_scale, b_qkv, q_norm, k_norm = ctx.saved_tensors
        s, c, f = ctx.s, ctx.c, ctx.f
        dz, zdz, *dqkv_params = _qkv_backward(s, c, dqkv, qkv, z, positions, b_qkv, q_norm, k_norm, f, 0)
        dx, _, dgamma, dw_qkv = _qkv_gemm_backward(s, f, 0, dz, w_qkv, w_scale, x, gamma, rstd, zdz,
                                                   dx_residual, None)
        dembedding = s.entry_bwd(dx, tokens, num_embeddings=ctx.vocab_size)
        return None, None, dembedding, _dgamma(dgamma, gamma), dw_qkv, *dqkv_params, None, None, None


class _LayerFn(torch.autograd.Function):
    """(attention output o, x_in) → (x_out, qkv of the next layer): F1 R1 F2 F3 R2 F4."""

    @staticmethod
    def forward(ctx, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_next, w_qkv_next, b_qkv_next, q_norm_next,
                k_norm_next, positions, s, c, f, layer):
        mlp_saved, x2, h2, r2 = _mlp_forward(s, c, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_next, f,
                                             layer, h_out_fp8=True)
        wq_qkv = _weights(s, f, w_qkv_next, for_dgrad=False)
        qkv, z = _qkv_forward(s, c, h2, wq_qkv[0], r2, positions, b_qkv_next, q_norm_next, k_norm_next)
        ctx.save_for_backward(*mlp_saved, x2, r2, qkv, z, positions, gamma_next, w_qkv_next, *_scales(wq_qkv),
                              b_qkv_next, q_norm_next, k_norm_next)
        ctx.s, ctx.c, ctx.f, ctx.layer = s, c, f, layer
        return x2, qkv

    @staticmethod
    def backward(ctx, dx_residual, dqkv):
        mlp_saved, saved = _unpack(ctx)
        x2, r2, qkv, z, positions, gamma_next, w_qkv_next, w_scale, *qkv_params = saved
        s, c, f, layer = ctx.s, ctx.c, ctx.f, ctx.layer
        dz, zdz, *dqkv_params = _qkv_backward(s, c, dqkv, qkv, z, positions, *qkv_params, f, layer + 1)
        # dx2's FP8 copy holds its rows alone (`_mlp_backward` makes the token-contiguous one).
        dx2_fp8 = None if f is None else _rows_alone(f.to(layer, Operand.down_grad))
        dx2, dx2_operand, dgamma_next, dw_qkv_next = _qkv_gemm_backward(
            s, f, layer + 1, dz, w_qkv_next, w_scale, x2, gamma_next, r2, zdz, dx_residual, dx2_fp8)
        if f is not None:
            _record(f, layer, Operand.down_grad, dx2_operand)
        # Read by nothing else: dz (M × QKV width) not alive through the MLP backward, where the
        # step's peak memory is (192 MiB at llama3_1b 4×8192 and at llama3_8b 2×8192).
        del dz, zdz
        mlp_grads = _mlp_backward(s, mlp_saved, dx2, dx2_operand, f, layer)
        return (*mlp_grads, _dgamma(dgamma_next, gamma_next), dw_qkv_next, *dqkv_params, None, None, None,
                None, None)


class _FinalLossFn(torch.autograd.Function):
    """(o, x_in) → the *sum* of the cross-entropy over targets that are not IGNORE_INDEX (0 when
    there are none): F1 R1 F2 F3, then the final norm and LM head in the fused-linear-cross-entropy
    order (`lm_head_ce`), which computes the head's gradients during the forward (all but its
    last chunk's weight gradient, which may be left to the backward). Whoever normalizes the sum
    (the model's mean, or the trainer's count over a whole optimizer step) does so outside, so the
    backward scales those gradients by the incoming dloss alone."""

    @staticmethod
    def forward(ctx, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_final, w_lm, targets, s, c, chunk_rows, f,
                layer):
        mlp_saved, x2, _, _ = _mlp_forward(s, c, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_final, f, layer,
                                           h_out_fp8=False)
        head = s.lm_head_ce(x2, gamma_final, w_lm, targets, eps=c.eps, chunk_rows=chunk_rows)
        ctx.save_for_backward(*mlp_saved, head.dx, head.dgamma)
        # Intermediates, kept on ctx so that the backward can drop them (gigabytes: the V×d fp32
        # sum and a chunk of dlogits) before the last layer's backward allocates its own.
        ctx.head_dweight = (head.dweight, head.last_dlogits, head.last_n)
        ctx.s, ctx.f, ctx.layer, ctx.dtypes = s, f, layer, (gamma_final.dtype, w_lm.dtype)
        return head.loss.sum()

    @staticmethod
    def backward(ctx, dloss):
        mlp_saved, (dx2, dgamma) = _unpack(ctx)
        gamma_dtype, w_dtype = ctx.dtypes
        scale = dloss.to(dgamma.dtype)
        dw_lm = ctx.s.lm_head_dweight(*ctx.head_dweight, scale, w_dtype)
        ctx.head_dweight = None
        # In place: the saved dx would otherwise stay alive beside its scaled copy through the last
        # layer's MLP backward, where the step's peak memory is (M × d, 128 MiB at llama3_1b 4×8192).
        dx2.mul_(scale)
        mlp_grads = _head_mlp_backward(ctx.s, mlp_saved, dx2, ctx.f, ctx.layer)
        return *mlp_grads, _scaled(dgamma, scale, gamma_dtype), dw_lm, None, None, None, None, None, None


def _scaled(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t · scale rounded to `dtype` in one pass (the LM head's V×d fp32 gradient is gigabytes)."""
    return torch.mul(t, scale, out=torch.empty(t.shape, dtype=dtype, device=t.device))


def _final_loss_without_grad(s: StageBackend, c: _Consts, f: Fp8Step | None, layer: int, o, x_in, w_o,
                             gamma_mlp, w_gu, w_down, gamma_final, w_lm, targets) -> torch.Tensor:
    """`_FinalLossFn`'s loss alone (evaluation): the LSE epilogue of one logits GEMM, no gradients."""
    _, _, h2, r2 = _mlp_forward(s, c, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_final, f, layer,
                                h_out_fp8=False)
    lse, target_logit = s.gemm_rstd_lse(h2, w_lm, r2, targets)
    return torch.where(targets != IGNORE_INDEX, lse - target_logit, 0.0).sum()


class _FinalLogitsFn(torch.autograd.Function):
    """(o, x_in) → logits (M, V): F1 R1 F2 F3 R2, then the row-scaled LM-head GEMM."""

    @staticmethod
    def forward(ctx, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_final, w_lm, s, c, f, layer):
        mlp_saved, x2, h2, r2 = _mlp_forward(s, c, o, x_in, w_o, gamma_mlp, w_gu, w_down, gamma_final, f,
                                             layer, h_out_fp8=False)
        logits = s.gemm_rstd(h2, w_lm, r2)
        ctx.save_for_backward(*mlp_saved, x2, r2, logits, gamma_final, w_lm)
        ctx.s, ctx.f, ctx.layer = s, f, layer
        return logits

    @staticmethod
    def backward(ctx, dlogits):
        mlp_saved, (x2, r2, logits, gamma_final, w_lm) = _unpack(ctx)
        s = ctx.s
        zdz = s.row_dot(logits, dlogits)
        dx2, n2, dgamma = s.gemm_rms_bwd(dlogits, w_lm, x2, gamma_final, r2, zdz)
        dw_lm = s.wgrad(dlogits, n2)
        del zdz, n2  # not alive through the last layer's MLP backward
        mlp_grads = _head_mlp_backward(s, mlp_saved, dx2, ctx.f, ctx.layer)
        return *mlp_grads, _dgamma(dgamma, gamma_final), dw_lm, None, None, None, None


# ---- modules -----------------------------------------------------------------------------------


def _consts(cfg: LlamaConfig) -> _Consts:
    return _Consts(
        dim=cfg.dim, eps=cfg.norm_eps, head_dim=cfg.head_dim, q_heads=cfg.n_heads,
        rope_heads=cfg.n_heads + cfg.n_kv_heads, rope_config=cfg.rope,
    )


def _param(*shape: int) -> nn.Parameter:
    # Values come from `CodaLlama.init_weights` (or a checkpoint), drawn per canonical tensor.
    return nn.Parameter(torch.empty(*shape))


def _apply(function: type[torch.autograd.Function], fp8: Fp8Step | None, *args):
    """`function.apply(*args)`; with FP8 outside torch.compile's graphs (a graph break around it,
    the stages run as they do eagerly): the Function records amaxes into the step's scaling state
    in its forward and backward, a tensor a compiled autograd graph would save and then find
    modified by the other layers (train.compile=true with block.precision=fp8 stopped in the
    backward)."""
    return (function.apply if fp8 is None else _EAGER_APPLY[function])(*args)


_EAGER_APPLY = {function: torch.compiler.disable(function.apply)
                for function in (_EntryFn, _LayerFn, _FinalLossFn, _FinalLogitsFn)}


class CodaEntry(nn.Module):
    """Embedding (unless tied: `CodaLlama` owns it then) and layer 0's attention norm and QKV weight."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.consts = _consts(cfg)
        self.embedding = None if cfg.tie_embeddings else _param(cfg.vocab_size, cfg.dim)
        self.gamma_attn = _param(cfg.dim)
        self.w_qkv = _param(cfg.qkv_dim, cfg.dim)
        self.b_qkv = _param(cfg.qkv_dim) if cfg.qkv_bias else None
        self.q_norm = _param(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim) if cfg.qk_norm else None

    def forward(
        self, tokens: torch.Tensor, step: ForwardStep, tied_embedding: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (M,) → (x0 (M, d), qkv0 (M, N_qkv)); `tied_embedding` is the model's tied matrix."""
        embedding = self.embedding if tied_embedding is None else tied_embedding
        return _apply(_EntryFn, step.fp8, tokens, step.positions, embedding, self.gamma_attn, self.w_qkv,
                      self.b_qkv, self.q_norm, self.k_norm, step.stages, self.consts, step.fp8)


class _ShiftedLayer(nn.Module):
    """Attention of layer i, its out-projection and MLP, and the norm γ that F3 applies."""

    def __init__(self, cfg: LlamaConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.consts = cfg, _consts(cfg)
        self.index = index  # the layer's number: its FP8 amax histories'
        self.w_o = _param(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.gamma_mlp = _param(cfg.dim)
        self.w_gate_up = _param(2 * cfg.ffn_dim, cfg.dim)
        self.w_down = _param(cfg.dim, cfg.ffn_dim)

    def attention(self, qkv: torch.Tensor, step: ForwardStep) -> torch.Tensor:
        cfg = self.cfg
        return causal_attention(
            qkv, step.batch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, step.attention, step.documents
        )

    def mlp_params(self) -> list[torch.Tensor]:
        return [self.w_o, self.gamma_mlp, self.w_gate_up, self.w_down]


class CodaLayer(_ShiftedLayer):
    """Layer i (not the last) plus layer i+1's attention norm γ and QKV weight."""

    def __init__(self, cfg: LlamaConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.gamma_attn_next = _param(cfg.dim)
        self.w_qkv_next = _param(cfg.qkv_dim, cfg.dim)
        self.b_qkv_next = _param(cfg.qkv_dim) if cfg.qkv_bias else None
        self.q_norm_next = _param(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm_next = _param(cfg.head_dim) if cfg.qk_norm else None

    def forward(
        self, qkv: torch.Tensor, x: torch.Tensor, step: ForwardStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv_i, x_in) → (x_out, qkv_{i+1})."""
        o = self.attention(qkv, step)
        return _apply(_LayerFn, step.fp8, o, x, *self.mlp_params(), self.gamma_attn_next, self.w_qkv_next,
                      self.b_qkv_next, self.q_norm_next, self.k_norm_next, step.positions, step.stages,
                      self.consts, step.fp8, self.index)


class CodaFinalLayer(_ShiftedLayer):
    """The last layer plus the final norm γ and the LM head (unless tied: `CodaLlama` owns it then)."""

    def __init__(self, cfg: LlamaConfig, head_chunk_rows: int) -> None:
        super().__init__(cfg, cfg.n_layers - 1)
        self.head_chunk_rows = head_chunk_rows
        self.gamma_final = _param(cfg.dim)
        self.w_lm_head = None if cfg.tie_embeddings else _param(cfg.vocab_size, cfg.dim)

    def forward(
        self, qkv: torch.Tensor, x: torch.Tensor, step: ForwardStep, targets: torch.Tensor | None,
        tied_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(qkv, x_in, targets (M,)) → the sum of the token losses; without targets, logits (M, V).
        `tied_embedding` is the model's tied matrix, the head's weight."""
        o = self.attention(qkv, step)
        head = self.w_lm_head if tied_embedding is None else tied_embedding
        params = [*self.mlp_params(), self.gamma_final, head]
        fp8 = (step.fp8, self.index)
        if targets is None:
            return _apply(_FinalLogitsFn, step.fp8, o, x, *params, step.stages, self.consts, *fp8)
        if not torch.is_grad_enabled():
            return _final_loss_without_grad(step.stages, self.consts, *fp8, o, x, *params, targets)
        return _apply(_FinalLossFn, step.fp8, o, x, *params, targets, step.stages, self.consts,
                      self.head_chunk_rows, *fp8)


# ---- canonical layout ---------------------------------------------------------------------------


def qkv_row_order(cfg: LlamaConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Native QKV row r holds canonical row order[r].

    Canonical (HF) q/k heads rotate rows (j, j + d_h/2); the CODA layout puts each such pair on
    adjacent rows (2j, 2j+1) so the RoPE epilogue rotates neighbouring accumulator columns.
    v rows keep their order. q and k move together, so attention scores are unchanged.
    """
    per_head = head_row_order(cfg).to(device)
    rope_heads = cfg.n_heads + cfg.n_kv_heads
    rope_rows = (torch.arange(rope_heads, device=device)[:, None] * cfg.head_dim + per_head).flatten()
    return torch.cat([rope_rows, torch.arange(rope_heads * cfg.head_dim, cfg.qkv_dim, device=device)])


def gate_up_row_order(cfg: LlamaConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Native gate/up row r holds canonical row order[r]: [g0, u0, g1, u1, …] from [gate; up]."""
    gate = torch.arange(cfg.ffn_dim, device=device)
    return torch.stack([gate, gate + cfg.ffn_dim], dim=1).flatten()


def head_row_order(cfg: LlamaConfig) -> torch.Tensor:
    """Native row r of a QK-norm weight (head_dim,) holds canonical row order[r]: the RoPE pairs
    adjacent, as inside each q/k head of `qkv_row_order`."""
    pair_first = torch.arange(cfg.head_dim // 2)
    return torch.stack([pair_first, pair_first + cfg.head_dim // 2], dim=1).flatten()


def _qkv_extras(cfg: LlamaConfig, module: str, suffix: str, layer: str) -> Layout:
    """The layout of the QKV bias and QK-norm weights a module holds for `layer` (canonical prefix)."""
    table = {}
    if cfg.qkv_bias:
        table[f"{module}b_qkv{suffix}"] = Canonical(f"{layer}self_attn.qkv_proj.bias", qkv_row_order(cfg))
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            canonical = f"{layer}self_attn.{name}.weight"
            table[f"{module}{name}{suffix}"] = Canonical(canonical, head_row_order(cfg))
    return table


class CodaLlama(nn.Module):
    """Llama decoder computed as CODA stages. `forward(tokens)` gives logits; `forward(tokens,
    targets)` the mean cross-entropy over targets that are not IGNORE_INDEX (`reduction="sum"`:
    their sum, as `codatrain.model.llama.lm_loss`). With `documents` (the data loader's
    `Batch.documents`) or `doc_ids` (B, T) attention stays within each document and RoPE positions
    restart at every document start (as in `Llama`, whose forward says what `doc_ids` cost).

    block: the stage backend and attention function, as `resolve_block` loaded them for the device
    (default: the reference stages and PyTorch's attention, which run anywhere).
    head_chunk_rows: rows per chunk of the LM head (`lm_head_ce`; default: the backend's
    `head_chunk_rows(V)`).
    fp8: the FP8 recipe of the layer GEMMs (block.precision=fp8), None for the compute dtype. The
    model then holds its delayed-scaling state, `fp8_scaling` (training state, not parameters:
    the trainer applies each step's amaxes and the checkpoint keeps it).
    """

    def __init__(self, cfg: LlamaConfig, block: ResolvedBlock | None = None,
                 head_chunk_rows: int | None = None, fp8: Fp8Recipe | None = None) -> None:
        super().__init__()
        block = block or portable_block()
        if block.stages is None or block.attention_fn is None:
            raise ValueError(f"{block} was resolved without a device: it names the kernels but holds none")
        self.cfg, self.block = cfg, block
        self.stages, self.attention_fn = block.stages, block.attention_fn
        problem = block.unsupported_model(cfg.dim, cfg.ffn_dim, cfg.head_dim, qkv_bias=cfg.qkv_bias,
                                          qk_norm=cfg.qk_norm, fp8=fp8 is not None)
        if problem:
            raise ValueError(problem)
        # Tiny, on the CPU until the first forward moves it to the tokens' device.
        self.fp8_scaling = None if fp8 is None else Fp8Scaling(fp8, cfg.n_layers, device="cpu")
        self.entry = CodaEntry(cfg)
        chunk_rows = head_chunk_rows or self.stages.head_chunk_rows(cfg.vocab_size)
        self.layers = nn.ModuleList(
            [*(CodaLayer(cfg, i) for i in range(cfg.n_layers - 1)), CodaFinalLayer(cfg, chunk_rows)]
        )
        # The tied embedding and head (module docstring); None when untied.
        self.tied_embedding = _param(cfg.vocab_size, cfg.dim) if cfg.tie_embeddings else None
        if self.entry.gamma_attn.device.type != "meta":
            self.init_weights(seed=0)

    def blocks(self) -> list[nn.Module]:
        """The modules FSDP2 shards one at a time: the entry and every shifted layer."""
        return [self.entry, *self.layers]

    def fp8_weight_names(self) -> list[str]:
        """The parameters the FP8 layer GEMMs quantize (QKV, out, gate-up, down of every layer),
        by native name; not the embedding, the norms or the LM head, which stay in the compute
        dtype. Empty without FP8."""
        if self.fp8_scaling is None:
            return []
        names = ["entry.w_qkv"]
        for i in range(self.cfg.n_layers):
            names += [f"layers.{i}.{w}" for w in ("w_o", "w_gate_up", "w_down")]
            if i < self.cfg.n_layers - 1:
                names.append(f"layers.{i}.w_qkv_next")
        return names

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None, reduction: str = "mean", *, documents: Documents | None = None,
    ) -> torch.Tensor:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} is not mean or sum")
        batch, seq = tokens.shape
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        # Only PyTorch's attention reads flex_attention's block mask; FA4 takes cu_seqlens.
        documents = forward_documents(doc_ids, documents, block_mask=not self.block.fa4)
        fp8 = None
        if self.fp8_scaling is not None:
            if self.fp8_scaling.history.device != tokens.device:
                self.fp8_scaling.to(tokens.device)
            # Only training steps record amaxes: evaluation leaves the history alone.
            fp8 = self.fp8_scaling.step_view(record=torch.is_grad_enabled())
        step = ForwardStep.of(self.stages, self.attention_fn, batch, seq, tokens.device, documents, fp8)
        x, qkv = self.entry(tokens.reshape(-1), step, self.tied_embedding)
        for layer in self.layers[:-1]:
            x, qkv = layer(qkv, x, step)
        if targets is None:
            return self.layers[-1](qkv, x, step, None, self.tied_embedding).view(batch, seq, -1)
        loss_sum = self.layers[-1](qkv, x, step, targets.reshape(-1), self.tied_embedding)
        if reduction == "sum":
            return loss_sum
        # As F.cross_entropy: NaN when no target counts.
        return loss_sum / (targets != IGNORE_INDEX).sum()

    # ---- canonical state ------------------------------------------------------------------
    def layout(self) -> Layout:
        """Native parameter name → canonical (eager) tensor and row order. Layer i owns layer
        i + 1's attention norm and QKV weight; the last layer owns the final norm and the head."""
        cfg, last = self.cfg, self.cfg.n_layers - 1
        qkv, gate_up = qkv_row_order(cfg), gate_up_row_order(cfg)
        embedding = "tied_embedding" if cfg.tie_embeddings else "entry.embedding"
        table = {
            embedding: Canonical("embed_tokens.weight"),
            "entry.gamma_attn": Canonical("layers.0.input_layernorm.weight"),
            "entry.w_qkv": Canonical("layers.0.self_attn.qkv_proj.weight", qkv),
        }
        table |= _qkv_extras(cfg, "entry.", "", "layers.0.")
        for i in range(cfg.n_layers):
            here, nxt = f"layers.{i}.", f"layers.{i + 1}."
            table |= {
                here + "w_o": Canonical(here + "self_attn.o_proj.weight"),
                here + "gamma_mlp": Canonical(here + "post_attention_layernorm.weight"),
                here + "w_gate_up": Canonical(here + "mlp.gate_up_proj.weight", gate_up),
                here + "w_down": Canonical(here + "mlp.down_proj.weight"),
            }
            if i < last:
                table |= {
                    here + "gamma_attn_next": Canonical(nxt + "input_layernorm.weight"),
                    here + "w_qkv_next": Canonical(nxt + "self_attn.qkv_proj.weight", qkv),
                }
                table |= _qkv_extras(cfg, here, "_next", nxt)
        table[f"layers.{last}.gamma_final"] = Canonical("norm.weight")
        if not cfg.tie_embeddings:
            table[f"layers.{last}.w_lm_head"] = Canonical("lm_head.weight")
        return table

    def init_weights(self, seed: int) -> None:
        """Llama-style init, drawn per canonical tensor: the eager model's weights for `seed`."""
        init_canonical_weights(self, seed)
