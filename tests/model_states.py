"""Random canonical weights for comparing block implementations (CPU tests and tests/gpu)."""

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
