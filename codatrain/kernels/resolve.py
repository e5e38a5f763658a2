"""Which kernels run a block: the one place where ``auto`` is decided and where the CODA kernels
are checked against the device.

A run names its block as three strings (impl eager | coda | liger, the coda stage backend, the coda
attention); ``auto`` means the CuTeDSL kernels on an sm_90 GPU where they load, else the
PyTorch ones. `resolve_block` turns the three into names that the kernel cache and the precompile
script read and, for a device, into the stage backend object and attention function that the CODA
model takes, so none of them can disagree and the device is checked once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from codatrain.kernels.attention import AttentionFn, get_attention
from codatrain.kernels.stages import BackendUnavailableError, StageBackend, get_backend, is_sm90

# The cute stages move every activation and weight row as 16-byte units of a 16-bit dtype (TMA
# strides are multiples of 16 bytes, cp.async vectors 4 to 16 bytes), so their widths are
# multiples of 8 elements. The vocabulary is exempt: real tokenizers leave it ragged, so the
# LM head pads its logits rows internally (codatrain.kernels.cute.head).
ROW_MULTIPLE = 8
# FP8 operands (block.precision=fp8) are 1-byte elements in the same 16-byte rows, in both
# orientations (the weight gradients read token-contiguous copies).
FP8_ROW_MULTIPLE = 16
# The head dims at which FlashAttention 4 (4.0.0b36) on sm_90 computes attention and its gradient
# correctly, as tests/gpu/test_cute_forward.py::test_fa4_attention_at_head_dims measured them on an
# H200: the multiples of 32. It accepts every multiple of 8 up to 256, but its backward is wrong at
# 16, 48, 80, 104 and 112 (dq, dk, dv errors of 0.6 to 0.7 against SDPA).
FA4_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# The head dims of the cute QK-norm (Qwen3's is 128): its QKV GEMM tiles are 128 columns wide and
# must hold whole heads (the per-head statistic stays inside a tile), its backward sums a head over
# one warp's lanes (4 columns each), and its z leaves the epilogue as two half-width 16-byte rows.
# It also builds at 16, but its forward is wrong there on an H200 (qkv error 0.28 against 2.6e-3
# allowed, tests/gpu/test_cute_qknorm.py::test_qknorm_at_small_head_dims; 32, 64 and 128 pass).
QKNORM_HEAD_DIMS = (32, 64, 128)


@dataclass(frozen=True)
class ResolvedBlock:
    impl: str  # eager | coda | liger
    backend: str | None  # coda stage backend: reference | cute (None otherwise)
    attention: str | None  # coda attention: sdpa | fa4 (None otherwise)
    # The coda kernels themselves, loaded and checked against the device once, by `resolve_block`
    # (None when resolved without a device, for precompilation, and for eager and liger).
    stages: StageBackend | None = field(default=None, compare=False, repr=False)
    attention_fn: AttentionFn | None = field(default=None, compare=False, repr=False)

    @property
    def cute_stages(self) -> bool:
        """Whether the CODA stages run as CuTeDSL kernels."""
        return self.backend == "cute"

    @property
    def fa4(self) -> bool:
        """Whether attention runs as FlashAttention 4 (CuTeDSL kernels too), which takes documents
        as varlen offsets rather than flex_attention's block mask."""
        return self.attention == "fa4"

    def unsupported_model(self, dim: int, ffn_dim: int, head_dim: int, *, qkv_bias: bool = False,
                          qk_norm: bool = False, fp8: bool = False) -> str | None:
        """Why this block's kernels cannot run a model of these widths and attention epilogues
        (one line naming the key, and the nearest widths or the block that run it), or None when
        they can; `fp8`: with FP8 layer GEMMs (block.precision=fp8). Any vocabulary runs."""
        widths = {"model.dim": dim, "model.ffn_dim": ffn_dim, "model.head_dim": head_dim}
        if fp8 and self.cute_stages:
            problem = _width_problem(widths, FP8_ROW_MULTIPLE, "with block.precision=fp8 on "
                                     "block.backend=cute: FP8 operands move in 16-byte rows")
            if problem:
                return problem
        if self.cute_stages:
            problem = _width_problem(widths, ROW_MULTIPLE, "on block.backend=cute: its kernels move rows in "
                                     "16-byte units")
            if problem:
                return problem
            if qk_norm and head_dim not in QKNORM_HEAD_DIMS:
                dims = ", ".join(map(str, QKNORM_HEAD_DIMS))
                return (f"model.head_dim={head_dim} does not run with model.qk_norm=true on "
                        f"block.backend=cute, whose QK-norm epilogue takes head dims {dims}; use "
                        "block.backend=reference")
        if self.fa4 and head_dim not in FA4_HEAD_DIMS:
            correct = ", ".join(map(str, FA4_HEAD_DIMS))
            return (f"model.head_dim={head_dim} does not run on block.attention=fa4, which is correct at "
                    f"head dims {correct}; block.attention=sdpa takes any")
        return None

    def describe(self) -> str:
        """The block as the run header shows it, with what ``auto`` chose."""
        if self.impl != "coda":
            return self.impl
        return f"coda (stages {self.backend}, attention {self.attention})"


def _width_problem(widths: dict[str, int], multiple: int, why: str) -> str | None:
    """The first of `widths` (config key → value) that is no multiple of `multiple`, as one line."""
    for key, width in widths.items():
        if width % multiple:
            below = width - width % multiple
            nearest = f"{below} or {below + multiple}" if below else str(multiple)
            return (f"{key}={width} does not run {why}, so it must be a multiple of {multiple} "
                    f"(nearest: {nearest})")
    return None


def resolve_block(impl: str, backend: str, attention: str, device: torch.device | str | None,
                  head_dim: int | None = None) -> ResolvedBlock:
    """The block a run of `impl`/`backend`/`attention` runs on `device`, with ``auto`` decided.

    On an sm_90 GPU ``auto`` loads the cute backend and FA4 (importing them) and takes each that
    loads, warning when the stages fall back; elsewhere it takes reference / sdpa. Attention
    ``auto`` also takes sdpa for a `head_dim` (when given) that FA4 does not run correctly
    (FA4_HEAD_DIMS). An explicit name that cannot run on `device` is a BackendUnavailableError.
    `device` None stands for the precompile target, an sm_90 GPU with the cuda extras installed:
    ``auto`` then means the CuTeDSL kernels, nothing is imported and no kernel object is returned.
    """
    impl, backend, attention = str(impl), str(backend), str(attention)  # a config's StrEnums, by value
    if impl != "coda":
        return ResolvedBlock(impl, None, None)
    if attention == "auto" and head_dim is not None and head_dim not in FA4_HEAD_DIMS:
        warnings.warn(f"block.attention=auto takes sdpa: FlashAttention 4 is not correct at head dim "
                      f"{head_dim} (only at {', '.join(map(str, FA4_HEAD_DIMS))})", stacklevel=2)
        attention = "sdpa"
    if device is None:
        return ResolvedBlock(impl, "cute" if backend == "auto" else backend,
                             "fa4" if attention == "auto" else attention)
    device = torch.device(device)
    hopper = is_sm90(device)
    stages = attention_fn = None
    if backend == "auto":
        backend = "reference"
        if hopper:
            try:
                stages, backend = get_backend("cute", device), "cute"
            except BackendUnavailableError as exc:
                warnings.warn(f"block.backend=auto falls back to the reference stages: {exc}", stacklevel=2)
    if attention == "auto":
        attention = "sdpa"
        if hopper:
            try:
                attention_fn, attention = get_attention("fa4", device), "fa4"
            except BackendUnavailableError:
                pass
    return ResolvedBlock(impl, backend, attention, stages or get_backend(backend, device),
                         attention_fn or get_attention(attention, device))


def portable_block() -> ResolvedBlock:
    """The CODA block of the reference stages and PyTorch's attention, which run on any device."""
    return ResolvedBlock("coda", "reference", "sdpa", get_backend("reference"), get_attention("sdpa"))
