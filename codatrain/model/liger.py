"""The eager Llama with liger-kernel's kernels (block=liger): the benchmarks' peer for memory
savings without custom kernels of our own.

Liger replaces RMSNorm, SwiGLU, RoPE, and the LM head + loss with its fused linear cross-entropy
(the logits of a whole batch never exist at once; without targets the head stays a plain matmul);
the matmuls, the attention and the residual adds stay PyTorch's. The modules are the eager
model's, their classes swapped for subclasses that override only `forward` (or the RoPE/head
hooks), so the parameters, their names, `layout()`, `blocks()`, init, checkpoints and HF export
are the eager model's. RoPE goes through Liger's dispatcher, as its HF integration does: Triton,
or on Hopper with CuTeDSL installed its CuTeDSL kernel at the shapes where Liger measured it faster.

liger-kernel is imported by `check_liger` (at build, given the device: an early, clear error where
it cannot run) and by the forwards; the module imports, and the model builds without a device
(on the meta device, say), without it.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch
from torch import nn

from codatrain.kernels.stages import IGNORE_INDEX, BackendUnavailableError
from codatrain.model.config import LlamaConfig
from codatrain.model.llama import MLP, Attention, Llama, RMSNorm

LIGER_VERSION = "0.8.5"
REQUIREMENT = (
    f"block=liger needs a CUDA GPU and liger-kernel {LIGER_VERSION} (pip install 'codatrain[liger]')"
)


@functools.cache
def _unavailable_reason(device_type: str) -> str | None:
    if device_type != "cuda":
        return f"the model is on {device_type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "liger-kernel is not installed"
    if version != LIGER_VERSION:  # the variant is benchmarked against this release's kernels
        return f"liger-kernel {version} is installed"
    try:
        import liger_kernel.ops  # noqa: F401  (imports triton and every kernel module)
    except ImportError as exc:
        return f"liger-kernel does not import: {exc}"
    return None


def check_liger(device: torch.device | str) -> None:
    """Raise BackendUnavailableError, naming what is missing, when block=liger cannot run on `device`."""
    reason = _unavailable_reason(torch.device(device).type)
    if reason is not None:
        raise BackendUnavailableError(f"{REQUIREMENT}; here {reason}")


class LigerRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops import LigerRMSNormFunction

        # Liger's "llama" casting (statistics in fp32, the weight multiplies in the input dtype) is
        # our RMSNorm's; in place: dx overwrites dy, which nothing else reads. Its kernel takes
        # whole rows: the QK-norms (Qwen3) read head slices of the fused qkv, copied to rows here
        # (every other input already is rows: contiguous() returns it).
        return LigerRMSNormFunction.apply(x.contiguous(), self.weight, self.eps, 0.0, "llama", True)


class LigerMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction

        # Liger's SwiGLU for one [gate | up] tensor, our gate_up_proj's output: it reads both
        # halves in place, where its two-tensor op would first copy the strided halves. It takes
        # rows (M, 2F) and returns the gradient in that shape, hence the flatten.
        gate_up = self.gate_up_proj(x)
        hidden = LigerFusedGateUpSiLUMulFunction.apply(gate_up.flatten(0, -2))
        return self.down_proj(hidden.view(*gate_up.shape[:-1], -1))


class LigerAttention(Attention):
    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        # HF's rotate-half RoPE, ours; cos/sin (T, d_h) or, with documents, (B, 1, T, d_h).
        return liger_rotary_pos_emb(q, k, cos, sin)


# Each eager module class and the liger subclass that replaces it.
_LIGER_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: LigerRMSNorm, MLP: LigerMLP, Attention: LigerAttention,
}


class LigerLlama(Llama):
    """The eager `Llama` on liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy.

    With `device`, an error now (`check_liger`) if the kernels cannot run there; None: not checked,
    as for a model built on the meta device whose forward never runs here.
    """

    def __init__(self, cfg: LlamaConfig, device: torch.device | None = None) -> None:
        if device is not None:
            check_liger(device)
        super().__init__(cfg)
        # Swap classes rather than modules: every parameter stays the one the eager model made
        # (and initialised), under its name.
        for module in self.modules():
            if type(module) in _LIGER_CLASSES:
                module.__class__ = _LIGER_CLASSES[type(module)]

    def head(self, h: torch.Tensor, targets: torch.Tensor | None, reduction: str) -> torch.Tensor:
        if targets is None:
            return torch.nn.functional.linear(h, self.head_weight)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} is not one of mean, sum")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        # Liger's "mean" of no targets is 0; the eager loss's is NaN. Its sum divided by the count
        # is the eager mean in every case.
        loss = liger_fused_linear_cross_entropy(
            h.flatten(0, 1), self.head_weight, targets.flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss if reduction == "sum" else loss / (targets != IGNORE_INDEX).sum()
