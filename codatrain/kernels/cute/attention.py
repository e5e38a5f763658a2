"""Causal attention with FlashAttention 4 (`flash_attn.cute`), registered as ``fa4``; with
`Documents`, its variable-length form (``cu_seqlens``), one sequence per document.

FA4's own autograd function is not traceable by `torch.compile` (it compiles CuTeDSL kernels
in Python on first use), so forward and backward are wrapped as torch custom ops with fake
implementations and joined by `register_autograd`: the compiled graph keeps one opaque node per
direction instead of breaking around attention.

The ops take the fused QKV tensor and split it into q, k and v views themselves; the backward
hands FA4 the matching views of one dqkv tensor as its dq, dk and dv outputs, so the gradient
reaches the QKV backward as the single tensor it reads, with no concatenation after attention.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
from torch import Tensor

from codatrain.kernels.attention import Documents, split_heads

# The backward kernel entry that FA4's `flash_attn_func` autograd function calls itself; the
# flash-attn-4 version is pinned in pyproject.toml.
from codatrain.kernels.cute.pins import flash_attn_bwd


def forward(qkv: Tensor, n_kv_heads: int) -> tuple[Tensor, Tensor]:
    """FA4's causal forward on qkv (B, T, h_q + 2·h_kv, d_h): (out (B, T, h_q, d_h), lse
    (B, h_q, T) fp32)."""
    with torch.no_grad():
        return flash_attn_func(*split_heads(qkv, n_kv_heads), causal=True, return_lse=True)


def backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_kv_heads: int) -> Tensor:
    """FA4's causal backward: dqkv, shaped like qkv, its q, k and v heads written in place by FA4."""
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = split_heads(dqkv, n_kv_heads)
    flash_attn_bwd(*split_heads(qkv, n_kv_heads), out, dout.contiguous(), lse, causal=True,
                   dq=dq, dk=dk, dv=dv)
    return dqkv


_fa4_fwd = torch.library.custom_op("codatrain::fa4_fwd", forward, mutates_args=(), device_types="cuda")
_fa4_bwd = torch.library.custom_op("codatrain::fa4_bwd", backward, mutates_args=(), device_types="cuda")


@_fa4_fwd.register_fake
def _(qkv: Tensor, n_kv_heads: int):
    batch, seq, heads, head_dim = qkv.shape
    n_heads = heads - 2 * n_kv_heads
    lse = torch.empty(batch, n_heads, seq, dtype=torch.float32, device=qkv.device)
    return qkv.new_empty(batch, seq, n_heads, head_dim), lse


@_fa4_bwd.register_fake
def _(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_kv_heads: int):
    return torch.empty_like(qkv)


def _setup_context(ctx, inputs: tuple[Tensor, int], output: tuple[Tensor, Tensor]) -> None:
    qkv, ctx.n_kv_heads = inputs
    ctx.save_for_backward(qkv, *output)


def _backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor, None]:
    # Only `out` leaves `fa4_attention`; the lse is kept for the backward alone, so dlse is
    # always zero and FA4's backward needs no lse gradient term.
    qkv, out, lse = ctx.saved_tensors
    return _fa4_bwd(dout, qkv, out, lse, ctx.n_kv_heads), None


_fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- variable length: the documents of a packed batch, flattened to (B·T, heads, d_h) ----------
# Queries and keys share the documents: one cu_seqlens for both.


def varlen_forward(
    qkv: Tensor, n_kv_heads: int, cu_seqlens: Tensor, max_seqlen: int
) -> tuple[Tensor, Tensor]:
    """FA4's causal varlen forward on qkv (B·T, h_q + 2·h_kv, d_h): (out (B·T, h_q, d_h), lse
    (h_q, B·T) fp32)."""
    with torch.no_grad():
        return flash_attn_varlen_func(
            *split_heads(qkv, n_kv_heads), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True, return_lse=True,
        )


def varlen_backward(
    dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_kv_heads: int, cu_seqlens: Tensor, max_seqlen: int,
) -> Tensor:
    """FA4's causal varlen backward: dqkv, shaped like qkv (as `backward`)."""
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = split_heads(dqkv, n_kv_heads)
    flash_attn_bwd(
        *split_heads(qkv, n_kv_heads), out, dout.contiguous(), lse, causal=True, cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dq=dq, dk=dk, dv=dv,
    )
    return dqkv


_fa4_varlen_fwd = torch.library.custom_op("codatrain::fa4_varlen_fwd", varlen_forward, mutates_args=(),
                                          device_types="cuda")
_fa4_varlen_bwd = torch.library.custom_op("codatrain::fa4_varlen_bwd", varlen_backward, mutates_args=(),
                                          device_types="cuda")


@_fa4_varlen_fwd.register_fake
def _(qkv: Tensor, n_kv_heads: int, cu_seqlens: Tensor, max_seqlen: int):
    tokens, heads, head_dim = qkv.shape
    n_heads = heads - 2 * n_kv_heads
    lse = torch.empty(n_heads, tokens, dtype=torch.float32, device=qkv.device)
    return qkv.new_empty(tokens, n_heads, head_dim), lse


@_fa4_varlen_bwd.register_fake
def _(
    dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_kv_heads: int, cu_seqlens: Tensor, max_seqlen: int,
):
    return torch.empty_like(qkv)


def _varlen_setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    qkv, ctx.n_kv_heads, cu_seqlens, ctx.max_seqlen = inputs
    ctx.save_for_backward(qkv, cu_seqlens, *output)


def _varlen_backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    # As in `_backward`, the lse never leaves `fa4_attention`: dlse is zero.
    qkv, cu_seqlens, out, lse = ctx.saved_tensors
    return _fa4_varlen_bwd(dout, qkv, out, lse, ctx.n_kv_heads, cu_seqlens, ctx.max_seqlen), None, None, None


_fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def fa4_attention(qkv: Tensor, n_kv_heads: int, documents: Documents | None = None) -> Tensor:
    """Causal GQA attention (`codatrain.kernels.attention.AttentionFn`): qkv (B, T, h_q + 2·h_kv,
    d_h) → out (B, T, h_q, d_h); within each document when `documents` are given. qkv may be a
    view of the QKV stage's (B·T, N_qkv) output."""
    if documents is None:
        return _fa4_fwd(qkv, n_kv_heads)[0]
    # The rows of the fused QKV merge into one token dimension without a copy.
    out = _fa4_varlen_fwd(qkv.flatten(0, 1), n_kv_heads, documents.cu_seqlens, documents.max_seqlen)[0]
    return out.unflatten(0, qkv.shape[:2])
