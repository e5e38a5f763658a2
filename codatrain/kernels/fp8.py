"""FP8 numerics of the CODA layer GEMMs (docs/design.md §3, "FP8"): per-tensor delayed scaling, as
Transformer Engine's DelayedScaling. The one home of the formats, the quantization rule, the scale
rule and the amax-history update: the reference stages compute with them and the cute stages must
match them.

- Each of the four layer GEMMs of every layer (QKV, out-projection, gate-up, down) multiplies two
  FP8 operands in forward and dgrad, and in wgrad with `Fp8Recipe.wgrad_fp8` (else the weight
  gradients multiply the activation-dtype tensors): activations and weights in e4m3, gradients in
  the recipe's gradient format (e5m2 by default). The GEMM accumulates the exact products of the FP8
  values in fp32 and multiplies the sum by 1/(s_a·s_b) (`matmul`).
- Quantizing x with scale s writes saturate(x·s) rounded to the nearest FP8 value (ties to even):
  x·s formed in fp32, clamped to ±max of the format (NaN stays NaN), then rounded (`quantize`).
  The producer also returns amax = max |x| of the values it quantized (NaN when one is NaN).
- The scale of an amax a: fp8_max / a / 2**margin, or 1 when a is 0 or not finite (`scale_from_amax`).
- Activations and gradients take delayed scales: the scale used in step t comes from the maximum
  of the amax history, the amaxes of steps < t (newest first, `history_len` of them); a run's
  first step, whose history is empty, scales each tensor by its own current amax. Every quantized
  activation and gradient records its amax of step t, the maximum over micro-batches and
  processes, which `roll_history` puts into the history when the step's update is applied.
- Weights are scaled by their own current amax. They change only at optimizer steps, so their FP8
  copies are the same for every use within a step: a backend may quantize them once per step. A
  weight may also arrive quantized (`Fp8Weight`: FSDP2 gathered it in FP8), by the same rule applied
  to the weight in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The gradient formats `block.fp8_grad_format` names.
GRAD_FORMATS = {"e5m2": E5M2, "e4m3": E4M3}


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format: 448 for e4m3, 57344 for e5m2."""
    return torch.finfo(dtype).max


class QuantizeTo(NamedTuple):
    """What a stage is asked to write in FP8: the format, and the scale (a 0-d fp32 tensor on the
    device) or None for current scaling, the scale from the amax of the values themselves (with
    `margin`), which needs the amax before the values are written: a second pass over them, taken
    only for weights and in a run's first step."""

    dtype: torch.dtype  # E4M3 or E5M2
    scale: torch.Tensor | None
    margin: int = 0  # current scaling only: a delayed scale has its margin in it
    # Also write the transposed copy (`Fp8Tensor.data_t`): the operand of an FP8 GEMM that
    # contracts over its rows (a weight's dgrad, a weight gradient's token-contiguous operands).
    # A layout request only; the values are the same.
    transposed: bool = False
    # With `transposed`, False leaves the row-major copy out: an operand that only GEMMs
    # contracting over its rows read (a weight in its dgrad, a weight gradient's activation
    # operand). `Fp8Tensor.data` is then a view of the transposed copy.
    rows: bool = True


class Fp8Tensor(NamedTuple):
    """An FP8 operand: data ≈ x·scale. A GEMM on FP8 operands writes its outputs in `dtype`, the
    activation dtype of the tensor the operand stands for."""

    data: torch.Tensor  # E4M3 or E5M2, the shape of x
    scale: torch.Tensor  # 0-d fp32
    dtype: torch.dtype
    amax: torch.Tensor | None = None  # 0-d fp32: max |x| of the values quantized, from the producer
    data_t: torch.Tensor | None = None  # data's transpose, contiguous, when the producer wrote one

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> Fp8Tensor:
        """The transposed operand (same scale)."""
        return self._replace(data=self.data.t(), data_t=None)

    def dequantize(self) -> torch.Tensor:
        """data / scale in fp32."""
        return self.data.float() / self.scale


class Fp8Weight(torch.Tensor):
    """A layer GEMM weight that arrives already in FP8: e4m3 bytes `fp8_data` ≈ W·`fp8_scale`,
    standing for a weight of `dtype` (the compute dtype) and the bytes' shape. FSDP2 all-gathers
    the layer weights in this form with `parallel.fp8_all_gather` (codatrain/train/fp8_allgather.py),
    so the model takes its GEMM operands from it (`operand`) instead of quantizing the weight.

    A tensor subclass because it is the module's parameter during forward and backward: autograd
    takes it as a Function input and gives it a gradient of `dtype`. It supports only what FSDP2
    does to an unsharded parameter (detach, as_strided); anything else is an error rather than a
    silent computation on the dequantized values."""

    fp8_data: torch.Tensor
    fp8_scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Fp8Weight:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.fp8_data, self.fp8_scale = data, scale

    def __repr__(self) -> str:
        return f"Fp8Weight({tuple(self.shape)}, {self.fp8_data.dtype} standing for {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func is torch.ops.aten.detach.default:
            return Fp8Weight(weight.fp8_data, weight.fp8_scale, weight.dtype)
        if func is torch.ops.aten.as_strided.default:  # FSDP2 views the gathered bytes in the weight's shape
            return Fp8Weight(func(weight.fp8_data, *args[1:], **kwargs), weight.fp8_scale, weight.dtype)
        raise NotImplementedError(f"{func} on an Fp8Weight: it is an FP8 GEMM operand only")

    def operand(self, *, for_dgrad: bool) -> Fp8Tensor:
        """The GEMM operand, as `quantize` with `Fp8Recipe.weight(for_dgrad=...)` gives it: the rows
        for the forward; for the dgrad (which reads Wᵀ) the transposed copy alone, made from the
        same bytes (a transpose moves FP8 values, it does not round them again)."""
        if not for_dgrad:
            return Fp8Tensor(self.fp8_data, self.fp8_scale, self.dtype)
        data_t = self.fp8_data.t().contiguous()
        return Fp8Tensor(data_t.t(), self.fp8_scale, self.dtype, None, data_t)


def amax(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32: max |x|, NaN when any value is NaN."""
    return x.detach().abs().amax().float()


def scale_from_amax(amax: torch.Tensor, limit: float | torch.Tensor, margin: int) -> torch.Tensor:
    """limit / amax / 2**margin elementwise, `limit` the format's `fp8_max`; 1 where amax is 0 or
    not finite."""
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, limit / amax / 2.0 ** margin, torch.ones_like(amax))


def quantize(x: torch.Tensor, to: QuantizeTo, dtype: torch.dtype | None = None) -> Fp8Tensor:
    """x in FP8 as `to` asks (module docstring), standing for activation dtype `dtype` (default: x's)."""
    xs = x.float()
    x_amax = amax(xs)
    limit = fp8_max(to.dtype)
    scale = scale_from_amax(x_amax, limit, to.margin) if to.scale is None else to.scale
    data = (xs * scale).clamp(-limit, limit).to(to.dtype)
    return Fp8Tensor(data, scale, dtype or x.dtype, x_amax)


def matmul(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """a·b of two FP8 operands in fp32: the products of the FP8 values (exact in fp32) summed in
    fp32, times 1/(s_a·s_b)."""
    if not (isinstance(a, Fp8Tensor) and isinstance(b, Fp8Tensor)):
        raise TypeError(f"an FP8 GEMM takes two FP8 operands, not {type(a).__name__} and {type(b).__name__}")
    return (a.data.float() @ b.data.float()) * (a.scale * b.scale).reciprocal()


def roll_history(history: torch.Tensor, step_amax: torch.Tensor) -> torch.Tensor:
    """The history (..., H), newest first, with `step_amax` (...) put in front and the oldest dropped."""
    return torch.cat((step_amax[..., None], history[..., :-1]), dim=-1)


def delayed_scales(history: torch.Tensor, limit: float | torch.Tensor, margin: int) -> torch.Tensor:
    """The scales (...) of step t from the history (..., H) of steps < t; `limit` as in
    `scale_from_amax`, broadcast against (...)."""
    return scale_from_amax(history.amax(-1), limit, margin)


# ---- the recipe's operands --------------------------------------------------------------------


class Operand(IntEnum):
    """The activations and gradients of one layer that are quantized with a delayed scale, each
    with its own amax history. Layer i's are those of its QKV, out, gate-up and down GEMMs."""

    qkv_in = 0  # h = x ⊙ γ_attn, the QKV GEMM's A operand (forward)
    qkv_wgrad_in = 1  # n = rstd ⊙ x ⊙ γ_attn, the QKV weight gradient's A operand
    qkv_grad = 2  # dz, the gradient of the QKV GEMM output (dgrad and wgrad)
    out_in = 3  # o, the attention output: the out-projection's A operand (forward and wgrad)
    out_grad = 4  # the gradient of the out-projection output
    gate_up_in = 5  # h = x ⊙ γ_mlp (forward)
    gate_up_wgrad_in = 6  # n = rstd ⊙ x ⊙ γ_mlp (wgrad)
    gate_up_grad = 7  # dpreact
    down_in = 8  # y = silu(g)·u (forward; the backward recomputes y with the forward's scale)
    down_grad = 9  # the gradient of the down-projection output


GRAD_OPERANDS = frozenset({Operand.qkv_grad, Operand.out_grad, Operand.gate_up_grad, Operand.down_grad})
# The operands that only a weight gradient reads (in FP8 only with `Fp8Recipe.wgrad_fp8`).
WGRAD_ONLY_OPERANDS = frozenset({Operand.qkv_wgrad_in, Operand.gate_up_wgrad_in})
# The operands an FP8 weight gradient reads, token-contiguous (the forward's y is not one: the
# backward recomputes y, and asks for that copy's transpose itself).
WGRAD_OPERANDS = GRAD_OPERANDS | WGRAD_ONLY_OPERANDS | {Operand.out_in}


@dataclass(frozen=True)
class Fp8Recipe:
    history_len: int = 16  # steps of amax history a delayed scale looks back over
    margin: int = 0  # scales are divided by 2**margin: headroom against an amax that grows
    grad_dtype: torch.dtype = E5M2  # the gradients' format; activations and weights are e4m3
    # The weight gradients in FP8 too. Off, they are GEMMs of the activation-dtype tensors the
    # backward has anyway (torchao's "rowwise_with_gw_hp"): sm_90's FP8 GEMMs read both operands
    # contiguous along the contraction, which for a weight gradient is the tokens, so FP8 weight
    # gradients need a token-contiguous FP8 copy of each of their operands.
    wgrad_fp8: bool = True
    # Every FP8 GEMM stage of the cute backend on fast accumulation (block.fp8_fast_accum); the
    # reference stages compute FP8 products exactly either way.
    fast_accum: bool = False

    def format_of(self, operand: Operand) -> torch.dtype:
        return self.grad_dtype if operand in GRAD_OPERANDS else E4M3

    def operands(self) -> list[Operand]:
        """The operands this recipe quantizes, and so records an amax for, in every layer."""
        unused = set() if self.wgrad_fp8 else WGRAD_ONLY_OPERANDS
        return [op for op in Operand if op not in unused]

    def weight(self, *, for_dgrad: bool) -> QuantizeTo:
        """How a weight is quantized: e4m3, its own current amax; for the dgrad (which reads Wᵀ)
        transposed only, for the forward GEMM its rows only."""
        return QuantizeTo(E4M3, None, self.margin, transposed=for_dgrad, rows=not for_dgrad)

    def describe(self) -> str:
        grads = {v: k for k, v in GRAD_FORMATS.items()}[self.grad_dtype]
        wgrad = "in FP8" if self.wgrad_fp8 else "in the compute dtype"
        accumulation = "; fast accumulation" if self.fast_accum else ""
        return (f"fp8 (e4m3, gradients {grads}, weight gradients {wgrad}; delayed scaling over "
                f"{self.history_len} steps, margin {self.margin}{accumulation})")


class Fp8Step:
    """The scaling of one forward and its backward: the scales of every (layer, operand), and
    where the amaxes go. Made by `Fp8Scaling.step_view`.

    Not a dataclass or a tuple on purpose: the model hands it to its blocks among their forward
    arguments, and FSDP2's mixed precision rebuilds those containers with every floating tensor
    cast to the compute dtype. The amaxes would be recorded into bf16 copies and lost, and the
    scales would reach the kernels in bf16."""

    __slots__ = ("recipe", "scales", "step_amax")

    def __init__(self, recipe: Fp8Recipe, scales: torch.Tensor | None,
                 step_amax: torch.Tensor | None) -> None:
        self.recipe = recipe
        self.scales = scales  # (layers, len(Operand)) fp32; None: the first step, current scaling
        self.step_amax = step_amax  # (layers, len(Operand)) fp32, maxed into; None: not recorded

    def to(self, layer: int, operand: Operand) -> QuantizeTo:
        scale = None if self.scales is None else self.scales[layer, operand]
        transposed = self.recipe.wgrad_fp8 and operand in WGRAD_OPERANDS
        # Only a weight gradient reads the WGRAD_ONLY operands: their transposed copy alone.
        rows = not (transposed and operand in WGRAD_ONLY_OPERANDS)
        return QuantizeTo(self.recipe.format_of(operand), scale, self.recipe.margin, transposed, rows)

    def record(self, layer: int, operand: Operand, quantized: Fp8Tensor) -> None:
        if self.step_amax is not None:
            slot = self.step_amax[layer, operand]
            torch.maximum(slot, quantized.amax, out=slot)


class Fp8Scaling:
    """The delayed-scaling state of a model: training state, checkpointed beside the optimizer's.

    history (layers, len(Operand), history_len) fp32, newest first; `steps` the number of steps
    recorded; step_amax the running amax of the step under way. The scales change only in
    `commit_step`, after an optimizer step: all micro-batches of a step use the same scales."""

    def __init__(self, recipe: Fp8Recipe, n_layers: int, device: torch.device | str = "cpu") -> None:
        self.recipe = recipe
        fp32 = {"dtype": torch.float32, "device": device}  # whatever the default dtype where it is built
        self.history = torch.zeros(n_layers, len(Operand), recipe.history_len, **fp32)
        self.step_amax = torch.zeros(n_layers, len(Operand), **fp32)
        self.steps = 0
        self.scales: torch.Tensor | None = None
        # (len(Operand),) fp32: the largest value of each operand's format, for `delayed_scales`;
        # made once, since a host-to-device copy each step would wait for the device.
        self.limits = torch.tensor([fp8_max(recipe.format_of(op)) for op in Operand], **fp32)

    def to(self, device: torch.device) -> None:
        """Move the state to `device` (a model built on the meta device holds it on the CPU)."""
        self.history, self.step_amax = self.history.to(device), self.step_amax.to(device)
        self.limits = self.limits.to(device)
        self.scales = None if self.scales is None else self.scales.to(device)

    def step_view(self, record: bool) -> Fp8Step:
        return Fp8Step(self.recipe, self.scales, self.step_amax if record else None)

    def nonfinite(self) -> list[str]:
        """The (layer, operand)s whose amax of the step under way is inf or NaN."""
        bad = (~torch.isfinite(self.step_amax)).nonzero().tolist()
        return [f"layer {layer} {Operand(op).name}" for layer, op in bad]

    def commit_step(self) -> None:
        """The step's update was applied: its amaxes enter the history and give the next scales."""
        self.history = roll_history(self.history, self.step_amax)
        self.steps += 1
        self.scales = delayed_scales(self.history, self.limits, self.recipe.margin)
        self.step_amax.zero_()

    def discard_step(self) -> None:
        """The step's update was skipped: its amaxes are forgotten."""
        self.step_amax.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.history, "steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.history = state["amax_history"].to(self.history.device, torch.float32)
        self.steps = int(state["steps"])
        self.scales = None if self.steps == 0 else delayed_scales(self.history, self.limits,
                                                                  self.recipe.margin)
        self.step_amax.zero_()
