"""Qwen3's QK-norm on the cute stages against the reference, on an sm_90 GPU, with the criterion of
cute_check.py (error vs fp32 ≤ 2 × the bf16 reference's; outputs poisoned with NaN): F4's QK-norm
+ RoPE epilogue (`gemm_rstd_qknorm_rope`) and its backward (`qknorm_rope_bwd`), with and without a
QKV bias, at Qwen3-0.6B's attention widths and at a small ragged shape of head dim 64."""

from __future__ import annotations

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")

from cute_check import DEVICE, Shape, check, gamma, poison, positions, randn, rstd_of, staged  # noqa: E402

from codatrain.kernels.cute import backend as cute_backend  # noqa: E402
from codatrain.kernels.cute import gemm_stages  # noqa: E402
from codatrain.kernels.cute.rowwise import QKNORM_ROWS  # noqa: E402
from codatrain.kernels.stages import Rope, get_backend  # noqa: E402

pytestmark = pytest.mark.gpu

# Qwen3-0.6B's attention (d 1024, 16 q heads, 8 kv heads, head dim 128) at M = 8192, and a small
# model of head dim 64 whose M is a multiple neither of a GEMM tile nor of the backward's rows per CTA.
SHAPES = [
    Shape("qwen3_0_6b", 8192, 4096, 1024, 16, 8, 128, 3072, 151936),
    Shape("small-hd64", 1000, 500, 256, 4, 2, 64, 704, 1000),
]
QWEN3_ROPE = Rope(1000000.0)
EPS = 1e-6
assert SHAPES[1].tokens % QKNORM_ROWS


@pytest.fixture(params=SHAPES, ids=lambda s: s.name)
def shape(request) -> Shape:
    return request.param


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison(monkeypatch, cute_backend, gemm_stages)


@pytest.fixture(scope="module")
def backends():
    return get_backend("cute", DEVICE), get_backend("reference", DEVICE)


def qknorm_kwargs(shape: Shape, bias: torch.Tensor | None) -> dict:
    """The QK-norm arguments: norm weights far from 1 (q and k different), Qwen3's θ and ε."""
    kwargs = {"head_dim": shape.head_dim, "q_heads": shape.n_heads,
              "rope_heads": shape.n_heads + shape.n_kv_heads, "rope": QWEN3_ROPE,
              "q_weight": gamma(shape.head_dim), "k_weight": gamma(shape.head_dim), "eps": EPS}
    return kwargs if bias is None else {**kwargs, "bias": bias}


def z_columns(z_pairs: torch.Tensor) -> torch.Tensor:
    """The cute forward's z (its even and odd column planes, `QkNormOut`) in column order, (M, N)."""
    return torch.stack((z_pairs[0], z_pairs[1]), dim=-1).flatten(1)


def z_pairs_of(z: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """The cute backward's z from the reference's: the q and k columns `z`, the v columns qkv's
    (the norm passes them), as the two column planes the cute forward writes."""
    full = torch.cat((z, qkv[:, z.shape[1]:]), dim=1)
    return full.view(full.shape[0], -1, 2).permute(2, 0, 1).contiguous()


def reference_both(ref, method: str, args: tuple, kwargs: dict) -> tuple:
    """The reference stage on the bf16 inputs and on their fp32 upcasts (the norm weights and the
    bias too)."""
    def up(value):
        return value.float() if torch.is_tensor(value) and value.is_floating_point() else value

    stage = getattr(ref, method)
    return stage(*args, **kwargs), stage(*map(up, args), **{k: up(v) for k, v in kwargs.items()})


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_rstd_qknorm_rope(backends, shape, use_compile, with_bias):
    """qkv (the q and k heads normed, weighted and rotated, the v heads only biased) and the
    pre-norm z of every column, as the two column planes the backward reads."""
    cute, ref = backends
    args = (randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=shape.dim**-0.5),
            rstd_of(shape.tokens), positions(shape))
    kwargs = qknorm_kwargs(shape, randn(shape.qkv_dim) if with_bias else None)
    out = staged(cute.gemm_rstd_qknorm_rope, use_compile)(*args, **kwargs)
    bf16, fp32 = reference_both(ref, "gemm_rstd_qknorm_rope", args, kwargs)
    check("qkv", out.qkv, bf16.qkv, fp32.qkv)
    rope_cols = (shape.n_heads + shape.n_kv_heads) * shape.head_dim
    assert out.z.shape == (2, shape.tokens, shape.qkv_dim // 2) and out.z.is_contiguous()
    z = z_columns(out.z)
    check("z", z[:, :rope_cols], bf16.z, fp32.z)
    # The v columns' z is what the norm and RoPE (angle 0) pass to qkv, bitwise.
    assert torch.equal(z[:, rope_cols:], out.qkv[:, rope_cols:])


def test_gemm_rstd_qknorm_rope_at_a_tiny_scale(backends, use_compile):
    """Heads of values near 1e-3 (rstd near 1e3): the norm brings them to unit scale, ε = 1e-6 still
    counts, and the v heads stay tiny."""
    cute, ref = backends
    shape = SHAPES[1]
    args = (randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=1e-3 * shape.dim**-0.5),
            rstd_of(shape.tokens), positions(shape))
    kwargs = qknorm_kwargs(shape, None)
    out = staged(cute.gemm_rstd_qknorm_rope, use_compile)(*args, **kwargs)
    bf16, fp32 = reference_both(ref, "gemm_rstd_qknorm_rope", args, kwargs)
    check("qkv", out.qkv, bf16.qkv, fp32.qkv)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_qknorm_rope_bwd(backends, shape, use_compile, with_bias):
    """dz (the QK-norm's backward on the q and k heads, dqkv itself on the v heads), zdz over all
    columns less the bias, and the q and k norm weights' gradients."""
    cute, ref = backends
    rope_cols = (shape.n_heads + shape.n_kv_heads) * shape.head_dim
    args = (randn(shape.tokens, shape.qkv_dim), randn(shape.tokens, shape.qkv_dim),
            randn(shape.tokens, rope_cols), positions(shape))
    kwargs = qknorm_kwargs(shape, randn(shape.qkv_dim) if with_bias else None)
    dqkv, qkv, z, pos = args
    out = staged(cute.qknorm_rope_bwd, use_compile)(dqkv, qkv, z_pairs_of(z, qkv), pos, **kwargs)
    bf16, fp32 = reference_both(ref, "qknorm_rope_bwd", args, kwargs)
    for field in ("dz", "zdz", "dq_weight", "dk_weight"):
        check(field, getattr(out, field), getattr(bf16, field), getattr(fp32, field))
    # The v columns pass through the norm and RoPE: their gradient is dqkv's, bitwise.
    assert torch.equal(out.dz[:, rope_cols:], args[0][:, rope_cols:])


def test_qknorm_rope_bwd_of_the_forward(backends, shape, use_compile):
    """The backward on the forward's own outputs (its z, as the model hands it over)."""
    cute, ref = backends
    h, w, r = randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=shape.dim**-0.5), \
        rstd_of(shape.tokens)
    kwargs = qknorm_kwargs(shape, None)
    fwd = staged(cute.gemm_rstd_qknorm_rope, use_compile)(h, w, r, positions(shape), **kwargs)
    dqkv = randn(shape.tokens, shape.qkv_dim)
    out = staged(cute.qknorm_rope_bwd, use_compile)(dqkv, fwd.qkv, fwd.z, positions(shape), **kwargs)
    rope_cols = (shape.n_heads + shape.n_kv_heads) * shape.head_dim
    args = (dqkv, fwd.qkv, z_columns(fwd.z)[:, :rope_cols].contiguous(), positions(shape))
    bf16, fp32 = reference_both(ref, "qknorm_rope_bwd", args, kwargs)
    for field in ("dz", "zdz", "dq_weight", "dk_weight"):
        check(field, getattr(out, field), getattr(bf16, field), getattr(fp32, field))


@pytest.mark.parametrize("head_dim", [32])
def test_qknorm_at_small_head_dims(backends, head_dim, use_compile):
    """Head dims below 64 (resolve.QKNORM_HEAD_DIMS): several heads share a GEMM tile's per-head
    statistic and a warp of the backward."""
    shape = Shape(f"hd{head_dim}", 600, 300, 256, 8, 2, head_dim, 704, 1000)
    test_gemm_rstd_qknorm_rope(backends, shape, use_compile, False)
    test_qknorm_rope_bwd(backends, shape, use_compile, True)
