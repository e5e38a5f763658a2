"""Causal attention with FlashAttention 4 (`flash_attn.cute`), registered as ``fa4``.

FA4's own autograd function is not traceable by `torch.compile` (it compiles CuTeDSL kernels
in Python on first use), so forward and backward are wrapped as torch custom ops with fake
implementations and joined by `register_autograd`: the compiled graph keeps one opaque node per
direction instead of breaking around attention.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_func

# The backward kernel entry that FA4's `flash_attn_func` autograd function calls itself; the
# flash-attn-4 version is pinned in pyproject.toml.
from flash_attn.cute.interface import _flash_attn_bwd
from torch import Tensor


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
    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, causal=True)
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


def fa4_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal GQA attention. q (B, T, h_q, d_h), k and v (B, T, h_kv, d_h) → out (B, T, h_q, d_h).

    Strided views (heads split off a fused QKV tensor) are fine as long as the head dim is
    contiguous."""
    return _fa4_fwd(q, k, v)[0]
