"""FP8 CODA (block.precision=fp8), its numerics and its reference stages (codatrain/kernels/fp8.py):
the quantization against torch's own float8 casts, the scale and history rules, the FP8 stages
against the same math on dequantized operands, and the model's loss and gradients against fp64
within FP8's own error."""

import importlib.util
import weakref

import pytest
import torch
from model_states import random_canonical_state
from test_coda import CONFIGS, batch, canonical_grads, load_canonical

from codatrain.kernels import fp8
from codatrain.kernels.attention import sdpa_attention
from codatrain.kernels.fp8 import (
    E4M3,
    E5M2,
    Fp8Recipe,
    Fp8Scaling,
    Fp8Tensor,
    Operand,
    QuantizeTo,
    delayed_scales,
    fp8_max,
    roll_history,
    scale_from_amax,
)
from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.resolve import ResolvedBlock
from codatrain.kernels.stages import get_backend
from codatrain.model.coda import CodaLlama

FORMATS = [E4M3, E5M2]


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 format, and the midpoints between neighbours (the ties)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)].unique()
    return torch.cat([values, (values[1:] + values[:-1]) / 2])


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_quantize_is_torchs_float8_cast_with_saturation(dtype):
    g = torch.Generator().manual_seed(0)
    limit = fp8_max(dtype)
    x = torch.cat([fp8_grid(dtype), torch.randn(4096, generator=g) * limit / 8,
                   torch.tensor([limit * 1.5, -limit * 4, 1e-12])])
    unit = fp8.quantize(x, QuantizeTo(dtype, torch.tensor(1.0)))
    # Within range the cast is torch's (round to nearest, ties to even); beyond, it saturates.
    torch.testing.assert_close(unit.data.float(), x.clamp(-limit, limit).to(dtype).float(), rtol=0, atol=0)
    assert unit.amax == x.abs().max() and unit.dtype == torch.float32
    # A scale s quantizes x·s (formed in fp32) and dequantizes by dividing by s.
    scale = torch.tensor(3.0)
    scaled = fp8.quantize(x / 64, QuantizeTo(dtype, scale))
    torch.testing.assert_close(scaled.data.float(), (x / 64 * scale).clamp(-limit, limit).to(dtype).float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(scaled.dequantize(), scaled.data.float() / 3.0, rtol=0, atol=0)
    nan = fp8.quantize(torch.tensor([1.0, float("nan")]), QuantizeTo(dtype, torch.tensor(1.0)))
    assert nan.amax.isnan() and nan.data.float()[1].isnan()


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_current_scaling_maps_the_amax_to_the_formats_largest_value_less_the_margin(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-4
    for margin in (0, 2):
        q = fp8.quantize(x, QuantizeTo(dtype, None, margin))
        assert q.scale == pytest.approx(fp8_max(dtype) / x.abs().max().item() / 2 ** margin, rel=1e-6)
        assert q.data.float().abs().max() == pytest.approx(fp8_max(dtype) / 2 ** margin, rel=0.07)
    assert scale_from_amax(torch.tensor([0.0, float("inf"), float("nan"), 2.0]), 448.0, 1).tolist() == [
        1.0, 1.0, 1.0, 112.0]


def test_delayed_scales_come_from_the_history_of_earlier_steps_only():
    history = torch.zeros(3)
    for amax in (2.0, 8.0, 1.0, 0.5):
        history = roll_history(history, torch.tensor(amax))
    assert history.tolist() == [0.5, 1.0, 8.0]  # newest first; the oldest (2) dropped
    assert delayed_scales(history, 448.0, 0).item() == 56.0  # the history's max, 8

    scaling = Fp8Scaling(Fp8Recipe(history_len=2, margin=1), n_layers=1)
    assert scaling.scales is None  # the first step: every tensor scales by its own current amax
    step = scaling.step_view(record=True)
    # A gradient the FP8 weight gradient reads token-contiguous: quantized into both orientations.
    assert step.to(0, Operand.qkv_grad) == QuantizeTo(E5M2, None, 1, transposed=True)
    # What only a weight gradient reads (n), and a weight in its dgrad: the transposed copy alone.
    assert step.to(0, Operand.gate_up_wgrad_in) == QuantizeTo(E4M3, None, 1, transposed=True, rows=False)
    assert scaling.recipe.weight(for_dgrad=True) == QuantizeTo(E4M3, None, 1, transposed=True, rows=False)
    assert scaling.recipe.weight(for_dgrad=False) == QuantizeTo(E4M3, None, 1)
    assert step.to(0, Operand.qkv_in) == QuantizeTo(E4M3, None, 1)  # the forward's h: rows only
    for amax in (3.0, 7.0):  # two micro-batches: the step records their max
        step.record(0, Operand.down_in, fp8.quantize(torch.tensor([amax]), step.to(0, Operand.down_in)))
    scaling.commit_step()
    assert scaling.scales[0, Operand.down_in].item() == pytest.approx(448 / 7 / 2)
    assert scaling.scales[0, Operand.out_in].item() == 1.0  # nothing recorded: scale 1
    assert scaling.step_view(record=False).step_amax is None and scaling.step_amax.abs().sum() == 0


def operands(rows, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows if s is None else s, generator=g) for s in shapes]


def test_fp8_stages_compute_the_fp32_math_of_their_dequantized_operands():
    """What a cute FP8 stage must compute: the reference stage of the dequantized operands (in
    fp64 here), with each FP8 output the quantization of its unrounded fp32 value."""
    s = get_backend("reference")
    m, d, f = 40, 24, 16
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def q(x, dtype=E4M3):
        return fp8.quantize(x, QuantizeTo(dtype, None))

    def dq(t):
        return t.dequantize().double()

    def close(actual, expected):
        atol = 2e-5 * expected.abs().max().item()
        torch.testing.assert_close(actual.double(), expected, rtol=2e-5, atol=atol)

    a, w, res, gamma, rstd = q(rand(m, f)), q(rand(d, f) * 0.1), rand(m, d), rand(d), rand(m).abs() + 0.5
    to = QuantizeTo(E4M3, torch.tensor(20.0))
    out = s.gemm_residual_rms(a, w, res, gamma, h_fp8=to)
    ref = s.gemm_residual_rms(dq(a), dq(w), res.double(), gamma.double())
    close(out.x, ref.x)
    close(out.sq_partials, ref.sq_partials)
    # h is quantized from the fp32 epilogue's x ⊙ γ (x as written in fp32 here).
    assert torch.equal(out.h.data, fp8.quantize(out.x * gamma, to).data) and out.h.amax is not None

    h, w_gu = q(rand(m, d)), q(rand(2 * f, d) * 0.1)
    sw = s.gemm_rstd_swiglu(h, w_gu, rstd, y_fp8=to)
    sw_ref = s.gemm_rstd_swiglu(dq(h), dq(w_gu), rstd.double())
    close(sw.preact, sw_ref.preact)
    close(sw.y.dequantize(), fp8.quantize(sw_ref.y, to).dequantize().double())

    dz, x = q(rand(m, 2 * f) * 1e-3, E5M2), rand(m, d)
    zdz = rand(m)
    bwd = s.gemm_rms_bwd_fp8(dz, w_gu, x, gamma, rstd, zdz, res, n_fp8=QuantizeTo(E4M3, None),
                             dx_fp8=QuantizeTo(E5M2, None))
    bwd_ref = s.gemm_rms_bwd(dq(dz), dq(w_gu), x.double(), gamma.double(), rstd.double(), zdz.double(),
                             res.double())
    close(bwd.dx, bwd_ref.dx)
    close(bwd.dgamma_partials, bwd_ref.dgamma_partials)
    assert torch.equal(bwd.dx_fp8.data, fp8.quantize(bwd.dx, QuantizeTo(E5M2, None)).data)
    assert torch.equal(bwd.n.data, fp8.quantize(bwd_ref.n.float(), QuantizeTo(E4M3, None)).data)

    preact, dout, w_down = rand(m, 2 * f), q(rand(m, d) * 1e-3, E5M2), q(rand(d, f) * 0.1)
    ds = s.gemm_dswiglu(dout, w_down, preact, dpreact_fp8=QuantizeTo(E5M2, None), y_fp8=to)
    ds_ref = s.gemm_dswiglu(dq(dout), dq(w_down), preact.double())
    close(ds.zdz, ds_ref.zdz)
    assert torch.equal(ds.dpreact.data, fp8.quantize(ds_ref.dpreact.float(), QuantizeTo(E5M2, None)).data)
    assert torch.equal(ds.y.data, fp8.quantize(ds_ref.y.float(), to).data)

    close(s.dgrad(dz, w_gu), dq(dz) @ dq(w_gu))
    close(s.wgrad(dz, h), dq(dz).t() @ dq(h))


def fp8_gradient_errors(name: str, grad_dtype: torch.dtype,
                        wgrad_fp8: bool) -> tuple[float, dict[str, float]]:
    """The relative error of the FP8 model's loss and of each parameter gradient against the
    fp64 model, both the reference CODA model on the same random weights and batch."""
    cfg = CONFIGS[name]
    state = random_canonical_state(cfg, torch.float64, 0)
    exact = CodaLlama(cfg).double()
    load_canonical(exact, state)
    tokens, targets = batch(cfg, 2, 13, ignore=True)
    exact_loss = exact(tokens, targets)
    exact_loss.backward()
    model = CodaLlama(cfg, fp8=Fp8Recipe(grad_dtype=grad_dtype, wgrad_fp8=wgrad_fp8))
    load_canonical(model, {k: v.float() for k, v in state.items()})
    loss = model(tokens, targets)
    loss.backward()
    expected, actual = canonical_grads(exact), canonical_grads(model)
    errors = {k: ((actual[k].double() - v).norm() / v.norm()).item() for k, v in expected.items()}
    return abs(loss.item() / exact_loss.item() - 1), errors


def quantization_error(dtype: torch.dtype) -> float:
    """The relative (norm) error of quantizing normal data with current scaling: FP8's own error."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return ((fp8.quantize(x, QuantizeTo(dtype, None)).dequantize().double() - x).norm() / x.norm()).item()


@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["wgrad_fp8", "wgrad_bf16"])
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
@pytest.mark.parametrize("name", ["mha-L1", "gqa4-L2", "gqa2-L3", "llama3-tied-L2", "mqa6-L5",
                                  "qwen2-bias-L3", "qwen3-qknorm-L3"])
def test_fp8_loss_and_every_gradient_are_within_fp8s_own_error_of_fp64(name, grad_format, wgrad_fp8):
    """The criterion: with ε the measured relative error of quantizing an operand (e4m3: 0.026,
    e5m2: 0.053) and L the layers, every gradient's relative error against fp64 is at most
    2·(L + 1)·(ε_e4m3 + ε_grad) (errors grow through the layers: measured 1.5–4.5× the sum at L =
    1–5, about half the bound) and at least 0.1× that sum (measured ≥ 0.34×: the quantization
    happened); the loss is within ε_e4m3 (measured ≤ 0.14 ε)."""
    grad_dtype = fp8.GRAD_FORMATS[grad_format]
    eps = quantization_error(E4M3) + quantization_error(grad_dtype)
    loss_error, errors = fp8_gradient_errors(name, grad_dtype, wgrad_fp8)
    bound = 2 * (CONFIGS[name].n_layers + 1) * eps
    assert loss_error < quantization_error(E4M3)
    assert max(errors.values()) < bound, max(errors.items(), key=lambda kv: kv[1])
    assert min(errors.values()) > 0.1 * eps, min(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["wgrad_fp8", "wgrad_bf16"])
@pytest.mark.parametrize("name", ["gqa2-L3", "qwen2-bias-L3", "qwen3-qknorm-L3"])
def test_evaluation_records_no_amax_and_training_records_every_operand_of_the_recipe(name, wgrad_fp8):
    """Qwen2's QKV bias and Qwen3's QK-norm included: their dz reaches FP8 after the bias gradient
    and the QK-norm's backward, and its amax is recorded as the RoPE backward's is."""
    cfg = CONFIGS[name]
    recipe = Fp8Recipe(wgrad_fp8=wgrad_fp8)
    model = CodaLlama(cfg, fp8=recipe)
    tokens, targets = batch(cfg, 2, 13, ignore=False)
    with torch.no_grad():
        model(tokens, targets)
    assert model.fp8_scaling.step_amax.abs().sum() == 0
    model(tokens, targets).backward()
    used = recipe.operands()
    assert len(used) == (10 if wgrad_fp8 else 8)
    assert (model.fp8_scaling.step_amax[:, used] > 0).all()  # every (layer, operand) of the recipe
    unused = [op for op in fp8.Operand if op not in used]
    assert (model.fp8_scaling.step_amax[:, unused] == 0).all()


def saved_activation_bytes(model: CodaLlama, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct tensors the forward keeps for the backward, parameters and 0-d tensors
    (FP8 scales) left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.dim() > 0 and storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(tokens, targets)
    return sum(kept.values())


@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["wgrad_fp8", "wgrad_bf16"])
def test_the_fp8_model_keeps_no_more_for_its_backward_than_the_compute_dtype_model(wgrad_fp8):
    """FP8 must not cost activation memory: attention's output, which the out-projection's weight
    gradient reads, stays the tensor attention keeps anyway (its FP8 copy is made in the backward)."""
    cfg = CONFIGS["gqa2-L3"]
    tokens, targets = batch(cfg, 2, 16, ignore=False)
    compute = CodaLlama(cfg).to(torch.bfloat16)
    fp8_model = CodaLlama(cfg, fp8=Fp8Recipe(wgrad_fp8=wgrad_fp8)).to(torch.bfloat16)
    kept_fp8, kept_compute = (saved_activation_bytes(m, tokens, targets) for m in (fp8_model, compute))
    assert kept_fp8 <= kept_compute


class RecordingStages(ReferenceStages):
    """The reference stages, recording every `quantize` call: the input's shape, the request, and
    the shapes of the FP8 copies made before it that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], QuantizeTo, list[tuple[int, ...]]]] = []
        self._made: list[tuple[tuple[int, ...], weakref.ref]] = []
        self.inputs: list[torch.Tensor] = []

    def quantize(self, x: torch.Tensor, to: QuantizeTo) -> Fp8Tensor:
        alive = [shape for shape, data in self._made if data() is not None]
        self.calls.append((tuple(x.shape), to, alive))
        self.inputs.append(x)
        quantized = super().quantize(x, to)
        self._made.append((tuple(x.shape), weakref.ref(quantized.data)))
        return quantized


def test_the_qkv_bias_gradient_sums_the_dz_that_then_reaches_fp8():
    """With a QKV bias the RoPE backward writes dz in the activation dtype: the bias gradient sums
    those values (not their FP8 copy, FP8's few % of error on every element), and that same dz is
    then quantized for the QKV GEMMs' dgrad and weight gradient."""
    cfg = CONFIGS["qwen2-bias-L3"]
    summed: list[torch.Tensor] = []

    class Stages(RecordingStages):
        def bias_grad(self, dz: torch.Tensor) -> torch.Tensor:
            summed.append(dz)
            return super().bias_grad(dz)

    stages = Stages()
    block = ResolvedBlock("coda", "reference", "sdpa", stages, sdpa_attention)
    model = CodaLlama(cfg, block, fp8=Fp8Recipe())
    tokens, targets = batch(cfg, 2, 16, ignore=False)
    model(tokens, targets).backward()
    assert len(summed) == cfg.n_layers
    qkv_grad = {id(x) for x, (_, to, _) in zip(stages.inputs, stages.calls, strict=True)
                if to.transposed and x.shape == summed[0].shape}
    for dz in summed:
        assert isinstance(dz, torch.Tensor) and dz.dtype == torch.float32
        assert id(dz) in qkv_grad


def weight_quantize_calls(cfg_name: str):
    """(the layer weights by name, the forward's and the backward's `quantize` calls on them) of
    one FP8 training step of the reference model."""
    cfg = CONFIGS[cfg_name]
    stages = RecordingStages()
    block = ResolvedBlock("coda", "reference", "sdpa", stages, sdpa_attention)
    model = CodaLlama(cfg, block, fp8=Fp8Recipe())
    weights = {name: p for name, p in model.named_parameters()
               if name.split(".")[-1].startswith("w_") and "lm_head" not in name}
    shapes = {tuple(p.shape) for p in weights.values()}
    tokens, targets = batch(cfg, 2, 16, ignore=False)
    loss = model(tokens, targets)
    forward = [call for call in stages.calls if call[0] in shapes]
    stages.calls.clear()
    loss.backward()
    return weights, forward, [call for call in stages.calls if call[0] in shapes]


def test_the_backward_quantizes_each_weight_transposed_alone_with_the_forwards_scale():
    """A weight's amax is taken once per forward (current scaling): its dgrad copy in the backward
    reuses the forward's scale (the weight has not changed) and writes Wᵀ alone."""
    weights, forward, backward = weight_quantize_calls("gqa2-L3")
    assert len(forward) == len(backward) == 4 * CONFIGS["gqa2-L3"].n_layers
    assert all(to.scale is None and to.rows and not to.transposed for _, to, _ in forward)
    assert all(to.scale is not None and to.transposed and not to.rows for _, to, _ in backward)
    current = [fp8.scale_from_amax(fp8.amax(p), fp8.fp8_max(E4M3), 0).item() for p in weights.values()]
    assert sorted(to.scale.item() for _, to, _ in backward) == sorted(current)


def test_the_backward_holds_one_fp8_weight_copy_at_a_time():
    """The backward's FP8 weight copies are made where they are read and dropped after: when one is
    made, no other is alive (the last layer's backward runs beside the LM head's buffers, at the
    step's peak memory; each copy of W_gu is 0.1 GiB at 8B widths)."""
    weights, _, backward = weight_quantize_calls("gqa2-L3")
    shapes = {tuple(p.shape) for p in weights.values()}
    alive = [[shape for shape in alive if shape in shapes] for _, _, alive in backward]
    assert len(backward) == 4 * CONFIGS["gqa2-L3"].n_layers and not any(alive), alive


@pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("cutlass", "quack")),
                    reason="needs the cuda extras")
def test_dpreacts_fp8_copies_take_the_memory_of_preact():
    """dSwiGLU reads preact for the last time, so the cute backend writes dpreact's two FP8 copies
    into preact's memory (`reuse_preact`, which the model passes): together they fill its bytes
    exactly, rows first, the transposed copy on a 16-byte boundary. At llama3_1b 4×8192 that took
    FP8 CODA's peak from 0.75 GiB above bf16 CODA's to 0.006 (`scripts/memory_report.py`).
    Where the memory does not hold them, or would misalign the second, they are new tensors."""
    from codatrain.kernels.cute.quantize import fp8_buffers

    e5m2 = torch.float8_e5m2
    preact = torch.zeros(32, 48, dtype=torch.bfloat16)
    rows, transposed = fp8_buffers(preact.shape, QuantizeTo(e5m2, None, transposed=True), preact.device,
                                    preact)
    assert rows.shape == (32, 48) and transposed.shape == (48, 32) and rows.dtype == transposed.dtype == e5m2
    base = preact.untyped_storage().data_ptr()
    assert rows.untyped_storage().data_ptr() == transposed.untyped_storage().data_ptr() == base
    assert rows.data_ptr() == base and transposed.data_ptr() == base + 32 * 48
    rows.fill_(1.0)
    transposed.fill_(2.0)  # 0x40 in e5m2 bytes: preact's second half, 0x4040 as bf16 = 3.0
    assert (preact.view(-1)[: 32 * 24] != 0).all() and (preact.view(-1)[32 * 24:] == 3.0).all()
    # The transposed copy alone goes at the start; the rows alone as well.
    alone = QuantizeTo(e5m2, None, transposed=True, rows=False)
    assert fp8_buffers(preact.shape, alone, preact.device, preact)[1].data_ptr() == base
    # Too small, or a second copy that would start off a 16-byte boundary (9 × 8 bytes): new memory.
    for into, shape in ((torch.zeros(10, 48, dtype=torch.bfloat16), (32, 48)),
                        (torch.zeros(9, 8, dtype=torch.bfloat16), (9, 8))):
        fresh = fp8_buffers(shape, QuantizeTo(e5m2, None, transposed=True), into.device, into)
        assert all(t.untyped_storage().data_ptr() != into.untyped_storage().data_ptr() for t in fresh)


@pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("cutlass", "quack")),
                    reason="needs the cuda extras")
def test_preacts_memory_is_released_where_the_one_pass_dswiglu_cannot_reuse_it():
    """The one-pass FP8 dSwiGLU writes dpreact's copies beside preact (it reads preact as it writes),
    then frees preact's memory (`reuse_preact`), though autograd holds preact until the backward
    returns: 4F bytes a token that otherwise stay alive beside dpreact's copies through the rest of
    the MLP backward. A tensor that shares its storage is left alone; so is the backward's result."""
    from codatrain.kernels.cute.backend import _release

    class Saving(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            preact = x * 2
            ctx.save_for_backward(preact)
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            (preact,) = ctx.saved_tensors
            dx = grad * preact.sum()
            _release(preact)
            assert preact.untyped_storage().nbytes() == 0
            return dx

    x = torch.randn(8, 4, requires_grad=True)
    Saving.apply(x).sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 2 * x.detach().sum().item()))
    whole = torch.zeros(8, 4)
    for shared in (whole[:4], whole[:, :2], whole.t()):
        _release(shared)
        assert whole.untyped_storage().nbytes() == whole.numel() * 4


@pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("cutlass", "quack")),
                    reason="needs the cuda extras")
def test_after_the_first_step_the_backward_asks_for_what_the_one_pass_stages_write():
    """With FP8 weight gradients the cute backend takes the cuBLAS dgrad + one-pass path for dSwiGLU
    and the norm backward only where the model asks for what those passes write (delayed scales,
    n and y token-contiguous alone): so every stage of every step after a run's first, and none of
    the first's (current scaling), which the fused epilogues serve."""
    from codatrain.kernels.cute.fp8_bwd_stages import one_pass_dswiglu, one_pass_rms_bwd

    asked: list[tuple[str, bool]] = []

    class Watching(ReferenceStages):
        def gemm_dswiglu(self, *args, dpreact_fp8=None, y_fp8=None, **kwargs):
            asked.append(("dswiglu", one_pass_dswiglu(dpreact_fp8, y_fp8)))
            return super().gemm_dswiglu(*args, dpreact_fp8=dpreact_fp8, y_fp8=y_fp8, **kwargs)

        def gemm_rms_bwd_fp8(self, *args, n_fp8, dx_fp8=None, **kwargs):
            asked.append(("rms_bwd", one_pass_rms_bwd(n_fp8, dx_fp8)))
            return super().gemm_rms_bwd_fp8(*args, n_fp8=n_fp8, dx_fp8=dx_fp8, **kwargs)

    cfg = CONFIGS["gqa2-L3"]
    block = ResolvedBlock("coda", "reference", "sdpa", Watching(), sdpa_attention)
    model = CodaLlama(cfg, block, fp8=Fp8Recipe())
    tokens, targets = batch(cfg, 2, 16, ignore=False)
    for step in range(2):
        asked.clear()
        model(tokens, targets).backward()
        model.fp8_scaling.commit_step()
        # Per layer: dSwiGLU, the gate/up norm backward and the QKV one.
        assert sorted(name for name, _ in asked) == sorted(["dswiglu", "rms_bwd", "rms_bwd"] * cfg.n_layers)
        assert all(one_pass == (step > 0) for _, one_pass in asked), (step, asked)


def test_the_model_lets_dswiglu_reuse_preact():
    """The MLP backward hands dSwiGLU permission to reuse preact's memory (preact is read there for
    the last time), in every precision."""
    calls = []

    class Watching(ReferenceStages):
        def gemm_dswiglu(self, *args, reuse_preact=False, **kwargs):
            calls.append(reuse_preact)
            return super().gemm_dswiglu(*args, **kwargs)

    cfg = CONFIGS["gqa2-L3"]
    for recipe in (None, Fp8Recipe()):
        block = ResolvedBlock("coda", "reference", "sdpa", Watching(), sdpa_attention)
        model = CodaLlama(cfg, block, fp8=recipe)
        tokens, targets = batch(cfg, 2, 16, ignore=False)
        model(tokens, targets).backward()
    assert calls == [True] * (2 * cfg.n_layers), calls


def test_every_layers_dx_reaches_dswiglu_with_its_rows_alone():
    """Each dSwiGLU reads its dx (the LM head's, or the next layer's QKV dgrad's) as FP8 rows only:
    the token-contiguous FP8 copy, which only dW_down reads, is asked for after dSwiGLU (from dx
    with the rows' scale, the same FP8 values), so that it is not alive there, where FP8 CODA's
    step peaks (64 MiB at llama3_1b 4×8192; `scripts/memory_report.py --snapshot`)."""
    events: list[tuple] = []

    class Ordering(ReferenceStages):
        def quantize(self, x, to):
            quantized = super().quantize(x, to)
            events.append(("quantize", tuple(x.shape), to, quantized))
            return quantized

        def gemm_rms_bwd_fp8(self, *args, dx_fp8=None, **kwargs):
            out = super().gemm_rms_bwd_fp8(*args, dx_fp8=dx_fp8, **kwargs)
            if dx_fp8 is not None:
                events.append(("quantize", tuple(out.dx.shape), dx_fp8, out.dx_fp8))
            return out

        def gemm_dswiglu(self, dout, *args, **kwargs):
            events.append(("dswiglu", dout))
            return super().gemm_dswiglu(dout, *args, **kwargs)

    cfg = CONFIGS["gqa2-L3"]
    model = CodaLlama(cfg, ResolvedBlock("coda", "reference", "sdpa", Ordering(), sdpa_attention),
                      fp8=Fp8Recipe())
    tokens, targets = batch(cfg, 2, 16, ignore=False)
    loss = model(tokens, targets)
    events.clear()
    loss.backward()
    dswiglus = [i for i, event in enumerate(events) if event[0] == "dswiglu"] + [len(events)]
    assert len(dswiglus) == cfg.n_layers + 1
    for first, second in zip(dswiglus[:-1], dswiglus[1:], strict=True):
        dout = events[first][1]
        (dx,) = [e for e in events[:first] if e[0] == "quantize" and e[3] is dout]
        assert not dx[2].transposed and dx[2].rows, dx[2]
        # Its other copy: the one quantized with its scale before the next dSwiGLU.
        later = [e for e in events[first:second] if e[0] == "quantize" and e[2].scale is dout.scale]
        assert len(later) == 1 and later[0][2].transposed and not later[0][2].rows, later
        assert torch.equal(later[0][3].data.view(torch.uint8), dout.data.view(torch.uint8))


@pytest.mark.parametrize("tile_cols", [64, 32], ids=["dpreact_x_dx_n", "y"])
def test_transposing_passes_stage_fp8_tiles_without_bank_conflicts(tile_cols):
    """The FP8 tiles the transposing passes stage in shared memory (`quantize._staged`): a
    permutation of the tile's 16-byte units that keeps each phase-1 warp's 8 rows together (it
    writes contiguous bytes), and puts the gather's 32 lanes on 32 distinct banks at every load."""
    from codatrain.kernels.cute import quantize as q

    rows, units, words_per_row = q.TRANSPOSE_TILE[0], tile_cols // q._UNIT, tile_cols // 4
    place = {(r, u): q._staged(r, u, tile_cols) for r in range(rows) for u in range(units)}
    assert sorted(place.values()) == sorted(place)
    for first in range(0, rows, 8):
        block = {place[r, u][0] for r in range(first, first + 8) for u in range(units)}
        assert block == set(range(first, first + 8))
    for warp in range(2 * tile_cols // 32):
        for i in range(q._SEGMENT):
            banks = set()
            for lane in range(32):
                word, segment, unit = q._gather_lane(warp * 32 + lane)
                row, staged_unit = q._staged(segment * q._SEGMENT + i, unit, tile_cols)
                banks.add((row * words_per_row + staged_unit * 4 + word) % 32)
            assert len(banks) == 32, f"warp {warp}, load {i}: {32 - len(banks)} lanes share a bank"
