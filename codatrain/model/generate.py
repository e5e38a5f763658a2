"""Text generation with the eager Llama: greedy, temperature and top-p (nucleus) sampling, with a
KV cache (`llama.KVCache`) so that each new token costs one position's forward."""

from __future__ import annotations

import torch

from codatrain.model.llama import KVCache, Llama


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from (B, V) logits: the argmax for temperature 0, else a draw from the
    softmax at `temperature` restricted to the smallest set of most likely tokens whose probability
    reaches `top_p` (the most likely token is always kept, so top_p → 0 is greedy)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep a token when the tokens more likely than it have not yet reached top_p.
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate(model: Llama, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, generator: torch.Generator | None = None, eos_id: int | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """`tokens` (B, T) continued by up to `max_new_tokens` tokens: (B, T + n). With `eos_id`,
    generation stops once every row has produced it (finished rows are padded with it). Without
    `use_cache` every step recomputes the whole sequence (the reference for the cached path)."""
    if temperature < 0 or not 0 <= top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 <= top_p <= 1 (got {temperature}, {top_p})")
    batch, prompt_len = tokens.shape
    dtype = model.embed_tokens.weight.dtype
    capacity = prompt_len + max_new_tokens
    cache = KVCache(model.cfg, batch, capacity, tokens.device, dtype) if use_cache else None
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    step_input = tokens
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else tokens, cache=cache)[:, -1]
        new = next_token(logits, temperature, top_p, generator)
        if eos_id is not None:
            new = new.masked_fill(finished, eos_id)
            finished |= new == eos_id
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        step_input = new[:, None]
        if finished.all():
            break
    return tokens
