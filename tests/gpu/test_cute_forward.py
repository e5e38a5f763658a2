"""The cute forward stages and FA4 attention against the reference, on an sm_90 GPU, with the
criterion and shapes of cute_check.py."""

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
    EPS,
    ROPES,
    SHAPES,
    Shape,
    check,
    gamma,
    poison,
    positions,
    randn,
    rstd_of,
    run_both,
    staged,
)

from codatrain.kernels.attention import get_attention, sdpa_attention  # noqa: E402
from codatrain.kernels.cute import backend as cute_backend  # noqa: E402
from codatrain.kernels.cute import gemm_stages  # noqa: E402
from codatrain.kernels.cute.attention import fa4_attention  # noqa: E402
from codatrain.kernels.resolve import FA4_HEAD_DIMS, ResolvedBlock, resolve_block  # noqa: E402
from codatrain.kernels.stages import IGNORE_INDEX, Rope, get_backend  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(params=SHAPES, ids=lambda s: s.name)
def shape(request) -> Shape:
    return request.param


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Fill every output buffer the cute stages allocate with NaN before the kernel runs: the
    outputs (backend.py) and the LM head's LSE partials (gemm_stages.py)."""
    poison(monkeypatch, cute_backend, gemm_stages)


@pytest.fixture(scope="module")
def backends():
    return get_backend("cute", DEVICE), get_backend("reference", DEVICE)


def test_cute_is_selected_on_sm90():
    assert resolve_block("coda", "auto", "auto", DEVICE) == ResolvedBlock("coda", "cute", "fa4")
    assert get_attention("fa4", DEVICE) is fa4_attention
    h, w = torch.randn(256, 64, device=DEVICE), torch.randn(128, 64, device=DEVICE)
    with pytest.raises(TypeError, match="16-bit"):
        get_backend("cute", DEVICE).gemm_rstd(h, w, torch.ones(256, device=DEVICE))


# ---- stages ------------------------------------------------------------------------------------


def test_entry(backends, shape, use_compile):
    cute, ref = backends
    tokens = torch.randint(0, shape.vocab, (shape.tokens,), device=DEVICE)
    embedding = torch.randn(shape.vocab, shape.dim, device=DEVICE, dtype=torch.bfloat16)
    g = gamma(shape.dim)
    out = staged(cute.entry, use_compile)(tokens, embedding, g, eps=EPS)
    bf16 = ref.entry(tokens, embedding, g, eps=EPS)
    fp32 = ref.entry(tokens, embedding.float(), g.float(), eps=EPS)
    for field in ("x", "h", "rstd"):
        check(f"entry.{field}", getattr(out, field), getattr(bf16, field), getattr(fp32, field))


def test_entry_from_unaligned_views(backends, use_compile):
    """Parameters that are views into a flat buffer need not start on a 16-byte boundary."""
    cute, ref = backends
    s = SHAPES[1]
    flat = torch.randn(s.vocab * s.dim + s.dim + 1, device=DEVICE).to(torch.bfloat16)
    embedding, g = flat[1 : 1 + s.vocab * s.dim].view(s.vocab, s.dim), flat[-s.dim :]
    assert embedding.data_ptr() % 16 and g.data_ptr() % 16
    tokens = torch.randint(0, s.vocab, (s.tokens,), device=DEVICE)
    out = staged(cute.entry, use_compile)(tokens, embedding, g, eps=EPS)
    expected = ref.entry(tokens, embedding, g, eps=EPS)
    torch.testing.assert_close(out.x, expected.x, rtol=0, atol=0)
    torch.testing.assert_close(out.h, expected.h)
    torch.testing.assert_close(out.rstd, expected.rstd)


def test_gemm_residual_rms(backends, shape, use_compile):
    cute, ref = backends
    k = shape.n_heads * shape.head_dim
    args = (randn(shape.tokens, k), randn(shape.dim, k, scale=k**-0.5), randn(shape.tokens, shape.dim),
            gamma(shape.dim))
    out = staged(cute.gemm_residual_rms, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_residual_rms", *args)
    check("x", out.x, bf16.x, fp32.x)
    check("h", out.h, bf16.h, fp32.h)
    # Backends may tile the columns differently; the contract is the row sum.
    check("sum(sq_partials)", out.sq_partials.sum(-1), bf16.sq_partials.sum(-1), fp32.sq_partials.sum(-1))


def test_rstd_from_partials(backends, shape, use_compile):
    cute, ref = backends
    partials = torch.rand(shape.tokens, math.ceil(shape.dim / 192), device=DEVICE) * 100
    # rms_final_reduce allocates rstd itself: leave a NaN block of that size in the allocator's
    # cache, which the next allocation of the same size takes.
    del_me = torch.full((shape.tokens,), math.nan, device=DEVICE)
    del del_me
    out = staged(cute.rstd_from_partials, use_compile)(partials, dim=shape.dim, eps=EPS)
    fp32 = ref.rstd_from_partials(partials, dim=shape.dim, eps=EPS)
    check("rstd", out, fp32, ref.rstd_from_partials(partials.double(), dim=shape.dim, eps=EPS))


def test_gemm_rstd_swiglu(backends, shape, use_compile):
    cute, ref = backends
    args = (randn(shape.tokens, shape.dim), randn(2 * shape.ffn_dim, shape.dim, scale=shape.dim**-0.5),
            rstd_of(shape.tokens))
    out = staged(cute.gemm_rstd_swiglu, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_rstd_swiglu", *args)
    check("preact", out.preact, bf16.preact, fp32.preact)
    check("y", out.y, bf16.y, fp32.y)


@pytest.mark.parametrize("rope", list(ROPES))
def test_gemm_rstd_rope(backends, shape, use_compile, rope):
    cute, ref = backends
    args = (randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=shape.dim**-0.5),
            rstd_of(shape.tokens), positions(shape))
    kwargs = dict(head_dim=shape.head_dim, rope_heads=shape.n_heads + shape.n_kv_heads, rope=ROPES[rope])
    out = staged(cute.gemm_rstd_rope, use_compile)(*args, **kwargs)
    bf16, fp32 = run_both(ref, "gemm_rstd_rope", *args, **kwargs)
    check("qkv", out, bf16, fp32)


def test_gemm_rstd_rope_with_bias(backends, shape, use_compile):
    """Qwen2's QKV bias, added after the row scale and before the rotation."""
    cute, ref = backends
    args = (randn(shape.tokens, shape.dim), randn(shape.qkv_dim, shape.dim, scale=shape.dim**-0.5),
            rstd_of(shape.tokens), positions(shape))
    kwargs = dict(head_dim=shape.head_dim, rope_heads=shape.n_heads + shape.n_kv_heads, rope=ROPES["llama3"],
                  bias=randn(shape.qkv_dim))
    out = staged(cute.gemm_rstd_rope, use_compile)(*args, **kwargs)
    bf16 = ref.gemm_rstd_rope(*args, **kwargs)
    fp32 = ref.gemm_rstd_rope(*(a.float() if a.is_floating_point() else a for a in args),
                              **{**kwargs, "bias": kwargs["bias"].float()})
    check("qkv", out, bf16, fp32)


def test_gemm_rstd(backends, shape, use_compile):
    cute, ref = backends
    rows = min(shape.tokens, 2048)  # full logits are M × V; a slice of rows covers the tiles
    args = (randn(rows, shape.dim), randn(shape.vocab, shape.dim, scale=shape.dim**-0.5), rstd_of(rows))
    out = staged(cute.gemm_rstd, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_rstd", *args)
    check("logits", out, bf16, fp32)


def test_gemm_rstd_lse(backends, shape, use_compile):
    cute, ref = backends
    targets = torch.randint(0, shape.vocab, (shape.tokens,), device=DEVICE)
    ignored = torch.rand(shape.tokens, device=DEVICE) < 0.1
    targets[ignored] = IGNORE_INDEX
    # Logits of a few units, as a trained LM head produces.
    args = (randn(shape.tokens, shape.dim), randn(shape.vocab, shape.dim, scale=3 * shape.dim**-0.5),
            rstd_of(shape.tokens), targets)
    out = staged(cute.gemm_rstd_lse, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_rstd_lse", *args)
    check("lse", out.lse, bf16.lse, fp32.lse)
    check("target_logit", out.target_logit, bf16.target_logit, fp32.target_logit)
    assert (out.target_logit[ignored] == 0).all()


# ---- attention ---------------------------------------------------------------------------------


def test_fa4_attention(shape):
    check_fa4(shape.tokens // shape.seq_len, shape.seq_len, shape.n_heads, shape.n_kv_heads, shape.head_dim)


@pytest.mark.parametrize("head_dim", FA4_HEAD_DIMS)
def test_fa4_attention_at_head_dims(head_dim):
    """Every head dim block.attention=fa4 takes (FA4 4.0.0b36's backward is wrong at the others it
    accepts: 16, 48, 80, 104, 112 measured)."""
    check_fa4(2, 300, 4, 2, head_dim)


def check_fa4(batch: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """FA4's causal attention and its input gradient against SDPA (fp32 truth, bf16 baseline)."""
    qkv = randn(batch, seq_len, n_heads + 2 * n_kv_heads, head_dim)
    dout = randn(batch, seq_len, n_heads, head_dim)

    def run(fn, dtype):
        leaf = qkv.detach().to(dtype).clone().requires_grad_()
        out = fn(leaf, n_kv_heads)
        out.backward(dout.to(dtype))
        return out.detach(), leaf.grad

    fa4_out, fa4_grad = run(fa4_attention, torch.bfloat16)
    sdpa_out, sdpa_grad = run(sdpa_attention, torch.bfloat16)
    ref_out, ref_grad = run(sdpa_attention, torch.float32)
    check("attention.out", fa4_out, sdpa_out, ref_out)
    check("attention.dqkv", fa4_grad, sdpa_grad, ref_grad)


# ---- torch.compile -----------------------------------------------------------------------------


def test_layer_forward_compiles_without_graph_breaks(backends):
    """One CODA layer's forward traced with fullgraph=True (a graph break raises)."""
    cute, _ = backends
    s = SHAPES[1]
    k_attn = s.n_heads * s.head_dim
    w_o, w_gu = randn(s.dim, k_attn, scale=k_attn**-0.5), randn(2 * s.ffn_dim, s.dim, scale=s.dim**-0.5)
    w_down, w_qkv = randn(s.dim, s.ffn_dim, scale=s.ffn_dim**-0.5), randn(s.qkv_dim, s.dim, scale=s.dim**-0.5)
    g_mlp, g_attn = gamma(s.dim), gamma(s.dim)
    batch = s.tokens // s.seq_len

    def layer(x0: torch.Tensor, h0: torch.Tensor, r0: torch.Tensor, pos: torch.Tensor):
        qkv = cute.gemm_rstd_rope(h0, w_qkv, r0, pos, head_dim=s.head_dim,
                                  rope_heads=s.n_heads + s.n_kv_heads, rope=Rope(500000.0))
        heads = qkv.view(batch, s.seq_len, -1, s.head_dim)
        attn = fa4_attention(heads, s.n_kv_heads).reshape(s.tokens, k_attn)
        x1, h1, p1 = cute.gemm_residual_rms(attn, w_o, x0, g_mlp)
        _, y = cute.gemm_rstd_swiglu(h1, w_gu, cute.rstd_from_partials(p1, dim=s.dim, eps=EPS))
        x2, h2, p2 = cute.gemm_residual_rms(y, w_down, x1, g_attn)
        return x2, h2, cute.rstd_from_partials(p2, dim=s.dim, eps=EPS)

    x0 = randn(s.tokens, s.dim)
    h0 = (x0.float() * g_attn.float()).to(torch.bfloat16)
    r0 = torch.rsqrt(x0.float().square().mean(-1) + EPS)
    inputs = (x0, h0, r0, positions(s))
    eager = layer(*inputs)
    compiled = torch.compile(layer, fullgraph=True)(*inputs)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)



def test_head_stages_at_an_odd_vocabulary(backends, use_compile):
    """GPT-2's vocabulary (not a multiple of 8): full logits (rows padded internally, an (M, V) view
    returned), the LSE head, and the full-logits head's backward (row dot, norm backward over dlogits)."""
    cute, ref = backends
    m, d, v = 1000, 512, 50257
    h, w, x, g, rstd = randn(m, d), randn(v, d, scale=3 * d**-0.5), randn(m, d), gamma(d), rstd_of(m)
    logits = staged(cute.gemm_rstd, use_compile)(h, w, rstd)
    bf16, fp32 = run_both(ref, "gemm_rstd", h, w, rstd)
    check("logits", logits, bf16, fp32)
    targets = torch.randint(0, v, (m,), device=DEVICE)
    out = staged(cute.gemm_rstd_lse, use_compile)(h, w, rstd, targets)
    bf16, fp32 = run_both(ref, "gemm_rstd_lse", h, w, rstd, targets)
    check("lse", out.lse, bf16.lse, fp32.lse)
    check("target_logit", out.target_logit, bf16.target_logit, fp32.target_logit)
    dlogits = randn(m, v, scale=1e-2)
    zdz = staged(cute.row_dot, use_compile)(logits, dlogits)
    bf16, fp32 = run_both(ref, "row_dot", logits, dlogits)
    check("zdz", zdz, bf16, fp32)
    args = (dlogits, w, x, g, rstd, fp32)  # the exact zdz
    out = staged(cute.gemm_rms_bwd, use_compile)(*args)
    bf16, fp32 = run_both(ref, "gemm_rms_bwd", *args)
    check("dx", out.dx, bf16.dx, fp32.dx)
    check("n", out.n, bf16.n, fp32.n)
