"""The CuTeDSL kernels a training config launches, as compile specs, and how to compile them
without a GPU: the compile process that `codatrain.kernels.cache` (which owns the cache
directory) starts as ``python -m codatrain.kernels.cute.compile_specs``. How it compiles without a
GPU (`compile_only`) and the count of kernels a process loaded or compiled (`kernel_counts`) reach
into QuACK's and FA4's internals, so they live in pins.py.

Each stage family contributes its kernels through one function of `KernelShapes`:
`entry_kernels`, `forward_kernels`, `backward_kernels`, `quantize_kernels`, `attention_kernels`
(`FAMILIES`). With block.precision=fp8 (`KernelShapes.fp8`) the forward and backward families
emit the FP8 forms of the layer GEMM stages, with both the delayed-scaling and the
current-scaling outputs of F1/F3, and `quantize_kernels` the quantize passes the model asks for;
the LM head stays bf16 and the cuBLAS FP8 GEMMs (`torch._scaled_mm`) need no spec. A
`KernelSpec` names a kernel and compiles it from inputs with the training job's shapes, strides
and dtypes, so that its cache key is the key the job looks up:

- GEMM stages are compiled by calling the stage itself (the `CuteStages` method the model calls)
  inside `compile_only`, where QuACK builds the launch plan, compiles or loads the kernel, and
  skips the launch. Whatever tile config or epilogue a stage picks is what gets compiled.
- Kernels that launch their compiled function themselves (entry, the row-wise backward kernels,
  QuACK's rstd reduction) are compiled by calling their tensor-free compile function with the
  arguments their stage derives from its tensors: the stage itself would launch on fake tensors.
- FlashAttention 4 compiles, and skips its launch, by itself under FakeTensorMode.

A new stage with a QuACK GEMM plugs in as one more `KernelSpec` calling it; a kernel that
launches itself, as one calling its compile function.

Importing this module needs the cuda extras. Compiling needs the target set in the environment
before CuTeDSL is first imported (`CUTE_DSL_ARCH`, `QUACK_ARCH`, FA4's `FLASH_ATTENTION_ARCH` and
`FLASH_ATTENTION_NUM_SMS`), as the compile processes started by `codatrain.kernels.cache`
have it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from flash_attn.cute.interface import BIN_BATCH_SEARCH_THRESH
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.rmsnorm import rmsnorm_fwd

from codatrain.kernels.attention import Documents, causal_attention
from codatrain.kernels.cache import HOPPER_SMS, KernelShapes
from codatrain.kernels.cute import CuteStages, entry, head, quantize, rowwise
from codatrain.kernels.cute import attention as fa4
from codatrain.kernels.cute.pins import (
    compile_only,
    kernel_lookups,
    rmsnorm_bwd_impl,
    skipping_lce_glue,
)
from codatrain.kernels.fp8 import E4M3, GRAD_FORMATS, Fp8Tensor, QuantizeTo
from codatrain.kernels.stages import IGNORE_INDEX, Rope

# Training activations are bf16 (the run plan's compute dtype on a GPU, FSDP2's param dtype at
# every world size); statistics fp32.
ACT = torch.bfloat16
STAT = torch.float32
# RoPE's θ and scaling only fill a frequency table at run time; no kernel depends on them.
_ANY_ROPE = Rope(theta=10000.0)
# Nor on a norm's ε.
_EPS = 1e-5
# One kernel compiles in seconds, FA4's backward in under a minute on a slow core. A spec that
# takes this long is stuck (most likely launching on fake tensors): stop with its traceback.
SPEC_TIMEOUT_S = 600
# Stage inputs are fake CPU tensors: QuACK keys kernels on dtypes, strides and QUACK_ARCH, never
# on the device, and fake CUDA tensors lack some ops (indexing with None, scatter_) on a
# CPU-only torch. FA4 takes fake CUDA tensors: CuTeDSL finds its launch stream through them.
_STAGE_DEVICE = "cpu"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # what it is, for logs and the manifest
    compile: Callable[[], object]  # compiles (or loads) the kernel inside `compile_only`


# ---- fake inputs (created inside compile_only, where they cost no memory) ----------------------


def _act(*shape: int, device: str = _STAGE_DEVICE) -> torch.Tensor:
    return torch.empty(shape, dtype=ACT, device=device)


def _stat(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=STAT, device=_STAGE_DEVICE)


def _index(*shape: int) -> torch.Tensor:
    """Token ids, targets and positions: int64, as the data loader and the model make them."""
    return torch.empty(shape, dtype=torch.int64, device=_STAGE_DEVICE)


def _fp8(*shape: int, dtype: torch.dtype = E4M3, transposed: bool = False) -> Fp8Tensor:
    """An FP8 operand standing for an activation-dtype tensor, with its transposed copy when the
    producer writes one (`QuantizeTo.transposed`)."""
    data = torch.empty(shape, dtype=dtype, device=_STAGE_DEVICE)
    data_t = torch.empty(shape[::-1], dtype=dtype, device=_STAGE_DEVICE) if transposed else None
    return Fp8Tensor(data, _stat(), ACT, None, data_t)


def _fp8_weight(*shape: int) -> Fp8Tensor:
    """A weight's FP8 copy: e4m3 with its transpose (`Fp8Recipe.weight`)."""
    return _fp8(*shape, transposed=True)


def _delayed(dtype: torch.dtype, transposed: bool = False, rows: bool = True) -> QuantizeTo:
    """An FP8 output with a delayed scale (given, a 0-d device tensor), as `Fp8Step.to` asks for it."""
    return QuantizeTo(dtype, _stat(), 0, transposed, rows)


def _grad_dtype(s: KernelShapes) -> torch.dtype:
    return GRAD_FORMATS[s.fp8_grad_format]


def _cute(dtype: torch.dtype) -> type:
    return torch2cute_dtype_map[dtype]


def _tokens(s: KernelShapes) -> int:
    return s.batch * s.seq_len


def _q_dim(s: KernelShapes) -> int:
    return s.n_heads * s.head_dim


def _qkv_dim(s: KernelShapes) -> int:
    return (s.n_heads + 2 * s.n_kv_heads) * s.head_dim


def _qk_norm(s: KernelShapes) -> dict:
    """The QK-norm arguments of F4 and its backward: the norm weights and ε (no kernel depends on ε)."""
    return {"q_heads": s.n_heads, "q_weight": _act(s.head_dim), "k_weight": _act(s.head_dim), "eps": _EPS}


def _head_rows(s: KernelShapes) -> int:
    """Rows per chunk of the LM head, as `CodaLlama` chooses them by default."""
    return CuteStages().head_chunk_rows(s.vocab_size)


# ---- the stage families -----------------------------------------------------------------------


def entry_kernels(s: KernelShapes) -> list[KernelSpec]:
    """Model entry (embedding gather, x ⊙ γ, first rstd) and its backward (embedding gradient)."""
    if not s.stages:
        return []
    tokens = _cute(torch.int64)
    return [
        KernelSpec("entry", lambda: entry.compile_entry(tokens, _cute(ACT), s.dim)),
        KernelSpec("entry backward", lambda: entry.compile_entry_bwd(tokens, _cute(ACT), s.dim)),
    ]


def forward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """F1–F4, the rstd reduction and the LM head of docs/design.md §3 (and the full-logits head);
    with FP8, F1–F4 and the rstd reduction on FP8 operands and the LM head as in bf16."""
    if not s.stages:
        return []
    st, m, d, vocab = CuteStages(), _tokens(s), s.dim, s.vocab_size
    lm_head = [
        KernelSpec(
            "LM head · rstd + LSE + target logit",
            lambda: st.gemm_rstd_lse(_act(m, d), _act(vocab, d), _stat(m), _index(m)),
        ),
        KernelSpec("LM head · rstd, full logits", lambda: st.gemm_rstd(_act(m, d), _act(vocab, d), _stat(m))),
    ]
    if s.fp8:
        return [*_fp8_forward_kernels(s), *lm_head]
    rope = {"head_dim": s.head_dim, "rope_heads": s.n_heads + s.n_kv_heads, "rope": _ANY_ROPE}
    if s.qkv_bias:
        rope["bias"] = _act(_qkv_dim(s))

    def out_proj():
        return st.gemm_residual_rms(_act(m, _q_dim(s)), _act(d, _q_dim(s)), _act(m, d), _act(d))

    def down_proj():
        return st.gemm_residual_rms(_act(m, s.ffn_dim), _act(d, s.ffn_dim), _act(m, d), _act(d))

    def rstd_reduce():
        # QuACK's reduction compiles per number of partials, which F1's and F3's column tiles
        # decide (they differ where the two GEMMs tile differently, e.g. at 8B widths).
        for partials in (out_proj().sq_partials, down_proj().sq_partials):
            st.rstd_from_partials(partials, dim=d, eps=_EPS)

    def qkv():
        inputs = (_act(m, d), _act(_qkv_dim(s), d), _stat(m), _index(m))
        if s.qk_norm:
            return st.gemm_rstd_qknorm_rope(*inputs, **rope, **_qk_norm(s))
        return st.gemm_rstd_rope(*inputs, **rope)

    return [
        KernelSpec("F1 out-proj + residual + x² partials", out_proj),
        KernelSpec("F3 down-proj + residual + x² partials", down_proj),
        KernelSpec("R rstd from partials", rstd_reduce),
        KernelSpec(
            "F2 gate/up · rstd + SwiGLU",
            lambda: st.gemm_rstd_swiglu(_act(m, d), _act(2 * s.ffn_dim, d), _stat(m)),
        ),
        KernelSpec("F4 QKV · rstd + QK-norm + RoPE" if s.qk_norm else "F4 QKV · rstd + RoPE", qkv),
        *lm_head,
    ]


def _fp8_forward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """F1–F4 and the rstd reduction on FP8 operands, as `coda._mlp_forward` and `_qkv_forward`
    call them. F1 and F3 write h in FP8 themselves with a delayed scale, and in the activation
    dtype (then one quantize pass) with current scaling, a run's first step; F3 of the last layer
    writes the LM head's h in the activation dtype, the current-scaling kernel."""
    st, m, d, f = CuteStages(s.fp8_fast_accum), _tokens(s), s.dim, s.ffn_dim
    rope = {"head_dim": s.head_dim, "rope_heads": s.n_heads + s.n_kv_heads, "rope": _ANY_ROPE}
    if s.qkv_bias:
        rope["bias"] = _act(_qkv_dim(s))

    def qkv():
        inputs = (_fp8(m, d), _fp8_weight(_qkv_dim(s), d), _stat(m), _index(m))
        if s.qk_norm:
            return st.gemm_rstd_qknorm_rope(*inputs, **rope, **_qk_norm(s))
        return st.gemm_rstd_rope(*inputs, **rope)

    def residual_rms(k: int, h_fp8: QuantizeTo) -> object:
        return st.gemm_residual_rms(_fp8(m, k), _fp8_weight(d, k), _act(m, d), _act(d), h_fp8=h_fp8)

    def current() -> QuantizeTo:
        return QuantizeTo(E4M3, None)

    def rstd_reduce():
        # F1 and F3 share the FP8 tile, so one number of partials.
        st.rstd_from_partials(residual_rms(_q_dim(s), _delayed(E4M3)).sq_partials, dim=d, eps=_EPS)

    return [
        KernelSpec("F1 out-proj on FP8 operands, h in FP8 (delayed scaling)",
                   lambda: residual_rms(_q_dim(s), _delayed(E4M3))),
        KernelSpec("F1 out-proj on FP8 operands, h quantized after (current scaling)",
                   lambda: residual_rms(_q_dim(s), current())),
        KernelSpec("F3 down-proj on FP8 operands, h in FP8 (delayed scaling)",
                   lambda: residual_rms(f, _delayed(E4M3))),
        KernelSpec("F3 down-proj on FP8 operands, h quantized after (current scaling; the LM head's h)",
                   lambda: residual_rms(f, current())),
        KernelSpec("R rstd from the FP8 partials", rstd_reduce),
        KernelSpec(
            "F2 gate/up on FP8 operands · rstd + SwiGLU, y quantized",
            lambda: st.gemm_rstd_swiglu(_fp8(m, d), _fp8_weight(2 * f, d), _stat(m), y_fp8=_delayed(E4M3)),
        ),
        KernelSpec("F4 QKV on FP8 operands · rstd + QK-norm + RoPE" if s.qk_norm
                   else "F4 QKV on FP8 operands · rstd + RoPE", qkv),
    ]


def backward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The backward stages, in the order `CodaLlama`'s backward calls them; with FP8, the fused
    dgrads on FP8 operands."""
    if not s.stages:
        return []
    st, m, d, f = CuteStages(), _tokens(s), s.dim, s.ffn_dim
    layer_gemms = _fp8_backward_kernels(s) if s.fp8 else [
        KernelSpec(
            "dSwiGLU in the down-proj dgrad", lambda: st.gemm_dswiglu(_act(m, d), _act(d, f), _act(m, 2 * f))
        ),
        KernelSpec(
            "norm backward + residual gradient in the gate/up and QKV dgrads",
            lambda: st.gemm_rms_bwd(
                _act(m, 2 * f), _act(2 * f, d), _act(m, d), _act(d), _stat(m), _stat(m), _act(m, d)
            ),
        ),
    ]
    return [
        *head_kernels(s),
        *layer_gemms,
        # rope_bwd and row_dot launch the same row-wise kernel, with and without the rotation.
        KernelSpec(
            "QK-norm + RoPE backward + ZdZ",
            lambda: rowwise.compile_qknorm_rope_bwd(_cute(ACT), _qkv_dim(s), s.head_dim,
                                                    s.n_heads * s.head_dim,
                                                    (s.n_heads + s.n_kv_heads) * s.head_dim, s.qkv_bias),
        ) if s.qk_norm else KernelSpec(
            "RoPE backward + ZdZ",
            lambda: rowwise.compile_row_dot(_cute(ACT), _qkv_dim(s), True, s.qkv_bias),
        ),
        KernelSpec(
            "row dot, ZdZ of the full-logits head",
            lambda: rowwise.compile_row_dot(_cute(ACT), s.vocab_size, False),
        ),
    ]


def _fp8_backward_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The fused dgrads on FP8 operands, as `coda._mlp_backward` and `_qkv_gemm_backward` call
    them: the gradient in the recipe's format (with its token-contiguous copy when the weight
    gradients are FP8, which then also take the stages' outputs quantized into both orientations).
    Every FP8 norm backward adds the residual path's gradient (the one without it is the
    full-logits head's, in bf16); `k_major_t` is no kernel: it reads the producer's copies."""
    st, m, d, f = CuteStages(s.fp8_fast_accum), _tokens(s), s.dim, s.ffn_dim
    grad, wgrad = _grad_dtype(s), s.fp8_wgrad

    def dswiglu(dpreact_scaling: str | None) -> Callable[[], object]:
        # With FP8 outputs, a delayed dpreact scale takes the cuBLAS dgrad and the dSwiGLU quantize
        # pass, a run's first step (current scaling) the fused epilogue and a quantize pass after it.
        def build() -> object:
            outputs = {}
            if dpreact_scaling is not None:
                dpreact_to = (_delayed(grad, True) if dpreact_scaling == "delayed"
                              else QuantizeTo(grad, None, 0, transposed=True))
                outputs = {"y_fp8": _delayed(E4M3, True, rows=False), "dpreact_fp8": dpreact_to}
            return st.gemm_dswiglu(_fp8(m, d, dtype=grad, transposed=wgrad), _fp8_weight(d, f),
                                   _act(m, 2 * f), **outputs)
        return build

    def rms_bwd(dx_asked: str | None = None) -> Callable[[], object]:
        # With FP8 outputs and delayed scales, the cuBLAS dgrad and the norm backward's quantize pass,
        # one variant per dx the model asks for: both orientations (gate/up: the out-projection's
        # gradient), rows alone (QKV: the down-projection's), none (layer 0's QKV: the embedding's);
        # a run's first step (current scaling) the fused epilogue and quantize passes after it.
        def build() -> object:
            inputs = (_fp8(m, 2 * f, dtype=grad, transposed=wgrad), _fp8_weight(2 * f, d), _act(m, d),
                      _act(d), _stat(m), _stat(m), _act(m, d))
            if dx_asked is None:
                return st.gemm_rms_bwd(*inputs)
            if dx_asked == "current":
                return st.gemm_rms_bwd_fp8(*inputs, n_fp8=QuantizeTo(E4M3, None, 0, True, False),
                                           dx_fp8=QuantizeTo(grad, None, 0, True))
            dx_to = {"both": _delayed(grad, True), "rows": _delayed(grad), "none": None}[dx_asked]
            return st.gemm_rms_bwd_fp8(*inputs, n_fp8=_delayed(E4M3, True, rows=False), dx_fp8=dx_to)
        return build

    outputs = ", outputs quantized into both orientations" if wgrad else ""
    rms_name = "norm backward + residual gradient of the gate/up and QKV dgrads, FP8 operands"
    return [
        *([KernelSpec(f"dSwiGLU in the down-proj dgrad, FP8 operands{outputs}", dswiglu("delayed")),
           KernelSpec(f"dSwiGLU in the down-proj dgrad, FP8 operands{outputs}, current scaling",
                      dswiglu("current"))]
          if wgrad else [KernelSpec("dSwiGLU in the down-proj dgrad, FP8 operands", dswiglu(None))]),
        *([KernelSpec(f"{rms_name} after the dgrad{outputs}, dx in FP8: {asked}", rms_bwd(asked))
           for asked in ("both", "rows", "none")]
          + [KernelSpec(f"{rms_name} in the dgrad's epilogue{outputs}, current scaling", rms_bwd("current"))]
          if wgrad else [KernelSpec(f"{rms_name} in the dgrad's epilogue", rms_bwd())]),
    ]


def quantize_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The quantize passes `coda.py` asks `CuteStages.quantize` for (and the entry's h), as
    `quantize.quantize_to` compiles them: one kernel per (format, width) row-major, one per format
    for the transposed copy alone and one for both orientations (any width, multiples of 16).
    Those the stage specs above compile with their outputs (F1/F3's h, F2's y, the dgrads'
    outputs) are theirs."""
    if not s.fp8:
        return []
    grad = _grad_dtype(s)
    passes: list[tuple[str, torch.dtype, int | str]] = [
        # The forward reads a weight's rows (widths d for W_qkv and W_gu, q_dim for W_o, F for
        # W_down); its dgrad in the backward the transpose alone.
        ("the weights' rows (W_gu, W_qkv)", E4M3, s.dim),
        ("the weights' rows (W_down)", E4M3, s.ffn_dim),
        ("the weights for their dgrads (and, with FP8 weight gradients, the attention output o)",
         E4M3, "transposed"),
        ("h of the entry", E4M3, s.dim),
        # Rows for the out-projection; with FP8 weight gradients its wgrad quantizes o again, the
        # transposed copy alone (above).
        ("the attention output o (and W_o's rows)", E4M3, _q_dim(s)),
    ]
    if s.fp8_wgrad:
        # The weight gradients' operands that no stage spec quantizes: dz of the QKV GEMMs (after
        # the RoPE backward), and dx of the last layer's down-projection (the LM head's gradient),
        # its rows for dSwiGLU and, after it, the transposed copy alone for dW_down.
        passes += [("the QKV GEMMs' dz", grad, "both"),
                   ("the LM head's dx for dSwiGLU", grad, s.dim),
                   ("the LM head's dx for the down-projection's weight gradient", grad, "transposed")]
    else:
        passes += [
            ("dx of the down- and out-projections", grad, s.dim),
            ("dpreact of the gate/up projection", grad, 2 * s.ffn_dim),
            ("dz of the QKV GEMMs", grad, _qkv_dim(s)),
        ]
    format_names = {dtype: name for name, dtype in GRAD_FORMATS.items()}

    def spec(what: str, dtype: torch.dtype, width: int | str) -> KernelSpec:
        to = f"quantize {what} to {format_names[dtype]}"
        if isinstance(width, str):
            orientations = {"both": "both orientations", "transposed": "the transposed copy alone"}[width]
            return KernelSpec(f"{to}, {orientations}", lambda: quantize.compile_quantize_transpose(
                _cute(ACT), _cute(dtype), width == "both", 16))
        return KernelSpec(f"{to}, width {width}",
                          lambda: quantize.compile_quantize(_cute(ACT), _cute(dtype), width))

    return [spec(*p) for p in passes]


def head_kernels(s: KernelShapes) -> list[KernelSpec]:
    """The training head (`head.lm_head_ce`): QuACK's RMSNorm forward and backward row kernels,
    and the GEMMs (and, on the base pipeline, the cross-entropy row kernel) of its linear
    cross-entropy. The scaled-exp pipeline's two small Triton kernels compile at their first
    launch, into Triton's own disk cache, in about a second. Each spec makes the call `head`
    makes, so the compile keys are the job's."""
    m, d, vocab, rows = _tokens(s), s.dim, s.vocab_size, _head_rows(s)

    def final_norm() -> object:
        return rmsnorm_fwd(_act(m, d), _act(d), eps=_EPS, store_rstd=True)

    def linear_cross_entropy() -> object:
        # Where the scaled-exp pipeline applies, the base one compiles too: a micro-batch whose
        # loss is past its exact range reruns there (head.SCALED_EXP_MAX_LOSS).
        with skipping_lce_glue(), mock.patch.object(head, "scaled_exp_is_exact", lambda loss: False):
            return head.linear_cross_entropy(_act(m, d), _act(vocab, d), _index(m), rows, IGNORE_INDEX)

    summed, last_rows = head.dweight_parts(m, d, vocab, rows)

    def pending_dweight() -> object:
        # The backward's GEMM of the base pipeline's last chunk (`lm_head_dweight`), scaled by the
        # loss gradient and rounded to the weight's dtype.
        return head.lm_head_dweight(_stat(vocab, d) if summed else None,
                                    head.last_dlogits_like(last_rows, vocab, _act(1)), _act(last_rows, d),
                                    _stat(), ACT)

    def final_norm_backward() -> object:
        # What `head` calls, below its custom op; the SM count only sizes an output.
        return rmsnorm_bwd_impl(_act(m, d), _act(d), _act(m, d), _stat(m), None, HOPPER_SMS)

    return [
        KernelSpec("final RMSNorm", final_norm),
        KernelSpec("LM head linear cross-entropy, loss and gradients", linear_cross_entropy),
        *([KernelSpec("LM head weight gradient of the last chunk", pending_dweight)] if last_rows else []),
        KernelSpec("final RMSNorm backward", final_norm_backward),
    ]


def attention_kernels(s: KernelShapes) -> list[KernelSpec]:
    """FlashAttention 4, causal, on q/k/v split off the fused QKV output as the model splits it;
    with documents, its variable-length kernels instead."""
    if not s.fa4:
        return []
    if s.documents:
        return _varlen_attention_kernels(s)

    def run(backward: bool) -> Callable[[], object]:
        def attention(qkv: torch.Tensor, n_kv_heads: int, documents: None) -> torch.Tensor:
            out, lse = fa4.forward(qkv, n_kv_heads)
            if backward:
                fa4.backward(torch.empty_like(out), qkv, out, lse, n_kv_heads)
            return out

        return lambda: causal_attention(
            _act(_tokens(s), _qkv_dim(s), device="cuda"), s.batch, s.n_heads, s.n_kv_heads, s.head_dim,
            attention,
        )

    return [KernelSpec("FA4 forward", run(backward=False)), KernelSpec("FA4 backward", run(backward=True))]


def _varlen_attention_kernels(s: KernelShapes) -> list[KernelSpec]:
    """FA4's varlen forward and backward, as `fa4_attention` calls them with `Documents`. FA4 adds
    a batch-lookup aid, a kernel variant of its own, above BIN_BATCH_SEARCH_THRESH sequences: a
    micro-batch with more documents than that (short ones) launches it, so it is compiled too
    when the micro-batch has room for that many."""
    counts = [1] + ([BIN_BATCH_SEARCH_THRESH + 1] if _tokens(s) > BIN_BATCH_SEARCH_THRESH else [])

    def run(backward: bool, count: int) -> Callable[[], object]:
        def attention(qkv: torch.Tensor, n_kv_heads: int, documents: Documents) -> torch.Tensor:
            tokens = qkv.flatten(0, 1)  # as `fa4_attention` flattens it
            out, lse = fa4.varlen_forward(tokens, n_kv_heads, documents.cu_seqlens, documents.max_seqlen)
            if backward:
                fa4.varlen_backward(torch.empty_like(out), tokens, out, lse, n_kv_heads, documents.cu_seqlens,
                                documents.max_seqlen)
            return out

        def compile() -> torch.Tensor:
            m = _tokens(s)
            documents = Documents(
                doc_index=_index(s.batch, s.seq_len), max_seqlen=s.seq_len, positions=_index(m),
                cu_seqlens=torch.empty(count + 1, dtype=torch.int32, device="cuda"), block_mask=None,
            )
            return causal_attention(
                _act(m, _qkv_dim(s), device="cuda"), s.batch, s.n_heads, s.n_kv_heads, s.head_dim,
                attention, documents,
            )

        return compile

    return [
        KernelSpec(f"FA4 varlen {direction}, {'up to' if count == 1 else 'over'} "
                   f"{BIN_BATCH_SEARCH_THRESH} documents", run(direction == "backward", count))
        for count in counts for direction in ("forward", "backward")
    ]


FAMILIES: tuple[Callable[[KernelShapes], list[KernelSpec]], ...] = (
    entry_kernels, forward_kernels, backward_kernels, quantize_kernels, attention_kernels,
)


def kernel_specs(shapes: KernelShapes) -> list[KernelSpec]:
    """Every kernel a training job of `shapes` launches, family by family."""
    return [spec for family in FAMILIES for spec in family(shapes)]


# ---- compiling without a GPU ------------------------------------------------------------------


def compile_specs(
    specs: list[KernelSpec], num_sms: int, log: Callable[[str], None] = print
) -> dict[str, float]:
    """Compile `specs` in order; returns {spec name: seconds}.

    Raises (and stops) when a spec raises, or when it reached no kernel at all: its stage then
    takes a path that `compile_only` does not cover, and the training job would compile it.
    """
    seconds = {}
    with compile_only(num_sms) as skipped_launches:
        for i, spec in enumerate(specs, 1):
            start, reached = time.perf_counter(), (kernel_lookups(), len(skipped_launches))
            faulthandler.dump_traceback_later(SPEC_TIMEOUT_S, exit=True)
            try:
                spec.compile()
            finally:
                faulthandler.cancel_dump_traceback_later()
            if (kernel_lookups(), len(skipped_launches)) == reached:
                raise RuntimeError(f"kernel spec {spec.name!r} reached no kernel; training would compile it")
            seconds[spec.name] = round(time.perf_counter() - start, 2)
            log(f"{i}/{len(specs)} {spec.name}: {seconds[spec.name]:.1f} s")
    return seconds


# ---- the compile process ----------------------------------------------------------------------


def _worker(argv: list[str]) -> None:
    """One compile process: compiles its share (`--part i/n`) of the kernel specs of `--shapes`
    and writes [[spec name, seconds], …] to `--report`. Started by `codatrain.kernels.cache`
    with the environment of its `compile_env`, which CuTeDSL read when it was first imported."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--part", required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args(argv)
    part, parts = (int(x) for x in args.part.split("/"))
    shapes = KernelShapes(**json.loads(args.shapes))

    # Known noise of compiling on fake tensors: FA4 reads data pointers (of fakes, harmlessly) and
    # hands CuTeDSL an argument it cannot type (it is compile-time).
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    warnings.filterwarnings("ignore", message="Argument aux_data")

    def log(line: str) -> None:
        print(f"precompile [{part}/{parts}] {line}", file=sys.stderr, flush=True)

    specs = kernel_specs(shapes)[part::parts]
    seconds = compile_specs(specs, int(os.environ["FLASH_ATTENTION_NUM_SMS"]), log)
    Path(args.report).write_text(json.dumps(list(seconds.items())))


if __name__ == "__main__":
    _worker(sys.argv[1:])
