"""The FP8 forward stages (block.precision=fp8) and the FP8 quantize pass, on an sm_90 GPU.

Criteria. Outputs in 16 bits: the project's (cute_check.py): error against the reference stage run
in fp32 on the dequantized FP8 operands at most twice that of the reference run in bf16. Outputs in
FP8: dequantized, error against the fp32 truth at most twice FP8's own error, the error of
quantizing the truth itself with the same scale (a kernel that rounds each value to the nearest
FP8 value, as `torch.Tensor.to` does, has ratio 1). The quantize pass must equal torch's
saturating cast bit for bit.
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
    ROPES,
    SHAPES,
    Shape,
    check,
    check_fp8,
    dequantize,
    gamma,
    positions,
    randn,
    rstd_of,
    saturate,
    staged,
    to_fp8,
)

from codatrain.kernels.cute import fp8_stages, quantize  # noqa: E402
from codatrain.kernels.cute.gemm_stages import rope_args  # noqa: E402
from codatrain.kernels.fp8 import QuantizeTo  # noqa: E402
from codatrain.kernels.stages import get_backend  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(params=SHAPES, ids=lambda s: s.name)
def shape(request) -> Shape:
    return request.param


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference", DEVICE)


def nan_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output buffer poisoned with NaN, so an element the kernel does not write cannot pass."""
    return torch.full(t.shape, float("nan"), device=t.device).to(dtype or t.dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_fp8(shape, fmt, use_compile):
    x = randn(shape.tokens, shape.ffn_dim)
    x[::97, ::13] *= 40  # outliers past the scale's range saturate
    scale = torch.finfo(fmt).max / (x.float().abs().amax() / 8)

    out, row_amax = (nan_like(t) for t in quantize.quantize_fp8_outputs(x, fmt))

    def run(x, scale, out, row_amax):
        quantize.quantize_fp8(x, scale, out, row_amax)
        return out, row_amax

    out, row_amax = staged(run, use_compile)(x, scale, out, row_amax)
    expected = saturate(x, scale, fmt)
    assert (expected.float().abs() == torch.finfo(fmt).max).any(), "the test saturates nothing"
    mismatch = (out.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
    assert mismatch == 0, f"{mismatch} of {out.numel()} values differ from torch's saturating cast"
    torch.testing.assert_close(row_amax, x.float().abs().amax(1), rtol=0, atol=0)


# (rows, columns): whole tiles; partial tiles with 16-byte stores; sizes that are
# multiples of 8 only (8-byte stores).
TRANSPOSE_SIZES = [(8192, 14336), (1008, 2832), (1000, 2816)]


@pytest.mark.parametrize("rows_out", [True, False], ids=["both", "transposed_only"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("size", TRANSPOSE_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_transpose_fp8(size, fmt, rows_out, use_compile):
    """Both orientations bit-equal to torch's saturating cast (and its transpose), the per-tile
    amaxes exact: the token-contiguous FP8 copies a weight gradient reads, and transposed weights."""
    x = randn(*size)
    x[::97, ::13] *= 40
    scale = torch.finfo(fmt).max / (x.float().abs().amax() / 8)
    rows, cols = x.shape
    # Poisoned, so that a value the kernel does not write is caught (NaN in both formats).
    out = nan_like(x, fmt) if rows_out else None
    out_t = nan_like(x.t(), fmt)
    tile_amax = torch.full(quantize.transpose_tiles(rows, cols), float("nan"), device=DEVICE)

    def run(x, scale, out, out_t, tile_amax):
        quantize.quantize_transpose_fp8(x, scale, out, out_t, tile_amax)
        return out, out_t, tile_amax

    out, out_t, tile_amax = staged(run, use_compile)(x, scale, out, out_t, tile_amax)
    expected = saturate(x, scale, fmt)
    mismatch = (out_t.view(torch.uint8) != expected.t().view(torch.uint8)).sum().item()
    assert mismatch == 0, f"transposed: {mismatch} of {out_t.numel()} values differ from torch's cast"
    if rows_out:
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    tiles_r, tiles_c = tile_amax.shape
    tile_rows, tile_cols = quantize.TRANSPOSE_TILE
    padded = torch.zeros(tiles_r * tile_rows, tiles_c * tile_cols, device=DEVICE)
    padded[:rows, :cols] = x.float().abs()
    expected_amax = padded.view(tiles_r, tile_rows, tiles_c, tile_cols).amax(dim=(1, 3))
    torch.testing.assert_close(tile_amax, expected_amax, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_to_transposed_alone(fmt):
    """`QuantizeTo(rows=False)`: the operand's data is a view of its transposed copy, with the
    values, scale and amax of the pass that writes both orientations."""
    x = randn(1024, 2816)
    to = QuantizeTo(fmt, torch.finfo(fmt).max / (x.float().abs().amax() / 4), transposed=True)
    both, alone = quantize.quantize_to(x, to), quantize.quantize_to(x, to._replace(rows=False))
    assert alone.data.shape == x.shape and alone.data.data_ptr() == alone.data_t.data_ptr()
    assert torch.equal(alone.data_t.view(torch.uint8), both.data_t.view(torch.uint8))
    assert torch.equal(alone.data.view(torch.uint8), both.data.view(torch.uint8))
    assert torch.equal(alone.amax, both.amax) and alone.amax == x.float().abs().amax()


@pytest.mark.parametrize("gemm", ["out_proj", "down_proj"])
def test_fp8_gemm_residual_rms(ref, shape, gemm, use_compile):
    k = shape.n_heads * shape.head_dim if gemm == "out_proj" else shape.ffn_dim
    (a8, sa), (w8, sw) = to_fp8(randn(shape.tokens, k)), to_fp8(randn(shape.dim, k, scale=k**-0.5))
    residual, g = randn(shape.tokens, shape.dim), gamma(shape.dim)
    a, w = dequantize(a8, sa), dequantize(w8, sw)
    bf16 = ref.gemm_residual_rms(a.bfloat16(), w.bfloat16(), residual, g)
    fp32 = ref.gemm_residual_rms(a, w, residual.float(), g.float())
    h_scale = 448 / (fp32.h.abs().amax() * 1.25)  # a delayed scale: some headroom

    # Outputs poisoned outside the compiled call (Triton cannot fill an FP8 tensor).
    outs = [nan_like(t) for t in fp8_stages.fp8_gemm_residual_rms_outputs(a8, w8, residual, E4M3, False)]

    def run(a8, w8, ab_inv_scale, residual, g, h_scale, x, h, sq, amax):
        fp8_stages.fp8_gemm_residual_rms(a8, w8, ab_inv_scale, residual, g, h_scale, x, h, sq, amax, False)
        return x, h, sq, amax

    x, h8, sq, amax = staged(run, use_compile)(a8, w8, 1 / (sa * sw), residual, g, h_scale, *outs)
    check("x", x, bf16.x, fp32.x)
    check_fp8("h", h8, h_scale, fp32.h)
    check("sum(sq_partials)", sq.sum(-1), bf16.sq_partials.sum(-1), fp32.sq_partials.sum(-1))
    # fp32 sums of the same products in another order: agreement to ~1e-5 relative.
    torch.testing.assert_close(amax.amax(), fp32.h.abs().amax(), rtol=1e-4, atol=0)


def test_fp8_gemm_rstd_swiglu(ref, shape, use_compile):
    (h8, sh), (w8, sw) = to_fp8(randn(shape.tokens, shape.dim)), to_fp8(randn(2 * shape.ffn_dim, shape.dim))
    rstd = rstd_of(shape.tokens)
    h, w = dequantize(h8, sh), dequantize(w8, sw)
    bf16 = ref.gemm_rstd_swiglu(h.bfloat16(), w.bfloat16(), rstd)
    fp32 = ref.gemm_rstd_swiglu(h, w, rstd)

    def run(h8, w8, ab_inv_scale, rstd):
        preact = nan_like(fp32.preact, torch.bfloat16)
        y = nan_like(fp32.y, torch.bfloat16)
        fp8_stages.fp8_gemm_rstd_swiglu(h8, w8, ab_inv_scale, rstd, preact, y, False)
        return preact, y

    preact, y = staged(run, use_compile)(h8, w8, 1 / (sh * sw), rstd)
    check("preact", preact, bf16.preact, fp32.preact)
    check("y", y, bf16.y, fp32.y)


@pytest.mark.parametrize("rope", list(ROPES))
def test_fp8_gemm_rstd_rope(ref, shape, rope, use_compile):
    (h8, sh), (w8, sw) = to_fp8(randn(shape.tokens, shape.dim)), to_fp8(randn(shape.qkv_dim, shape.dim))
    rstd, pos = rstd_of(shape.tokens), positions(shape)
    h, w = dequantize(h8, sh), dequantize(w8, sw)
    kwargs = dict(head_dim=shape.head_dim, rope_heads=shape.n_heads + shape.n_kv_heads, rope=ROPES[rope])
    bf16 = ref.gemm_rstd_rope(h.bfloat16(), w.bfloat16(), rstd, pos, **kwargs)
    fp32 = ref.gemm_rstd_rope(h, w, rstd, pos, **kwargs)
    args = (kwargs["head_dim"], kwargs["rope_heads"], *rope_args(ROPES[rope]))

    def run(h8, w8, ab_inv_scale, rstd, pos):
        qkv = nan_like(fp32, torch.bfloat16)
        fp8_stages.fp8_gemm_rstd_rope(h8, w8, ab_inv_scale, rstd, pos, None, qkv, *args, False)
        return qkv

    check("qkv", staged(run, use_compile)(h8, w8, 1 / (sh * sw), rstd, pos), bf16, fp32)
