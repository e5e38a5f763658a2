"""The cute backward stages against the reference, on an sm_90 GPU, with the criterion and shapes
of cute_check.py (error vs fp32 ≤ 2 × the bf16 reference's; outputs poisoned with NaN)."""

from __future__ import annotations

import math

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")
pytest.importorskip("flash_attn.cute")

from cute_check import (  # noqa: E402
    DEVICE,
    ROPES,
    SHAPES,
    Shape,
    check,
    gamma,
    head_dweight,
    poison,
    positions,
    randn,
    rstd_of,
    run_both,
    staged,
)

from codatrain.kernels.cute import backend as cute_backend  # noqa: E402
from codatrain.kernels.stages import IGNORE_INDEX, get_backend  # noqa: E402

pytestmark = pytest.mark.gpu

# Rows of a chunk that is not a multiple of any tile, so that chunks after the first start off
# 16-byte alignment.
HEAD_CHUNK_ROWS = 1046


@pytest.fixture(params=SHAPES, ids=lambda s: s.name)
def shape(request) -> Shape:
    return request.param


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison(monkeypatch, cute_backend)


@pytest.fixture(scope="module")
def backends():
    return get_backend("cute", DEVICE), get_backend("reference", DEVICE)


def rope_kwargs(shape: Shape, rope: str = "default") -> dict:
    rope_heads = shape.n_heads + shape.n_kv_heads
    return {"head_dim": shape.head_dim, "rope_heads": rope_heads, "rope": ROPES[rope]}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_bwd(backends, shape, use_compile, rope):
    cute, ref = backends
    args = (randn(shape.tokens, shape.qkv_dim), randn(shape.tokens, shape.qkv_dim), positions(shape))
    out = staged(cute.rope_bwd, use_compile)(*args, **rope_kwargs(shape, rope))
    bf16, fp32 = run_both(ref, "rope_bwd", *args, **rope_kwargs(shape, rope))
    check("dz", out.dz, bf16.dz, fp32.dz)
    check("zdz", out.zdz, bf16.zdz, fp32.zdz)
    # The v columns are not rotated: they pass through bitwise.
    v_cols = slice((shape.n_heads + shape.n_kv_heads) * shape.head_dim, None)
    assert torch.equal(out.dz[:, v_cols], args[0][:, v_cols])


def test_rope_bwd_with_bias(backends, shape, use_compile):
    """Qwen2's QKV bias: zdz excludes it (Σ (z − b)·dz), and its gradient is Σ_m dz."""
    cute, ref = backends
    args = (randn(shape.tokens, shape.qkv_dim), randn(shape.tokens, shape.qkv_dim), positions(shape))
    bias = randn(shape.qkv_dim)
    out = staged(cute.rope_bwd, use_compile)(*args, **rope_kwargs(shape, "llama3"), bias=bias)
    bf16 = ref.rope_bwd(*args, **rope_kwargs(shape, "llama3"), bias=bias)
    fp32 = ref.rope_bwd(args[0].float(), args[1].float(), args[2], **rope_kwargs(shape, "llama3"),
                        bias=bias.float())
    check("dz", out.dz, bf16.dz, fp32.dz)
    check("zdz", out.zdz, bf16.zdz, fp32.zdz)
    check("bias_grad", staged(cute.bias_grad, use_compile)(out.dz), ref.bias_grad(bf16.dz),
          ref.bias_grad(fp32.dz))


@pytest.mark.parametrize("head_dim", [80, 104])
def test_rope_bwd_at_head_dims(backends, head_dim, use_compile):
    shape = Shape(f"hd{head_dim}", 600, 300, 5 * head_dim, 5, 1, head_dim, 1024, 1000)
    test_rope_bwd(backends, shape, use_compile, "llama3")


def test_rope_bwd_inverts_rope_fwd(backends, shape, use_compile):
    """rope_bwd of the forward's RoPE output rotates it back to the unrotated GEMM output."""
    cute, _ = backends
    h, w, r = randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=shape.dim**-0.5), \
        rstd_of(shape.tokens)
    qkv = staged(cute.gemm_rstd_rope, use_compile)(h, w, r, positions(shape), **rope_kwargs(shape))
    z = (h.float() @ w.float().t()) * r[:, None]
    back = staged(cute.rope_bwd, use_compile)(qkv, qkv, positions(shape), **rope_kwargs(shape)).dz
    assert ((back.float() - z).norm() / z.norm()).item() < 1e-2


def test_row_dot(backends, shape, use_compile):
    cute, ref = backends
    args = (randn(shape.tokens, shape.qkv_dim), randn(shape.tokens, shape.qkv_dim))
    bf16, fp32 = run_both(ref, "row_dot", *args)
    check("zdz", staged(cute.row_dot, use_compile)(*args), bf16, fp32)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "last"])
def test_gemm_rms_bwd(backends, shape, residual, use_compile):
    """The QKV consumer (N = N_qkv) with the residual gradient, and without one (the final norm)."""
    cute, ref = backends
    m, d, n = shape.tokens, shape.dim, shape.qkv_dim
    args = (randn(m, n), randn(n, d, scale=n**-0.5), randn(m, d), gamma(d), rstd_of(m),
            torch.randn(m, device=DEVICE) * d**0.5, randn(m, d) if residual else None)
    out = staged(cute.gemm_rms_bwd, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_rms_bwd", *args)
    check("dx", out.dx, bf16.dx, fp32.dx)
    check("n", out.n, bf16.n, fp32.n)
    check("dgamma", out.dgamma_partials.sum(0), bf16.dgamma_partials.sum(0), fp32.dgamma_partials.sum(0))


def test_gemm_rms_bwd_on_unaligned_row_slices(backends, use_compile):
    """Row slices of rstd and zdz that start off 16-byte alignment (a caller working in row
    chunks passes such slices)."""
    cute, ref = backends
    s = SHAPES[1]
    m, d, n = 2 * HEAD_CHUNK_ROWS, s.dim, 1024
    dz, w, x, g = randn(m, n), randn(n, d, scale=n**-0.5), randn(m, d), gamma(d)
    rstd, zdz = rstd_of(m), torch.randn(m, device=DEVICE) * d**0.5
    rows = slice(HEAD_CHUNK_ROWS, None)
    assert rstd[rows].data_ptr() % 16
    out = staged(cute.gemm_rms_bwd, use_compile)(dz[rows], w, x[rows], g, rstd[rows], zdz[rows])
    bf16, fp32 = run_both(ref, "gemm_rms_bwd", dz[rows], w, x[rows], g, rstd[rows], zdz[rows])
    check("dx", out.dx, bf16.dx, fp32.dx)


def test_gemm_dswiglu(backends, shape, use_compile):
    cute, ref = backends
    m, d, f = shape.tokens, shape.dim, shape.ffn_dim
    args = (randn(m, d), randn(d, f, scale=d**-0.5), randn(m, 2 * f, scale=2.0))
    out = staged(cute.gemm_dswiglu, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_dswiglu", *args)
    check("dpreact", out.dpreact, bf16.dpreact, fp32.dpreact)
    check("y", out.y, bf16.y, fp32.y)
    check("zdz", out.zdz, bf16.zdz, fp32.zdz)


# (name, rows, d, V, chunk rows, takes the scaled-exp pipeline)
HEAD_CASES = [
    ("8b-chunk=d", 8192, 4096, 128256, 4096, False),  # a chunk as high as d: the base pipeline
    ("8b-chunks-2048", 8192, 4096, 128256, 2048, True),
    ("ragged-vocab", 1000, 1024, 50264, 4096, False),  # V not a multiple of 128: base
    ("ragged-rows", 1000, 1024, 128256, 256, True),  # the last chunk padded to 256 rows
    ("odd-rows", 1001, 1024, 50264, 512, False),  # rows padded to a multiple of 8
    # Vocabularies that are not multiples of 8: logits rows padded internally (GPT-2's, in four
    # chunks; Llama 2's plus three added tokens, in one).
    ("gpt2-vocab", 1000, 512, 50257, 256, False),
    ("vocab32003", 600, 512, 32003, 1024, False),
]


def check_lm_head_ce(backends, m: int, d: int, v: int, chunk_rows: int, logit_scale: float,
                     use_compile: bool) -> torch.Tensor:
    """The training head (final norm, LM head, cross-entropy, all gradients) on logits of about
    `logit_scale` against the reference; ignored rows get no loss and no gradient. Returns the loss."""
    cute, ref = backends
    targets = torch.randint(0, v, (m,), device=DEVICE)
    ignored = torch.rand(m, device=DEVICE) < 0.1
    targets[ignored] = IGNORE_INDEX
    args = (randn(m, d), gamma(d), randn(v, d, scale=logit_scale * d**-0.5), targets)
    kwargs = {"eps": 1e-5, "chunk_rows": chunk_rows}
    out = staged(cute.lm_head_ce, use_compile)(*args, **kwargs)
    bf16, fp32 = run_both(ref, "lm_head_ce", *args, **kwargs)
    for name in ("loss", "dx", "dgamma"):
        check(name, getattr(out, name), getattr(bf16, name), getattr(fp32, name))
    # The weight gradient as the backward finishes it: scaled, in the weight's dtype.
    check("dweight", head_dweight(cute, out, torch.bfloat16, use_compile),
          head_dweight(ref, bf16, torch.bfloat16), head_dweight(ref, fp32, torch.float32))
    assert (out.loss[ignored] == 0).all() and (out.dx[ignored] == 0).all()
    return out.loss


@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: c[0])
def test_lm_head_ce(backends, case, use_compile):
    from codatrain.kernels.cute import head

    _, m, d, v, chunk_rows, scaled_exp = case
    assert head.scaled_exp_applies(m, d, v, chunk_rows) == scaled_exp
    # Logits of a few units, as a trained LM head produces.
    check_lm_head_ce(backends, m, d, v, chunk_rows, 3.0, use_compile)


# A scaled-exp shape (V and chunks in 128-row tiles) at logits of magnitude 1e1 to 1e4, per-row
# losses from tens to tens of thousands of nats.
@pytest.mark.parametrize("logit_scale", [10.0, 1e2, 1e3, 1e4])
def test_lm_head_ce_at_large_logits(backends, logit_scale, use_compile):
    from codatrain.kernels.cute import head

    m, d, v, chunk_rows = 1536, 1024, 32000, 512
    assert head.scaled_exp_applies(m, d, v, chunk_rows)
    loss = check_lm_head_ce(backends, m, d, v, chunk_rows, logit_scale, use_compile)
    assert loss.max() > head.SCALED_EXP_MAX_LOSS or logit_scale == 10.0


def test_scaled_exp_is_exact_up_to_its_loss_bound(backends, monkeypatch):
    """SCALED_EXP_MAX_LOSS is safe: the scaled-exp pipeline, kept even past the bound, meets the
    criterion on a micro-batch whose largest per-row loss lies just below it."""
    from codatrain.kernels.cute import head

    kept = []
    monkeypatch.setattr(head, "scaled_exp_is_exact", lambda loss: kept.append(loss.max().item()) or True)
    check_lm_head_ce(backends, 1536, 1024, 32000, 512, 7.0, use_compile=False)
    assert kept and 0.75 * head.SCALED_EXP_MAX_LOSS < max(kept) <= head.SCALED_EXP_MAX_LOSS, kept


def test_dgrad(backends, shape, use_compile):
    cute, ref = backends
    k = shape.n_heads * shape.head_dim
    args = (randn(shape.tokens, shape.dim), randn(shape.dim, k, scale=shape.dim**-0.5))
    bf16, fp32 = run_both(ref, "dgrad", *args)
    check("dgrad", staged(cute.dgrad, use_compile)(*args), bf16, fp32)


def test_wgrad(backends, shape, use_compile):
    """dW_down = doutᵀ·y: contracts over the M tokens (ragged M is a ragged K here)."""
    cute, ref = backends
    args = (randn(shape.tokens, shape.dim), randn(shape.tokens, shape.ffn_dim))
    bf16, fp32 = run_both(ref, "wgrad", *args)
    check("wgrad", staged(cute.wgrad, use_compile)(*args), bf16, fp32)


def test_wgrad_accumulates_in_fp32(backends, shape, use_compile):
    """Two chunks of rows summed into an fp32 gradient, as the LM-head backward does."""
    cute, ref = backends
    m = min(shape.tokens, 2 * HEAD_CHUNK_ROWS)
    dz, a = randn(m, shape.dim), randn(m, shape.dim)
    start = torch.randn(shape.dim, shape.dim, device=DEVICE)
    outs = []
    for backend, cast in ((cute, torch.bfloat16), (ref, torch.bfloat16), (ref, torch.float32)):
        acc = start.clone()
        wgrad = staged(backend.wgrad, use_compile) if backend is cute else backend.wgrad
        for rows in (slice(0, m // 2), slice(m // 2, m)):
            result = wgrad(dz[rows].to(cast), a[rows].to(cast), accumulate_into=acc)
            assert result is acc
        outs.append(acc)
    check("wgrad+=", *outs)


def test_entry_bwd(backends, shape, use_compile):
    """Token ids drawn from a small range, so many rows add into the same embedding row."""
    cute, ref = backends
    tokens = torch.randint(0, 1000, (shape.tokens,), device=DEVICE)
    dx = randn(shape.tokens, shape.dim)
    cute_out = staged(cute.entry_bwd, use_compile)(dx, tokens, num_embeddings=shape.vocab)
    bf16, fp32 = run_both(ref, "entry_bwd", dx, tokens, num_embeddings=shape.vocab)
    check("dembedding", cute_out, bf16, fp32)
    assert (cute_out[1000:] == 0).all()


def test_backward_stages_trace_without_graph_breaks(backends):
    """The backward stages as custom ops under torch.compile(fullgraph=True): same results."""
    cute, _ = backends
    s = SHAPES[1]
    m, d = s.tokens, s.dim
    qkv, dqkv, w_qkv = randn(m, s.qkv_dim), randn(m, s.qkv_dim), randn(s.qkv_dim, d, scale=d**-0.5)
    x, g, r = randn(m, d), gamma(d), rstd_of(m)
    pos = positions(s)

    def attention_norm_bwd(dqkv, qkv, x, dx_residual):
        dz, zdz = cute.rope_bwd(dqkv, qkv, pos, **rope_kwargs(s))
        dx, n, dgamma = cute.gemm_rms_bwd(dz, w_qkv, x, g, r, zdz, dx_residual)
        dw = torch.zeros(s.qkv_dim, d, device=DEVICE)
        cute.wgrad(dz, n, accumulate_into=dw)
        return dx, dgamma, dw, cute.dgrad(dx, w_qkv.t().contiguous())

    inputs = (dqkv, qkv, x, randn(m, d))
    eager = attention_norm_bwd(*inputs)
    compiled = torch.compile(attention_norm_bwd, fullgraph=True)(*inputs)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not math.isnan(eager[0].float().sum().item())
