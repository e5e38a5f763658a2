"""Causal self-attention for the CODA model, on the fused (M, N_qkv) output of the QKV stage,
and the document masks of packed sequences that every model's attention and RoPE share.

Attention is not a CODA stage: it runs as one FlashAttention-style call, differentiated by
autograd. Implementations are registered by name: `sdpa` (PyTorch's own attention, any device)
here, `fa4` (FlashAttention 4, sm_90) by `codatrain.kernels.cute` on import with
`register_attention("fa4", fn)`.

Document masking. A packed window holds several documents; with `data.keep_document_boundaries`
a token attends only to the earlier tokens of its own document and its RoPE position counts from
its document's start. `documents_from_ids` turns a batch's document ids into `Documents`, once
per micro-batch, in the forms an implementation takes: FlashAttention's varlen offsets and per-token
positions. The data loader makes them on the host, so no forward waits for the device to learn
where documents start; only flex_attention's block mask (PyTorch's attention on CUDA) is built on
the device, by the model (`forward_documents`). Without documents every implementation runs its
plain causal kernel, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from codatrain.kernels.stages import BackendUnavailableError, is_sm90, load_registered


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a micro-batch of B rows of T tokens (`documents_from_ids`). A document
    never spans two rows. The data loader makes them on the host and its batch moves them to the
    device (`pin_memory`, `to`); flex_attention's block mask is added there (`with_block_mask`)."""

    doc_index: torch.Tensor  # (B, T) int64: which document of its row each token is in (0, 1, …)
    cu_seqlens: torch.Tensor  # (n + 1,) int32: start of each of the n documents in the B·T
    # flattened tokens, then B·T (FlashAttention's varlen form)
    max_seqlen: int  # a bound on the document length: T. Not the longest document: that would
    # cost a device sync, and FA4 picks its kernel variant from it (precompile could not know it)
    positions: torch.Tensor  # (B·T,) int64: each token's position within its document (RoPE)
    block_mask: BlockMask | None = None  # flex_attention's mask (`with_block_mask`, `document_attention`)

    def dense_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: query i may attend to key j (same document, j ≤ i)."""
        same_document = self.doc_index[:, :, None] == self.doc_index[:, None, :]
        return (same_document & torch.ones_like(same_document[0], dtype=torch.bool).tril())[:, None]

    def pin_memory(self) -> Documents:
        """In page-locked host memory, so that `to` copies asynchronously (the DataLoader's
        pin_memory thread calls this)."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str) -> Documents:
        """On `device`, copied without blocking the host (asynchronous from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Documents:
        if self.block_mask is not None:  # it is built where attention runs, after the move
            raise ValueError("documents with a block mask stay on their device")
        return replace(self, doc_index=fn(self.doc_index), cu_seqlens=fn(self.cu_seqlens),
                       positions=fn(self.positions))

    def with_block_mask(self) -> Documents:
        """These documents with flex_attention's block mask, built on their device; on CUDA
        compiled: eagerly it would materialise B·T·T index tensors."""
        doc_index = self.doc_index
        rows, seq_len = doc_index.shape

        def same_document_causal(b, h, q, k):
            del h
            return (doc_index[b, q] == doc_index[b, k]) & (q >= k)

        build = _compiled(create_block_mask) if doc_index.is_cuda else create_block_mask
        return replace(self, block_mask=build(same_document_causal, rows, None, seq_len, seq_len,
                                              device=doc_index.device))


def documents_from_ids(doc_ids: torch.Tensor) -> Documents:
    """The `Documents` of doc_ids (B, T), where a document is a run of equal ids within a row, on
    doc_ids' device, without a block mask. The data loader calls it on the host (`collate`); on a
    GPU it waits for the device (`nonzero`), so the trainer hands the models the loader's instead."""
    rows, seq_len = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_index = starts.cumsum(1) - 1
    offsets = starts.flatten().nonzero().squeeze(1)  # document starts in the flattened tokens
    document_of_token = starts.flatten().cumsum(0) - 1
    positions = torch.arange(rows * seq_len, device=doc_ids.device) - offsets[document_of_token]
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([rows * seq_len])]).to(torch.int32)
    return Documents(doc_index, cu_seqlens, seq_len, positions)


def forward_documents(
    doc_ids: torch.Tensor | None, documents: Documents | None, block_mask: bool
) -> Documents | None:
    """The documents a model's forward attends within: `documents` as the data loader made them
    (already on the device), or those of `doc_ids` (B, T) made here, which on a GPU waits for the
    device (fine for tests and one-off calls, not for training). block_mask: the attention reads
    flex_attention's block mask (PyTorch's, not FA4), which is then built on CUDA; elsewhere
    PyTorch's attention takes a dense mask."""
    if doc_ids is not None and documents is not None:
        raise ValueError("doc_ids and documents give the same thing: pass one of them")
    if doc_ids is not None:
        documents = documents_from_ids(doc_ids)
    if documents is None or not (block_mask and documents.doc_index.is_cuda):
        return documents
    return documents.with_block_mask()


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """torch.compile of a flex_attention function, once per process. flex_attention is fast only
    compiled (unfused, it materialises every score); compiling the functions themselves is
    PyTorch's recommended use, also inside a block that torch.compile wraps."""
    return torch.compile(fn, dynamic=False)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents
) -> torch.Tensor:
    """Causal GQA attention within documents: q (B, h_q, T, d_h), k and v (B, h_kv, T, d_h) →
    (B, h_q, T, d_h), the layout of F.scaled_dot_product_attention. With a block mask (CUDA):
    flex_attention, which skips the blocks that cross documents; else SDPA with a dense mask."""
    if documents.block_mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.dense_mask(), enable_gqa=True)
    flex = _compiled(flex_attention) if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=documents.block_mask, enable_gqa=True)


class AttentionFn(Protocol):
    """(qkv (B, T, h_q + 2·h_kv, d_h), h_kv, documents) -> out (B, T, h_q, d_h): causal GQA
    attention of the q, k and v heads of one fused tensor (q heads first, then k, then v), and
    within documents when they are given. Taking them fused lets an implementation write the
    gradients of q, k and v into one (B, T, h_q + 2·h_kv, d_h) tensor, the QKV backward's input,
    instead of autograd concatenating three."""

    def __call__(
        self, qkv: torch.Tensor, n_kv_heads: int, documents: Documents | None = None
    ) -> torch.Tensor: ...


def split_heads(qkv: torch.Tensor, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v views of qkv (..., h_q + 2·h_kv, d_h)."""
    n_heads = qkv.shape[-2] - 2 * n_kv_heads
    q, k, v = qkv.split([n_heads, n_kv_heads, n_kv_heads], dim=-2)
    return q, k, v


def sdpa_attention(qkv: torch.Tensor, n_kv_heads: int, documents: Documents | None = None) -> torch.Tensor:
    """PyTorch's attention: scaled_dot_product_attention, or `document_attention` with documents."""
    q, k, v = (t.transpose(1, 2) for t in split_heads(qkv, n_kv_heads))
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = document_attention(q, k, v, documents)
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
    qkv: torch.Tensor, batch: int, n_heads: int, n_kv_heads: int, head_dim: int, attention: AttentionFn,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Attention over qkv (M, (h_q + 2·h_kv)·d_h), M = batch·T rows in sequence order, within
    `documents` when given; returns the attention output (M, h_q·d_h), the A operand of the
    out-projection."""
    heads = qkv.view(batch, -1, n_heads + 2 * n_kv_heads, head_dim)
    return attention(heads, n_kv_heads, documents).reshape(qkv.shape[0], n_heads * head_dim)
