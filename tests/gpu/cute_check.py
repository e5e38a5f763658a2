"""Shared pieces of the GPU kernel tests: shapes, random operands, and the numerics criterion.

Criterion (docs/design.md §5): on fresh random bf16 inputs, the error of a cute output against the
reference stage run in fp32 is at most twice the error of the reference stage run in bf16 (both
as ‖out − ref‖ / ‖ref‖; a floor of 1e-6 covers outputs that bf16 cannot perturb, such as fp32
statistics of fp32 inputs). The tests fill every output buffer a stage allocates with NaN first
(`poison`), so an element a kernel fails to write cannot pass. Every stage test runs the stage
called directly and under `torch.compile(fullgraph=True)` (`use_compile`, in conftest.py; `staged`),
as QuACK's tests do: the compiled path goes through the custom ops, the direct one around them.

This module imports neither quack nor the cute backend, so collecting the tests on a machine
without them still works (the test modules skip themselves there).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from codatrain.kernels.stages import Rope, RopeType

DEVICE = torch.device("cuda")
EPS = 1e-5
FLOOR = 1e-6


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # M
    seq_len: int  # tokens per sequence (M = batch · seq_len)
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


# Llama-3-8B block widths at M = 8192 tokens, and a smaller model whose M, vocab and MLP width
# are not multiples of any GEMM tile.
SHAPES = [
    Shape("llama3_8b", 8192, 4096, 4096, 32, 8, 128, 14336, 128256),
    Shape("ragged", 1000, 500, 1024, 8, 2, 128, 2816, 50264),
]


# Llama 3's RoPE, and Llama 3.2's scaling with a short pretraining context, so that the positions
# of the shapes above reach past it.
ROPES = {
    "default": Rope(500000.0),
    "llama3": Rope(500000.0, RopeType.llama3, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_positions=256),
}


def poison(monkeypatch, *modules) -> None:
    """Make the `empty(*shape, like=..., dtype=...)` allocator (codatrain.kernels.cute.common)
    that each module calls return NaN."""

    def poisoned_empty(*shape: int, like: torch.Tensor, dtype: torch.dtype | None = None):
        return torch.full(shape, math.nan, dtype=dtype or like.dtype, device=like.device)

    for module in modules:
        monkeypatch.setattr(module, "empty", poisoned_empty)


def staged(fn: Callable, use_compile: bool) -> Callable:
    """`fn` itself, or `fn` under torch.compile(fullgraph=True), where a graph break raises."""
    return torch.compile(fn, fullgraph=True, dynamic=False) if use_compile else fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# The criterion `check` applies: error ≤ max(factor × bf16's, floor). `loosened` changes it inside
# a block, for the one path held to another bound (FP8 fast accumulation everywhere).
_criterion = {"factor": 2.0, "floor": 0.0}


@contextlib.contextmanager
def loosened(factor: float, floor: float) -> Iterator[None]:
    saved = dict(_criterion)
    _criterion.update(factor=factor, floor=floor)
    try:
        yield
    finally:
        _criterion.update(saved)


def check(name: str, cute: torch.Tensor, bf16_ref: torch.Tensor, fp32_ref: torch.Tensor,
          floor: float = FLOOR) -> None:
    assert cute.shape == fp32_ref.shape, f"{name}: shape {tuple(cute.shape)} != {tuple(fp32_ref.shape)}"
    assert torch.isfinite(cute).all(), f"{name}: non-finite values (unwritten or overflowed)"
    err, bf16_err = rel_err(cute, fp32_ref), rel_err(bf16_ref, fp32_ref)
    factor, floor = _criterion["factor"], max(floor, _criterion["floor"])
    print(f"{name}: cute {err:.3e}  reference-bf16 {bf16_err:.3e}")
    assert err <= max(factor * bf16_err, floor), (
        f"{name}: error {err:.3e} > {factor:g} × bf16 reference {bf16_err:.3e} (floor {floor:.1e})")


# ---- FP8 operands (block.precision=fp8) ------------------------------------------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The error floor of an fp32 statistic reduced from an FP8 GEMM's accumulator (dγ, dSwiGLU's zdz).
# Hopper's FP8 tensor cores keep about 14 bits of each k-block's sum before the mainloop promotes
# it to fp32 (DeepSeek-V3 §3.3.2), so such statistics carry ~1e-4 relative error (measured
# 1.0–1.1e-4 at both test shapes), which the reference on the same FP8 operands (fp32 sums of the
# exact products) shows neither in fp32 nor in bf16.
FP8_ACCUMULATOR_FLOOR = 2**-12


def saturate(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x·scale in fp32, clamped to the format's range, rounded to it (torch's cast is not saturating)."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def to_fp8(t: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """t as an FP8 operand scaled to its own amax: (data, 0-d fp32 scale)."""
    scale = torch.finfo(dtype).max / t.float().abs().amax()
    return saturate(t, scale, dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.float() / scale


def check_fp8(name: str, out: torch.Tensor, scale: torch.Tensor, truth: torch.Tensor) -> None:
    """FP8 `out` (scale `scale`) against the fp32 `truth`, within twice FP8's own error."""
    assert out.dtype in (E4M3, E5M2) and out.shape == truth.shape, f"{name}: {out.dtype} {tuple(out.shape)}"
    assert not torch.isnan(out.float()).any(), f"{name}: NaN (unwritten)"
    err = rel_err(dequantize(out, scale), truth)
    own = rel_err(dequantize(saturate(truth, scale, out.dtype), scale), truth)
    print(f"{name}: cute {err:.3e}  FP8's own {own:.3e}")
    assert err <= 2 * own, f"{name}: error {err:.3e} > 2 × FP8's own {own:.3e}"


def run_both(ref, method: str, *args, **kwargs):
    """The reference stage on the bf16 inputs and on their fp32 upcasts."""
    up = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    return getattr(ref, method)(*args, **kwargs), getattr(ref, method)(*up, **kwargs)


def head_dweight(stages, head, dtype: torch.dtype, use_compile: bool = False) -> torch.Tensor:
    """The LM head's weight gradient from `lm_head_ce`'s output `head`, as the model's backward
    forms it: for a loss gradient that is not 1, rounded to `dtype`."""
    scale = torch.tensor(0.37, device=DEVICE)
    finish = staged(stages.lm_head_dweight, use_compile)
    return finish(head.dweight, head.last_dlogits, head.last_n, scale, dtype)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16)


def gamma(dim: int) -> torch.Tensor:
    return (torch.rand(dim, device=DEVICE) + 0.5).to(torch.bfloat16)


def rstd_of(rows: int) -> torch.Tensor:
    return torch.rand(rows, device=DEVICE) + 0.5


def positions(shape: Shape) -> torch.Tensor:
    return torch.arange(shape.tokens, device=DEVICE) % shape.seq_len


# ---- model level: a bf16 model against an fp32 truth, with a bf16 baseline as the error scale ----
LOSS_RTOL_FLOOR = 5e-3
GRAD_RTOL_FLOOR = 1e-2


@torch.no_grad()
def load_canonical(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The canonical `state` into `model`'s parameters, through its layout table, on DEVICE."""
    layout = model.layout()
    for name, param in model.named_parameters():
        param.copy_(layout[name].to_native(state[layout[name].name].to(DEVICE, param.dtype)))


def model_failures(name: str, label: str, loss: float, loss16: float, loss32: float,
                   grads: dict[str, torch.Tensor], grads16: dict[str, torch.Tensor],
                   grads32: dict[str, torch.Tensor]) -> list[str]:
    """What fails the model-level criterion: the loss further from the fp32 truth's than twice the
    bf16 baseline's distance (floor LOSS_RTOL_FLOOR relative), a gradient's error against fp32 above
    twice the bf16 baseline's (floor GRAD_RTOL_FLOOR). Prints the losses and the worst gradient."""
    loss_tol = max(2 * abs(loss16 - loss32), LOSS_RTOL_FLOOR * abs(loss32))
    print(f"{name}: loss fp32 {loss32:.6f}  bf16 baseline {loss16:.6f}  {label} {loss:.6f}")
    failures = []
    if not abs(loss - loss32) <= loss_tol:
        failures.append(f"loss {loss:.6f} vs fp32 {loss32:.6f} (tolerance {loss_tol:.2e})")
    worst = (0.0, "")
    for param, ref in grads32.items():
        err, bf16_err = rel_err(grads[param], ref), rel_err(grads16[param], ref)
        tol = max(2 * bf16_err, GRAD_RTOL_FLOOR)
        worst = max(worst, (err / tol, f"{param}: {label} {err:.2e}, bf16 baseline {bf16_err:.2e}"))
        if not err <= tol:
            failures.append(f"grad {param}: {label} {err:.3e} > tolerance {tol:.3e} (bf16 {bf16_err:.3e})")
    print(f"{name}: worst gradient (error / tolerance {worst[0]:.2f}) {worst[1]}")
    return failures
