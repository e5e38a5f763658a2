"""Causal self-attention for the CODA model, on the fused (M, N_qkv) output of the QKV stage.

Attention is not a CODA stage: it runs as one FlashAttention-style call, differentiated by
autograd. Implementations are registered by name: `sdpa` (PyTorch's scaled_dot_product_attention,
any device) here, `fa4` (FlashAttention 4, sm_90) by `codatrain.kernels.cute` on import with
`register_attention("fa4", fn)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from codatrain.kernels.stages import BackendUnavailableError, is_sm90, load_registered

# (q (B, T, h_q, d_h), k (B, T, h_kv, d_h), v (B, T, h_kv, d_h)) -> out (B, T, h_q, d_h), causal.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


_IMPLS: dict[str, AttentionFn] = {"sdpa": sdpa_attention}
_PROVIDERS = {"fa4": "codatrain.kernels.cute"}


def register_attention(name: str, fn: AttentionFn) -> None:
    _IMPLS[name] = fn


def get_attention(name: str, device: torch.device | str | None = None) -> AttentionFn:
    """The attention implementation `name` (sdpa | fa4) for tensors on `device` (None: not checked).

    Raises BackendUnavailableError when it cannot be loaded or cannot run on `device`.
    """
    hint = (
        "It needs an sm_90 GPU and the cuda extras (pip install 'codatrain[cuda]'); "
        "block.attention=sdpa runs anywhere."
    )
    fn = load_registered("attention", name, _IMPLS, _PROVIDERS, hint)
    if name == "fa4" and device is not None and not is_sm90(torch.device(device)):
        raise BackendUnavailableError(f"attention 'fa4' needs an sm_90 GPU, not {device}")
    return fn


def causal_attention(
    qkv: torch.Tensor, batch: int, n_heads: int, n_kv_heads: int, head_dim: int, attention: AttentionFn
) -> torch.Tensor:
    """Attention over qkv (M, (h_q + 2·h_kv)·d_h), M = batch·T rows in sequence order; returns
    the attention output (M, h_q·d_h), the A operand of the out-projection."""
    q, k, v = qkv.view(batch, -1, n_heads + 2 * n_kv_heads, head_dim).split(
        [n_heads, n_kv_heads, n_kv_heads], dim=2
    )
    return attention(q, k, v).reshape(qkv.shape[0], n_heads * head_dim)
