"""Shared test helpers: random canonical weights for comparing block implementations, and the
documents of a batch of doc ids (CPU tests and tests/gpu)."""

import torch

from codatrain.model.config import LlamaConfig
from codatrain.model.llama import Llama


def random_canonical_state(cfg: LlamaConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Weights giving unit-scale activations, with γ far from 1, so every term of the math matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):  # names and shapes only
        shapes = {name: p.shape for name, p in Llama(cfg).named_parameters()}
    state = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            value = 1 + 0.3 * torch.randn(shape, generator=g)
        elif name == "embed_tokens.weight":
            value = torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) / shape[1] ** 0.5
        state[name] = value.to(dtype)
    return state


def documents_of(doc_ids: torch.Tensor) -> list[tuple[int, slice]]:
    """(row, columns) of every document: the runs of equal ids in each row."""
    found = []
    for row, ids in enumerate(doc_ids.tolist()):
        start = 0
        for col in range(1, len(ids) + 1):
            if col == len(ids) or ids[col] != ids[start]:
                found.append((row, slice(start, col)))
                start = col
    return found
