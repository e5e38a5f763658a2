"""Which kernels run a block: the one place where ``auto`` is decided.

A run names its block as three strings (impl eager | coda | liger, the coda stage backend, the coda
attention); ``auto`` means the CuTeDSL kernels on an sm_90 GPU where they load, else the
PyTorch ones. `resolve_block` turns the three into names that the model, the kernel cache and
the precompile script then all read, so they cannot disagree.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from codatrain.kernels.attention import get_attention
from codatrain.kernels.stages import BackendUnavailableError, get_backend, is_sm90


@dataclass(frozen=True)
class ResolvedBlock:
    impl: str  # eager | coda | liger
    backend: str | None  # coda stage backend: reference | cute (None otherwise)
    attention: str | None  # coda attention: sdpa | fa4 (None otherwise)

    @property
    def cute_stages(self) -> bool:
        """Whether the CODA stages run as CuTeDSL kernels."""
        return self.backend == "cute"

    @property
    def fa4(self) -> bool:
        """Whether attention runs as FlashAttention 4 (CuTeDSL kernels too)."""
        return self.attention == "fa4"


def resolve_block(impl: str, backend: str, attention: str, device: torch.device | None) -> ResolvedBlock:
    """The block a run of `impl`/`backend`/`attention` runs on `device`, with ``auto`` decided.

    On an sm_90 GPU ``auto`` loads the cute backend and FA4 (importing them) and takes each that
    loads, warning when the stages fall back; elsewhere it takes reference / sdpa. `device` None
    stands for the precompile target, an sm_90 GPU with the cuda extras installed: ``auto`` then
    means the CuTeDSL kernels, and nothing is imported. Explicit names are returned as they are
    (`build_model` checks that they run on the device).
    """
    if impl != "coda":
        return ResolvedBlock(impl, None, None)
    hopper = device is None or is_sm90(torch.device(device))
    if backend == "auto":
        backend = "reference"
        if hopper:
            try:
                if device is not None:
                    get_backend("cute", device)
                backend = "cute"
            except BackendUnavailableError as exc:
                warnings.warn(f"block.backend=auto falls back to the reference stages: {exc}", stacklevel=2)
    if attention == "auto":
        attention = "sdpa"
        if hopper:
            try:
                if device is not None:
                    get_attention("fa4", device)
                attention = "fa4"
            except BackendUnavailableError:
                pass
    return ResolvedBlock(impl, backend, attention)
