"""dγ of every RMSNorm (attention, MLP, final) over several row tiles with a ragged last one
(300 rows at 128-row tiles: 128 + 128 + 44): the reference stages against torch.autograd of the
plain math in fp64, and the CODA model against the eager one. With a single row tile a sum and a
mean over the tiles' partials cannot be told apart; here they can."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_coda import assert_close_to, canonical_grads, model_pair

from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.stages import IGNORE_INDEX, Rope
from codatrain.model.config import LlamaConfig

M, TILE_M = 300, 128  # three row tiles, the last one partial
D, F_MLP, V = 24, 20, 37
HEAD_DIM, ROPE_HEADS, KV_HEADS = 4, 3, 1  # QKV: 2 q + 1 k rotated heads, 1 v head
N_QKV = (ROPE_HEADS + KV_HEADS) * HEAD_DIM
EPS, THETA = 1e-5, 1000.0
ROPE = {"head_dim": HEAD_DIM, "rope_heads": ROPE_HEADS, "rope": Rope(THETA)}


@pytest.fixture
def s() -> ReferenceStages:
    return ReferenceStages(tile_m=TILE_M)


def norm_backward(s, dz, weight, x, gamma, rstd, zdz, residual_grad=None):
    """The stage under test, at 128-row tiles; checks it made one dγ partial per row tile."""
    out = s.gemm_rms_bwd(dz, weight, x, gamma, rstd, zdz, residual_grad)
    assert out.dgamma_partials.shape == (math.ceil(M / TILE_M), D)
    return out


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).requires_grad_()


def norm_inputs():
    """x, γ and the consumer's input n = x / rms(x) ⊙ γ in plain math, with rstd for the stages."""
    x = rand(M, D)
    gamma = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    rstd = torch.rsqrt(x.square().mean(-1) + EPS)
    return x, gamma, rstd, x * rstd[:, None] * gamma


def plain_rope(z, positions):
    """Adjacent pairs (2i, 2i+1) of every rotated head turned by position · θ^(-2i/head_dim)."""
    rot = ROPE_HEADS * HEAD_DIM
    pairs = z[:, :rot].reshape(M, ROPE_HEADS, HEAD_DIM // 2, 2)
    freq = THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angle = positions[:, None, None].double() * freq
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)
    return torch.cat([rotated.reshape(M, rot), z[:, rot:]], 1)


def test_attention_norm_dgamma_over_row_tiles(s):
    x, gamma, rstd, n = norm_inputs()
    w_qkv = rand(N_QKV, D, scale=D**-0.5)
    positions = torch.arange(M) % 50
    qkv = plain_rope(n @ w_qkv.t(), positions)
    dqkv, dresidual = torch.randn_like(qkv), torch.randn_like(x)
    expected = torch.autograd.grad((qkv * dqkv).sum() + (x * dresidual).sum(), [x, gamma, w_qkv])
    with torch.no_grad():
        dz, zdz = s.rope_bwd(dqkv, qkv, positions, **ROPE)
        dx, n_out, dgamma_partials = norm_backward(s, dz, w_qkv, x, gamma, rstd, zdz, dresidual)
        actual = [dx, dgamma_partials.sum(0), s.wgrad(dz, n_out)]
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_mlp_norm_dgamma_over_row_tiles(s):
    x, gamma, rstd, n = norm_inputs()
    w_gu, w_down = rand(2 * F_MLP, D, scale=D**-0.5), rand(D, F_MLP, scale=F_MLP**-0.5)
    z = n @ w_gu.t()  # gate/up interleaved
    out = x + (F.silu(z[:, 0::2]) * z[:, 1::2]) @ w_down.t()
    dout = torch.randn_like(out)
    expected = torch.autograd.grad((out * dout).sum(), [x, gamma, w_gu, w_down])
    with torch.no_grad():
        dpreact, y, zdz = s.gemm_dswiglu(dout, w_down, z)
        dx, n_out, dgamma_partials = norm_backward(s, dpreact, w_gu, x, gamma, rstd, zdz, dout)
        actual = [dx, dgamma_partials.sum(0), s.wgrad(dpreact, n_out), s.wgrad(dout, y)]
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_final_norm_dgamma_over_row_chunks_of_the_cross_entropy_head(s):
    """`lm_head_ce` over 128-row chunks (128 + 128 + 44) sums dγ and dW over all of them."""
    x, gamma, _, n = norm_inputs()
    w_lm = rand(V, D, scale=D**-0.5)
    targets = torch.randint(0, V, (M,))
    targets[::7] = IGNORE_INDEX
    loss = F.cross_entropy(n @ w_lm.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    expected = torch.autograd.grad(loss, [x, gamma, w_lm])
    with torch.no_grad():
        out = s.lm_head_ce(x, gamma, w_lm, targets, eps=EPS, chunk_rows=TILE_M)
    torch.testing.assert_close(out.loss.sum(), loss, rtol=1e-12, atol=0)
    dweight = s.lm_head_dweight(*out[3:], torch.ones((), dtype=torch.float64), torch.float64)
    for e, a in zip(expected, [out.dx, out.dgamma, dweight], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_final_norm_dgamma_over_row_tiles_of_the_logits_head(s):
    x, gamma, rstd, n = norm_inputs()
    w_lm = rand(V, D, scale=D**-0.5)
    logits = n @ w_lm.t()
    dlogits = torch.randn_like(logits)
    expected = torch.autograd.grad((logits * dlogits).sum(), [x, gamma, w_lm])
    with torch.no_grad():
        zdz = s.row_dot(logits, dlogits)
        dx, n_out, dgamma_partials = norm_backward(s, dlogits, w_lm, x, gamma, rstd, zdz)
        actual = [dx, dgamma_partials.sum(0), s.wgrad(dlogits, n_out)]
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


# ---- the whole model: every norm's dγ summed over row tiles (and over LM-head chunks) ----------

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=64, rope_theta=1000.0)


@pytest.mark.parametrize("targets,head_chunk_rows", [(True, None), (True, 256), (False, None)],
                         ids=["loss-one-head-chunk", "loss-head-chunks-256+44", "logits"])
def test_model_norm_gradients_over_row_tiles_match_eager(targets, head_chunk_rows):
    eager, coda = model_pair(CFG, torch.float64, head_chunk_rows=head_chunk_rows)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, M // 2), generator=g)  # 300 rows
    if targets:
        labels = torch.randint(0, CFG.vocab_size, (2, M // 2), generator=g)
        F.cross_entropy(eager(tokens).flatten(0, 1), labels.flatten()).backward()
        coda(tokens, labels).backward()
    else:
        weights = torch.randn(2, M // 2, CFG.vocab_size, dtype=torch.float64, generator=g)
        (eager(tokens) * weights).sum().backward()
        (coda(tokens) * weights).sum().backward()
    grads = canonical_grads(coda)
    norms = [n for n, p in eager.named_parameters() if p.dim() == 1]
    assert len(norms) == 2 * CFG.n_layers + 1  # attention and MLP norm of every layer, the final norm
    for name, p in eager.named_parameters():
        assert_close_to(grads[name], p.grad, 1e-10, name)
