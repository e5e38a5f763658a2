"""The eager Llama: plain PyTorch modules, the baseline that `block=eager` trains.

Its parameter names and layouts *are* the canonical state (HF Llama conventions with QKV and
gate/up fused row-wise: qkv_proj = [q; k; v], gate_up_proj = [gate; up]). Every other block
implementation converts to and from this layout, so checkpoints are shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codatrain.kernels.attention import Documents, document_attention, forward_documents, split_heads
from codatrain.kernels.stages import IGNORE_INDEX, Rope, rope_inv_freq
from codatrain.model.config import LlamaConfig
from codatrain.model.init import init_canonical_weights
from codatrain.model.layout import Canonical, Layout, canonical_names


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in at least fp32 (as HF LlamaRMSNorm; fp64 stays fp64); the weight multiplies
        # in the input dtype.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, rope: Rope, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (*positions.shape, head_dim) in the HF convention: angles repeated over
    both halves."""
    angles = positions.to(torch.float64)[..., None] * rope_inv_freq(head_dim, rope, positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (j, j + d_h/2) pairs; x is (B, H, T, d_h)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LayerCache:
    """One layer's keys and values of the positions seen so far, in (B, H_kv, capacity, d_h)
    buffers; `length` positions are filled."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> None:
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the (B, H_kv, T, d_h) keys and values of T new positions; all keys and values so far."""
        start, self.length = self.length, self.length + k.shape[2]
        self.keys[:, :, start:self.length] = k
        self.values[:, :, start:self.length] = v
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


class KVCache:
    """The key/value cache of incremental decoding with the eager `Llama` (`forward(tokens, cache=)`),
    for `batch` rows of at most `capacity` positions."""

    def __init__(self, cfg: LlamaConfig, batch: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if capacity > cfg.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds model.max_seq_len={cfg.max_seq_len}")
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.layers = [LayerCache(shape, device, dtype) for _ in range(cfg.n_layers)]

    @property
    def length(self) -> int:
        """How many positions the cache holds (the position of the next token)."""
        return self.layers[0].length


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.dim, cfg.qkv_dim, bias=cfg.qkv_bias)
        # Qwen3's QK-norm: one RMSNorm over each q head, one over each k head, before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_heads(self.qkv_proj(x).view(B, T, -1, self.head_dim), self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rotate(q, k, cos, sin)
        if cache is not None:
            # The T new queries sit at positions past..past+T-1 and see every key up to their own
            # (is_causal would align the mask to the top left, i.e. to position 0).
            past = cache.length
            k, v = cache.extend(k, v)
            query_positions = torch.arange(past, past + T, device=x.device)[:, None]
            visible = torch.arange(past + T, device=x.device) <= query_positions  # (T, past + T)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        elif documents is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = document_attention(q, k, v, documents)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the (B, H, T, d_h) queries and keys; block=liger swaps in its kernel here."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over the targets that are not IGNORE_INDEX (≥ fp32 math): their mean
    (NaN when there are none), or with reduction="sum" their sum (0 when there are none), which the
    trainer divides by the target count of a whole optimizer step."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten(),
        ignore_index=IGNORE_INDEX, reduction=reduction,
    )


class Llama(nn.Module):
    """Llama decoder. `forward(tokens)` gives logits; `forward(tokens, targets)` the mean loss over
    the targets that are not IGNORE_INDEX (`reduction="sum"`: their sum, see `lm_loss`). With
    `documents` (the data loader's `Batch.documents`, on the tokens' device) or `doc_ids` (B, T)
    attention stays within each document and RoPE positions restart at every document start;
    `doc_ids` are turned into documents here, which on a GPU waits for the device. With a `KVCache`
    (decoding) `tokens` continue the positions the cache holds, and their keys and values are
    appended to it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # A tied head reads the embedding's parameter in forward rather than sharing it as a second
        # module's weight: `to_empty` (meta-device init) would untie two modules' weights.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if self.embed_tokens.weight.device.type != "meta":  # on meta, the trainer inits after sharding
            self.init_weights(seed=0)

    def blocks(self) -> list[nn.Module]:
        """The modules FSDP2 shards one at a time (and that compile/checkpointing wrap)."""
        return list(self.layers)

    def layout(self) -> Layout:
        """The eager model is canonical: every parameter maps to itself, rows untouched."""
        return {name: Canonical(name) for name in canonical_names(self.cfg)}

    def init_weights(self, seed: int) -> None:
        """Llama-style init, drawn per canonical tensor (see `init_canonical_weights`)."""
        init_canonical_weights(self, seed)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None, reduction: str = "mean", cache: KVCache | None = None,
        *, documents: Documents | None = None,
    ) -> torch.Tensor:
        batch, seq = tokens.shape
        past = 0 if cache is None else cache.length
        if past + seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {past + seq} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if cache is not None and (doc_ids is not None or documents is not None):
            raise ValueError("a KV cache decodes one document per row; documents cannot be combined with it")
        x = self.embed_tokens(tokens)
        documents = forward_documents(doc_ids, documents, block_mask=True)
        if documents is None:
            positions = torch.arange(past, past + seq, device=tokens.device)  # (T,), shared by every row
        else:
            positions = documents.positions.view(batch, 1, seq)  # (B, 1, T): broadcast over heads
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope, x.dtype)
        for i, layer in enumerate(self.layers):
            # Training calls each (possibly wrapped or compiled) block exactly as it did before caches.
            if cache is None:
                x = layer(x, cos, sin, documents)
            else:
                x = layer(x, cos, sin, documents, cache.layers[i])
        return self.head(self.norm(x), targets, reduction)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's (V, d) weight: the embedding table itself when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, h: torch.Tensor, targets: torch.Tensor | None, reduction: str) -> torch.Tensor:
        """The LM head on the final normed states h (B, T, d): logits, or with targets the loss
        (`lm_loss`); block=liger fuses the two here."""
        logits = F.linear(h, self.head_weight)
        return logits if targets is None else lm_loss(logits, targets, reduction)
