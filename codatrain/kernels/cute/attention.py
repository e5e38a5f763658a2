"""Causal attention with FlashAttention 4 (`flash_attn.cute`), registered as ``fa4``; with
`Documents`, its variable-length form (``cu_seqlens``), one sequence per document.

FA4's own autograd function is not traceable by `torch.compile` (it compiles CuTeDSL kernels
in Python on first use), so forward and backward are wrapped as torch custom ops with fake
implementations and joined by `register_autograd`: the compiled graph keeps one opaque node per
direction instead of breaking around attention.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

# The backward kernel entry that FA4's `flash_attn_func` autograd function calls itself; the
# flash-attn-4 version is pinned in pyproject.toml.
from torch import Tensor

from codatrain.kernels.attention import Documents
from codatrain.kernels.cute.pins import flash_attn_bwd


@torch.library.custom_op("codatrain::fa4_fwd", mutates_args=(), device_types="cuda")
def _fa4_fwd(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    return out, lse


@_fa4_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor):
    batch, seq, heads, _ = q.shape
    lse = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("codatrain::fa4_bwd", mutates_args=(), device_types="cuda")
def _fa4_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, causal=True)
    return dq, dk, dv


@_fa4_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: tuple[Tensor, Tensor]) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # Only `out` leaves `fa4_attention`; the lse is kept for the backward alone, so dlse is
    # always zero and FA4's backward needs no lse gradient term.
    q, k, v, out, lse = ctx.saved_tensors
    return _fa4_bwd(dout, q, k, v, out, lse)


_fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- variable length: the documents of a packed batch, flattened to (B·T, heads, d_h) ----------
# Queries and keys share the documents: one cu_seqlens for both. The forward and backward are
# plain functions too, which the compile specs (codatrain/kernels/cute/compile_specs.py) call to compile
# the same kernels.


def varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int
) -> tuple[Tensor, Tensor]:
    """FA4's causal varlen forward: (out (B·T, h_q, d_h), lse (h_q, B·T) fp32)."""
    with torch.no_grad():
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen, causal=True, return_lse=True,
        )


def varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
    max_seqlen: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """FA4's causal varlen backward: (dq, dk, dv)."""
    dq, dk, dv = flash_attn_bwd(
        q, k, v, out, dout.contiguous(), lse, causal=True, cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
    )
    return dq, dk, dv


_fa4_varlen_fwd = torch.library.custom_op("codatrain::fa4_varlen_fwd", varlen_forward, mutates_args=(),
                                          device_types="cuda")
_fa4_varlen_bwd = torch.library.custom_op("codatrain::fa4_varlen_bwd", varlen_backward, mutates_args=(),
                                          device_types="cuda")


@_fa4_varlen_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int):
    tokens, heads, _ = q.shape
    lse = torch.empty(heads, tokens, dtype=torch.float32, device=q.device)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@_fa4_varlen_bwd.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
    max_seqlen: int,
):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _varlen_setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, ctx.max_seqlen = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output)


def _varlen_backward(ctx, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    # As in `_backward`, the lse never leaves `fa4_attention`: dlse is zero.
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    return *_fa4_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen), None, None


_fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, documents: Documents | None = None) -> Tensor:
    """Causal GQA attention. q (B, T, h_q, d_h), k and v (B, T, h_kv, d_h) → out (B, T, h_q, d_h);
    within each document when `documents` are given.

    Strided views (heads split off a fused QKV tensor) are fine as long as the head dim is
    contiguous."""
    if documents is None:
        return _fa4_fwd(q, k, v)[0]
    # Rows of a fused QKV view merge into one token dimension without a copy.
    tokens = [t.flatten(0, 1) for t in (q, k, v)]
    return _fa4_varlen_fwd(*tokens, documents.cu_seqlens, documents.max_seqlen)[0].view(q.shape)
