"""The cute stage backend with FP8 operands (block.precision=fp8), stage by stage, against the
reference stages given the same FP8 operands, on an sm_90 GPU: the forward producers' FP8 outputs
(delayed and current scaling), and every backward stage.

Criteria (as test_cute_fp8.py): outputs in 16 bits within twice the error of the reference stage
in bf16 against the reference stage in fp32 (both on the same FP8 operands, `cute_check.check`);
FP8 outputs, dequantized, within twice FP8's own error against the fp32 values (`check_fp8`); an
FP8 output's amax within bf16's rounding of the fp32 truth's (the cute producers take it from
their 16-bit values).
"""

from __future__ import annotations

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")

from cute_check import (  # noqa: E402
    DEVICE,
    E4M3,
    E5M2,
    FP8_ACCUMULATOR_FLOOR,
    ROPES,
    Shape,
    check,
    check_fp8,
    gamma,
    loosened,
    positions,
    randn,
    rstd_of,
    staged,
)

from codatrain.kernels import fp8  # noqa: E402
from codatrain.kernels.cute import CuteStages  # noqa: E402
from codatrain.kernels.cute.fp8_bwd_stages import (  # noqa: E402
    fp8_dgrad_dswiglu_quantized,
    one_pass_dswiglu,
    one_pass_rms_bwd,
)
from codatrain.kernels.fp8 import Fp8Tensor, QuantizeTo  # noqa: E402
from codatrain.kernels.stages import get_backend  # noqa: E402

pytestmark = pytest.mark.gpu

# FP8 operands are read in both orientations, in 16-byte rows: every size a multiple of 16.
FP8_SHAPES = [
    Shape("llama3_8b", 8192, 4096, 4096, 32, 8, 128, 14336, 128256),
    Shape("ragged16", 1008, 504, 1024, 8, 2, 128, 2816, 50264),
]
SCALINGS = ["delayed", "current"]


@pytest.fixture(params=FP8_SHAPES, ids=lambda s: s.name)
def shape(request) -> Shape:
    return request.param


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference", DEVICE)


@pytest.fixture(scope="module")
def cute():
    return get_backend("cute", DEVICE)


def operand(t: torch.Tensor, dtype: torch.dtype = E4M3) -> Fp8Tensor:
    """t as an FP8 operand standing for bf16 (current scaling, as the model quantizes weights)."""
    return fp8.quantize(t, QuantizeTo(dtype, None))


def as_fp32(t: Fp8Tensor) -> Fp8Tensor:
    """The same FP8 operand standing for fp32: the reference stage then computes the truth."""
    return t._replace(dtype=torch.float32)


def asked(dtype: torch.dtype, truth: torch.Tensor, scaling: str) -> QuantizeTo:
    """What a producer is asked to write: a delayed scale with some headroom over the truth's amax,
    or current scaling."""
    if scaling == "current":
        return QuantizeTo(dtype, None)
    return QuantizeTo(dtype, torch.finfo(dtype).max / (truth.abs().amax().float() * 1.25))


def check_operand(name: str, out: Fp8Tensor, truth: torch.Tensor, to: QuantizeTo) -> None:
    """An FP8 output: its values, its scale (the one asked for, or the current one) and its amax."""
    assert isinstance(out, Fp8Tensor) and out.data.dtype == to.dtype, f"{name}: {type(out).__name__}"
    check_fp8(name, out.data, out.scale, truth)
    amax = truth.abs().amax().float()
    torch.testing.assert_close(out.amax, amax, rtol=2**-7, atol=0)
    if to.scale is not None:
        assert out.scale is to.scale or torch.equal(out.scale, to.scale), f"{name}: scale not the one given"
    else:
        torch.testing.assert_close(out.scale, torch.finfo(to.dtype).max / out.amax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_quantize_stage(cute, shape, scaling, use_compile):
    x = randn(shape.tokens, shape.dim)
    to = asked(E4M3, x.float(), scaling)
    out = staged(lambda x: cute.quantize(x, to), use_compile)(x)
    expected = fp8.quantize(x, to)
    assert torch.equal(out.amax, expected.amax)
    # A current scale is fp8_max / amax; compiled, Triton's fp32 division may round it 1 ulp
    # away from torch's. Given the scale, the values are bit-exact.
    torch.testing.assert_close(out.scale, expected.scale, rtol=2**-23, atol=0)
    expected = fp8.quantize(x, to._replace(scale=out.scale))
    assert torch.equal(out.data.view(torch.uint8), expected.data.view(torch.uint8))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_entry_writes_h_in_fp8(ref, cute, shape, scaling, use_compile):
    tokens = torch.randint(0, 1000, (shape.tokens,), device=DEVICE)
    embedding, g = randn(1000, shape.dim), gamma(shape.dim)
    truth = ref.entry(tokens, embedding.float(), g.float(), eps=1e-5)
    to = asked(E4M3, truth.h, scaling)
    out = staged(lambda *a: cute.entry(*a, eps=1e-5, h_fp8=to), use_compile)(tokens, embedding, g)
    check_operand("h", out.h, truth.h, to)


@pytest.mark.parametrize("scaling", [*SCALINGS, "none"])
@pytest.mark.parametrize("gemm", ["out_proj", "down_proj"])
def test_gemm_residual_rms_stage(ref, cute, shape, gemm, scaling, use_compile):
    k = shape.n_heads * shape.head_dim if gemm == "out_proj" else shape.ffn_dim
    a, w = operand(randn(shape.tokens, k)), operand(randn(shape.dim, k, scale=k**-0.5))
    residual, g = randn(shape.tokens, shape.dim), gamma(shape.dim)
    bf16 = ref.gemm_residual_rms(a, w, residual, g)
    fp32 = ref.gemm_residual_rms(as_fp32(a), as_fp32(w), residual.float(), g.float())
    to = None if scaling == "none" else asked(E4M3, fp32.h, scaling)
    fp8_arg = {} if to is None else {"h_fp8": to}
    out = staged(lambda *args: cute.gemm_residual_rms(*args, **fp8_arg), use_compile)(a, w, residual, g)
    check("x", out.x, bf16.x, fp32.x)
    if to is None:
        check("h", out.h, bf16.h, fp32.h)
    else:
        check_operand("h", out.h, fp32.h, to)
    check("sum(sq_partials)", out.sq_partials.sum(-1), bf16.sq_partials.sum(-1), fp32.sq_partials.sum(-1))


def test_gemm_rstd_swiglu_stage(ref, cute, shape, use_compile):
    h, w = operand(randn(shape.tokens, shape.dim)), operand(randn(2 * shape.ffn_dim, shape.dim))
    rstd = rstd_of(shape.tokens)
    bf16 = ref.gemm_rstd_swiglu(h, w, rstd)
    fp32 = ref.gemm_rstd_swiglu(as_fp32(h), as_fp32(w), rstd)
    to = asked(E4M3, fp32.y, "delayed")
    out = staged(lambda *args: cute.gemm_rstd_swiglu(*args, y_fp8=to), use_compile)(h, w, rstd)
    check("preact", out.preact, bf16.preact, fp32.preact)
    check_operand("y", out.y, fp32.y, to)


def qkv_epilogue_kwargs(shape: Shape, epilogue: str) -> dict:
    """F4's arguments for `epilogue`: RoPE alone, with Qwen2's QKV bias (of the GEMM output's scale,
    so that it matters), with Qwen3's QK-norm (norm weights far from 1), or with both."""
    kwargs = dict(head_dim=shape.head_dim, rope_heads=shape.n_heads + shape.n_kv_heads, rope=ROPES["llama3"])
    if "bias" in epilogue:
        kwargs["bias"] = randn(shape.qkv_dim, scale=shape.dim**0.5)
    if "qknorm" in epilogue:
        kwargs.update(q_heads=shape.n_heads, q_weight=gamma(shape.head_dim), k_weight=gamma(shape.head_dim),
                      eps=1e-6)
    return kwargs


@pytest.mark.parametrize("epilogue", ["rope", "bias", "qknorm", "bias-qknorm"])
def test_gemm_rstd_rope_stage(ref, cute, shape, use_compile, epilogue):
    """F4 on FP8 operands; with the QK-norm, qkv and the pre-norm z of the q and k columns (the cute
    stage writes z as its pairs' two column planes, `QkNormOut`)."""
    h, w = operand(randn(shape.tokens, shape.dim)), operand(randn(shape.qkv_dim, shape.dim))
    rstd, pos = rstd_of(shape.tokens), positions(shape)
    kwargs = qkv_epilogue_kwargs(shape, epilogue)
    stage = "gemm_rstd_qknorm_rope" if "qknorm" in epilogue else "gemm_rstd_rope"
    bf16 = getattr(ref, stage)(h, w, rstd, pos, **kwargs)
    fp32 = getattr(ref, stage)(as_fp32(h), as_fp32(w), rstd, pos, **kwargs)
    out = staged(lambda *args: getattr(cute, stage)(*args, **kwargs), use_compile)(h, w, rstd, pos)
    if "qknorm" not in epilogue:
        check("qkv", out, bf16, fp32)
        return
    check("qkv", out.qkv, bf16.qkv, fp32.qkv)
    rope_cols = kwargs["rope_heads"] * shape.head_dim
    assert out.z.shape == (2, shape.tokens, shape.qkv_dim // 2)
    z = torch.stack((out.z[0], out.z[1]), dim=-1).flatten(1)
    check("z", z[:, :rope_cols], bf16.z, fp32.z)
    assert torch.equal(z[:, rope_cols:], out.qkv[:, rope_cols:])  # v: what the norm and RoPE pass


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_bwd_writes_dz_in_fp8(ref, cute, shape, scaling, use_compile):
    dqkv, qkv = randn(shape.tokens, shape.qkv_dim), randn(shape.tokens, shape.qkv_dim)
    pos = positions(shape)
    kwargs = dict(head_dim=shape.head_dim, rope_heads=shape.n_heads + shape.n_kv_heads, rope=ROPES["llama3"])
    bf16 = ref.rope_bwd(dqkv, qkv, pos, **kwargs)
    fp32 = ref.rope_bwd(dqkv.float(), qkv.float(), pos, **kwargs)
    to = asked(E5M2, fp32.dz, scaling)
    out = staged(lambda *args: cute.rope_bwd(*args, **kwargs, dz_fp8=to), use_compile)(dqkv, qkv, pos)
    check_operand("dz", out.dz, fp32.dz, to)
    check("zdz", out.zdz, bf16.zdz, fp32.zdz)


# What the model asks of the norm backward: with FP8 weight gradients n token-contiguous alone and
# dx in both orientations (gate/up), its rows alone (QKV) or in 16 bits only (layer 0's QKV), with
# delayed scales (the cuBLAS dgrad and the norm backward's quantize pass); "epilogue": row-major
# copies, as a caller with bf16 weight gradients asks (the fused epilogue, then quantize passes).
RMS_BWD_OUTPUTS = ["epilogue", "dx_both", "dx_rows", "dx_none"]


def dgamma_of_rounded_dn(dz: Fp8Tensor, w: Fp8Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dγ as the reference computes it, but from dn = dz·W rounded to x's dtype: the cuBLAS dgrad's
    output, which the one-pass path (and PyTorch's own FP8 recipe) reads."""
    dn = fp8.matmul(as_fp32(dz), as_fp32(w)).to(x.dtype).float()
    return (dn * x.float() * rstd[:, None]).sum(0)


@pytest.mark.parametrize("outputs", RMS_BWD_OUTPUTS)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("consumer", ["gate_up", "qkv"])
def test_gemm_rms_bwd_fp8_stage(ref, cute, shape, consumer, residual, use_compile, outputs):
    n_out = 2 * shape.ffn_dim if consumer == "gate_up" else shape.qkv_dim
    dz = operand(randn(shape.tokens, n_out), E5M2)
    w = operand(randn(n_out, shape.dim, scale=n_out**-0.5))
    x, g, rstd = randn(shape.tokens, shape.dim), gamma(shape.dim), rstd_of(shape.tokens)
    zdz = torch.randn(shape.tokens, device=DEVICE) * 10
    grad = randn(shape.tokens, shape.dim) if residual else None
    bf16 = ref.gemm_rms_bwd(dz, w, x, g, rstd, zdz, grad)
    fp32 = ref.gemm_rms_bwd(as_fp32(dz), as_fp32(w), x.float(), g.float(), rstd, zdz,
                            None if grad is None else grad.float())
    n_to, dx_to = asked(E4M3, fp32.n, "delayed"), asked(E5M2, fp32.dx, "delayed")
    if outputs != "epilogue":
        n_to = n_to._replace(transposed=True, rows=False)
        dx_to = {"dx_both": dx_to._replace(transposed=True), "dx_rows": dx_to, "dx_none": None}[outputs]
    one_pass = one_pass_rms_bwd(n_to, dx_to)
    assert one_pass == (outputs != "epilogue")

    def run(dz, w, x, g, rstd, zdz, grad):
        return cute.gemm_rms_bwd_fp8(dz, w, x, g, rstd, zdz, grad, n_fp8=n_to, dx_fp8=dx_to)

    out = staged(run, use_compile)(dz, w, x, g, rstd, zdz, grad)
    check("dx", out.dx, bf16.dx, fp32.dx)
    if dx_to is not None:
        check_operand("dx_fp8", out.dx_fp8, fp32.dx, dx_to)
        assert (out.dx_fp8.data_t is not None) == dx_to.transposed
        if dx_to.transposed:  # two copies written: the same values
            assert torch.equal(out.dx_fp8.data_t.view(torch.uint8), out.dx_fp8.data.t().view(torch.uint8))
    check_operand("n", out.n, fp32.n, n_to)
    assert (out.n.data_t is not None) == n_to.transposed
    dgamma_bf16 = dgamma_of_rounded_dn(dz, w, x, rstd) if one_pass else bf16.dgamma_partials.sum(0)
    check("dgamma", out.dgamma_partials.sum(0), dgamma_bf16, fp32.dgamma_partials.sum(0),
          floor=FP8_ACCUMULATOR_FLOOR)


# What the model asks of dSwiGLU: with FP8 weight gradients dpreact in both orientations and y
# token-contiguous alone, with delayed scales (the cuBLAS dgrad and the dSwiGLU quantize pass); in
# a run's first step dpreact's scale is current (the fused epilogue, then a quantize pass); the
# row-major copies alone, as a caller with bf16 weight gradients would ask.
DSWIGLU_OUTPUTS = ["both_delayed", "both_current", "rows"]


def dswiglu_asked(outputs: str, fp32) -> tuple[QuantizeTo, QuantizeTo]:
    dpre_to = asked(E5M2, fp32.dpreact, "current" if outputs == "both_current" else "delayed")
    y_to = asked(E4M3, fp32.y, "delayed")
    if outputs == "rows":
        return dpre_to, y_to
    return dpre_to._replace(transposed=True), y_to._replace(transposed=True, rows=False)


def zdz_of_rounded_dy(dout: Fp8Tensor, w: Fp8Tensor, preact: torch.Tensor) -> torch.Tensor:
    """dSwiGLU's ZdZ as the reference computes it, but from dy = dout·W rounded to preact's dtype:
    the cuBLAS dgrad's output, which the one-pass path (and PyTorch's own FP8 recipe) reads."""
    dy = fp8.matmul(as_fp32(dout), as_fp32(w)).to(preact.dtype).float()
    g, u = preact.float()[:, 0::2], preact.float()[:, 1::2]
    sig = torch.sigmoid(g)
    dg, du = dy * u * sig * (1 + g * (1 - sig)), dy * g * sig
    return (g * dg + u * du).sum(-1)


def check_dswiglu_outputs(out, bf16, fp32, dpre_to: QuantizeTo, y_to: QuantizeTo,
                          zdz_bf16: torch.Tensor | None = None) -> None:
    """dpreact and y as asked; zdz within the FP8 accumulator's floor of the truth, or, where dy
    was rounded to 16 bits before dSwiGLU (`zdz_bf16`: what that rounding alone gives), 2× that."""
    check_operand("dpreact", out.dpreact, fp32.dpreact, dpre_to)
    check_operand("y", out.y, fp32.y, y_to)
    for name, written, to in (("dpreact", out.dpreact, dpre_to), ("y", out.y, y_to)):
        assert (written.data_t is not None) == to.transposed, f"{name}: transposed copy {written.data_t}"
        if to.transposed and to.rows:  # two copies written: the same values
            same = torch.equal(written.data_t.view(torch.uint8), written.data.t().view(torch.uint8))
            assert same, f"{name}: the transposed copy differs from the rows"
    check("zdz", out.zdz, bf16.zdz if zdz_bf16 is None else zdz_bf16, fp32.zdz, floor=FP8_ACCUMULATOR_FLOOR)


@pytest.mark.parametrize("outputs", DSWIGLU_OUTPUTS)
def test_gemm_dswiglu_fp8_stage(ref, cute, shape, use_compile, outputs):
    dout = operand(randn(shape.tokens, shape.dim), E5M2)
    w = operand(randn(shape.dim, shape.ffn_dim, scale=shape.ffn_dim**-0.5))
    preact = randn(shape.tokens, 2 * shape.ffn_dim)
    bf16 = ref.gemm_dswiglu(dout, w, preact)
    fp32 = ref.gemm_dswiglu(as_fp32(dout), as_fp32(w), preact.float())
    dpre_to, y_to = dswiglu_asked(outputs, fp32)

    def run(dout, w, preact):
        return cute.gemm_dswiglu(dout, w, preact, dpreact_fp8=dpre_to, y_fp8=y_to)

    one_pass = one_pass_dswiglu(dpre_to, y_to)
    check_dswiglu_outputs(staged(run, use_compile)(dout, w, preact), bf16, fp32, dpre_to, y_to,
                          zdz_of_rounded_dy(dout, w, preact) if one_pass else None)


@pytest.mark.parametrize("chunks", [1, 3])
def test_dswiglu_quantize_pass_over_ragged_tiles_and_chunks(ref, cute, chunks):
    """The cuBLAS dgrad and the dSwiGLU quantize pass where 2F (5664) ends in half a 64-column
    tile and the dgrad's column chunks are uneven (960, 960, 912 with three)."""
    tokens, dim, ffn = 1008, 512, 2832
    dout = operand(randn(tokens, dim), E5M2)
    w = operand(randn(dim, ffn, scale=ffn**-0.5))
    preact = randn(tokens, 2 * ffn)
    bf16 = ref.gemm_dswiglu(dout, w, preact)
    fp32 = ref.gemm_dswiglu(as_fp32(dout), as_fp32(w), preact.float())
    dpre_to, y_to = dswiglu_asked("both_delayed", fp32)
    out = fp8_dgrad_dswiglu_quantized(dout, w, preact, dpre_to, y_to, False, chunks=chunks)
    check_dswiglu_outputs(type(bf16)(*out), bf16, fp32, dpre_to, y_to, zdz_of_rounded_dy(dout, w, preact))


def test_rms_bwd_quantize_pass_over_ragged_tiles(ref, cute):
    """The cuBLAS dgrad and the norm backward's quantize pass where M (1008) ends in part of a
    128-row tile and d (720) in part of a 64-column one."""
    shape = Shape("ragged", tokens=1008, seq_len=1008, dim=720, n_heads=5, n_kv_heads=5, head_dim=144,
                  ffn_dim=1024, vocab=1024)
    test_gemm_rms_bwd_fp8_stage(ref, cute, shape, "gate_up", True, False, "dx_both")


@pytest.mark.parametrize("gemm", ["dgrad", "wgrad"])
def test_plain_fp8_gemms(ref, cute, shape, gemm, use_compile):
    # The out-projection's: dgrad dz·W_o and wgrad dzᵀ·o, dz in e5m2, W_o and o in e4m3.
    width = shape.n_heads * shape.head_dim
    dz = operand(randn(shape.tokens, shape.dim), E5M2)
    other = (operand(randn(shape.dim, width, scale=width**-0.5)) if gemm == "dgrad"
             else operand(randn(shape.tokens, width)))
    bf16 = getattr(ref, gemm)(dz, other)
    fp32 = getattr(ref, gemm)(as_fp32(dz), as_fp32(other))
    out = staged(getattr(cute, gemm), use_compile)(dz, other)
    assert out.dtype == torch.bfloat16
    check(gemm, out, bf16, fp32)


# block.fp8_fast_accum=true: every FP8 stage on fast accumulation (the tensor cores' adder keeps
# about 14 bits). Measured on the H200 at these shapes (docs/benchmarks.md, "FP8 fast
# accumulation"): 16-bit outputs up to 2.5× bf16's error, statistics summed from the accumulator
# (Σx², dγ, Σ g·dg + u·du) 1e-4 to 4e-3 relative. Held to 3× and a floor of 2^-7 here, a bound
# that a wrong result (a missed tile, a wrong scale) still fails by orders of magnitude.
FAST_ACCUM_FACTOR, FAST_ACCUM_FLOOR = 3.0, 2**-7


@pytest.mark.parametrize("stage", ["F1", "F2", "F3", "F4", "Brms_gate_up", "Brms_qkv", "Bdswiglu"])
def test_fp8_fast_accum_everywhere(ref, shape, stage):
    fast, rms_bwd_stage = CuteStages(fp8_fast_accum=True), test_gemm_rms_bwd_fp8_stage
    run = {
        "F1": lambda: test_gemm_residual_rms_stage(ref, fast, shape, "out_proj", "delayed", False),
        "F2": lambda: test_gemm_rstd_swiglu_stage(ref, fast, shape, False),
        "F3": lambda: test_gemm_residual_rms_stage(ref, fast, shape, "down_proj", "current", False),
        "F4": lambda: test_gemm_rstd_rope_stage(ref, fast, shape, False, "rope"),
        "Brms_gate_up": lambda: rms_bwd_stage(ref, fast, shape, "gate_up", True, False, "dx_both"),
        "Brms_qkv": lambda: rms_bwd_stage(ref, fast, shape, "qkv", False, False, "dx_rows"),
        "Bdswiglu": lambda: test_gemm_dswiglu_fp8_stage(ref, fast, shape, False, "both_delayed"),
    }[stage]
    with loosened(FAST_ACCUM_FACTOR, FAST_ACCUM_FLOOR):
        run()
