"""dγ of every RMSNorm over several row tiles of the cute kernels, on an sm_90 GPU: 300 rows (two
full 128-row tiles and a ragged one), each norm fed by the stage that produces its gradient, with
the criterion of cute_check.py (error vs fp32 ≤ 2 × the bf16 reference's; outputs poisoned)."""

from __future__ import annotations

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")
pytest.importorskip("flash_attn.cute")

from cute_check import DEVICE, SHAPES, check, gamma, head_dweight, poison, randn, rstd_of, run_both  # noqa: E402

from codatrain.kernels.cute import backend as cute_backend  # noqa: E402
from codatrain.kernels.stages import IGNORE_INDEX, Rope, get_backend  # noqa: E402

pytestmark = pytest.mark.gpu

M = 300  # rows: more than one row tile of any kernel configuration, the last one partial
SHAPE = SHAPES[1]  # widths of the ragged shape


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison(monkeypatch, cute_backend)


@pytest.fixture(scope="module")
def backends():
    return get_backend("cute", DEVICE), get_backend("reference", DEVICE)


def check_norm_backward(cute, ref, dz, weight, zdz, residual: bool) -> None:
    d = SHAPE.dim
    args = (dz, weight, randn(M, d), gamma(d), rstd_of(M), zdz, randn(M, d) if residual else None)
    out = cute.gemm_rms_bwd(*args)
    bf16, fp32 = run_both(ref, "gemm_rms_bwd", *args)
    check("dx", out.dx, bf16.dx, fp32.dx)
    check("dgamma", out.dgamma_partials.sum(0), bf16.dgamma_partials.sum(0), fp32.dgamma_partials.sum(0))


def test_attention_norm_dgamma_over_row_tiles(backends):
    cute, ref = backends
    n = SHAPE.qkv_dim
    rope = {"head_dim": SHAPE.head_dim, "rope_heads": SHAPE.n_heads + SHAPE.n_kv_heads, "rope": Rope(5e5)}
    dz, zdz = cute.rope_bwd(randn(M, n), randn(M, n), torch.arange(M, device=DEVICE) % 128, **rope)
    check_norm_backward(cute, ref, dz, randn(n, SHAPE.dim, scale=n**-0.5), zdz, residual=True)


def test_mlp_norm_dgamma_over_row_tiles(backends):
    cute, ref = backends
    d, f = SHAPE.dim, SHAPE.ffn_dim
    dout = randn(M, d)
    dpreact, _, zdz = cute.gemm_dswiglu(dout, randn(d, f, scale=d**-0.5), randn(M, 2 * f, scale=2.0))
    check_norm_backward(cute, ref, dpreact, randn(2 * f, d, scale=(2 * f) ** -0.5), zdz, residual=True)


@pytest.mark.parametrize("chunk_rows", [128, 256], ids=["chunks-128x3", "chunks-256+44"])
def test_final_norm_dgamma_over_row_chunks_of_the_head(backends, chunk_rows):
    """The training head's dγ and dW summed over all its chunks (both QuACK pipelines: the ragged
    vocabulary takes the base one, a multiple of 128 the scaled-exp one)."""
    cute, ref = backends
    d = SHAPE.dim
    for v in (SHAPE.vocab, 128 * 393):
        targets = torch.randint(0, v, (M,), device=DEVICE)
        targets[::7] = IGNORE_INDEX
        args = (randn(M, d), gamma(d), randn(v, d, scale=3 * d**-0.5), targets)
        out = cute.lm_head_ce(*args, eps=1e-5, chunk_rows=chunk_rows)
        bf16, fp32 = run_both(ref, "lm_head_ce", *args, eps=1e-5, chunk_rows=chunk_rows)
        for name in ("dx", "dgamma"):
            check(f"V={v} {name}", getattr(out, name), getattr(bf16, name), getattr(fp32, name))
        check(f"V={v} dweight", head_dweight(cute, out, torch.float32),
              head_dweight(ref, bf16, torch.float32), head_dweight(ref, fp32, torch.float32))
