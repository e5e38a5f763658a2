"""The stage API and its reference backend: forward conventions, and every backward stage against
torch.autograd of the forward stages it inverts (fp64)."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F_nn
from torch.overrides import TorchFunctionMode

from codatrain.config import AttentionChoice, BlockImpl, StageBackendChoice
from codatrain.kernels.attention import get_attention, sdpa_attention
from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.resolve import ResolvedBlock, resolve_block
from codatrain.kernels.stages import (
    HEAD_CHUNK_MULTIPLE,
    IGNORE_INDEX,
    BackendUnavailableError,
    Rope,
    StageBackend,
    get_backend,
    register_backend,
)

M, D, K, F, V = 37, 40, 24, 18, 29  # rows, model width, out-proj input, MLP width, vocab
HEAD_DIM, ROPE_HEADS, KV_HEADS = 8, 3, 1  # QKV: 3 rotated heads (2 q + 1 k) and 1 v head
N_QKV = (ROPE_HEADS + KV_HEADS) * HEAD_DIM
EPS, THETA = 1e-5, 1000.0
ROPE = {"head_dim": HEAD_DIM, "rope_heads": ROPE_HEADS, "rope": Rope(THETA)}


@pytest.fixture
def s() -> ReferenceStages:
    # A tiny logits budget makes the LM head's forward work in several row chunks; small tiles
    # give the norm statistics several partial sums (columns of 16, rows of 8).
    return ReferenceStages(logits_chunk_elements=5 * V, tile_n=16, tile_m=8)


def rand(*shape, scale=1.0, requires_grad=True):
    return (torch.randn(*shape, dtype=torch.float64) * scale).requires_grad_(requires_grad)


def norm_producer(s):
    """F1 + R: the residual stream x that a norm reads, built from leaves autograd can reach."""
    a, w_o, residual = rand(M, K), rand(D, K, scale=K**-0.5), rand(M, D)
    gamma = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    x, h, sq = s.gemm_residual_rms(a, w_o, residual, gamma)
    rstd = s.rstd_from_partials(sq, dim=D, eps=EPS)
    return (a, w_o, residual, gamma), (x, h, rstd)


def producer_grads(s, leaves, dx):
    """Backward stages of F1, given the gradient of its output x."""
    a, w_o, _, _ = leaves
    return s.dgrad(dx, w_o), s.wgrad(dx, a), dx


def assert_grads(expected, actual):
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_residual_rms_forward_conventions(s):
    (a, w_o, residual, gamma), (x, h, rstd) = norm_producer(s)
    sq = s.gemm_residual_rms(a, w_o, residual, gamma).sq_partials
    assert sq.shape == (M, math.ceil(D / 16))
    expected_x = residual + a @ w_o.t()
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(h, expected_x * gamma)
    torch.testing.assert_close(sq[:, 1], expected_x[:, 16:32].square().sum(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(expected_x.square().mean(-1) + EPS))


def test_stat_dtypes_for_bf16_inputs(s):
    bf16 = {"dtype": torch.bfloat16}
    out = s.gemm_residual_rms(torch.randn(M, K, **bf16), torch.randn(D, K, **bf16), torch.randn(M, D, **bf16),
                              torch.ones(D, **bf16))
    assert out.x.dtype == out.h.dtype == torch.bfloat16 and out.sq_partials.dtype == torch.float32
    rstd = s.rstd_from_partials(out.sq_partials, dim=D, eps=EPS)
    preact, y = s.gemm_rstd_swiglu(out.h, torch.randn(2 * F, D, **bf16), rstd)
    assert rstd.dtype == torch.float32 and preact.dtype == y.dtype == torch.bfloat16


def test_row_scaled_gemms_in_bf16_write_bf16(s):
    h, rstd = torch.randn(M, D).bfloat16(), torch.rand(M) + 0.5
    qkv = s.gemm_rstd_rope(h, torch.randn(N_QKV, D).bfloat16(), rstd, torch.arange(M), **ROPE)
    logits = s.gemm_rstd(h, torch.randn(V, D).bfloat16(), rstd)
    assert qkv.dtype == logits.dtype == torch.bfloat16

def test_backward_stages_in_bf16_write_bf16_activations_and_fp32_statistics(s):
    """bf16 inputs: each backward stage rounds its GEMM's product to bf16 once, does its epilogue
    math in fp32 and writes activations in bf16, statistics in fp32."""
    def r(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).bfloat16()

    f32, bf16 = torch.float32, torch.bfloat16
    dout, w_down, preact = r(M, D), r(D, F, scale=F**-0.5), r(M, 2 * F, scale=2.0)
    dpreact, y, zdz = s.gemm_dswiglu(dout, w_down, preact)
    assert dpreact.dtype == y.dtype == bf16 and zdz.dtype == f32
    dy, g, u = (dout @ w_down).float(), preact[:, 0::2].float(), preact[:, 1::2].float()
    dg, du = dy * u * torch.sigmoid(g) * (1 + g * (1 - torch.sigmoid(g))), dy * F_nn.silu(g)
    torch.testing.assert_close(zdz, (g * dg + u * du).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, (F_nn.silu(g) * u).bfloat16(), rtol=0, atol=0)

    qkv, dqkv, positions = r(M, N_QKV), r(M, N_QKV), torch.arange(M)
    dz, zdz = s.rope_bwd(dqkv, qkv, positions, **ROPE)
    assert dz.dtype == bf16 and zdz.dtype == f32
    torch.testing.assert_close(zdz, (qkv.float() * dqkv.float()).sum(-1), rtol=1e-5, atol=1e-5)

    x, gamma, rstd, w_gu, dresidual = r(M, D), r(D), torch.rand(M) + 0.5, r(2 * F, D, scale=D**-0.5), r(M, D)
    out = s.gemm_rms_bwd(dpreact, w_gu, x, gamma, rstd, zdz, dresidual)
    assert out.dx.dtype == out.n.dtype == bf16 and out.dgamma_partials.dtype == f32
    dn, rs = (dpreact @ w_gu).float(), rstd[:, None]
    dx = rs * (dn * gamma.float() - x.float() * rs * (zdz[:, None] / D)) + dresidual.float()
    # fp32 math rounded once: only a different summation order could flip a bf16 rounding.
    assert (out.dx != dx.bfloat16()).float().mean() < 0.01

    logits, dlogits = r(M, V), r(M, V)
    zdz = s.row_dot(logits, dlogits)
    assert zdz.dtype == f32
    torch.testing.assert_close(zdz, (logits.float() * dlogits.float()).sum(-1), rtol=1e-5, atol=1e-5)

    tokens = torch.tensor([1, 4, 1, 0])
    grad = s.entry_bwd(r(4, D), tokens, num_embeddings=5)
    assert grad.dtype == bf16 and grad.shape == (5, D)

def test_rope_rotates_adjacent_pairs_and_keeps_v(s):
    h, w, rstd = rand(M, D), rand(N_QKV, D), torch.rand(M, dtype=torch.float64) + 0.5
    positions = torch.arange(M) % 11
    qkv = s.gemm_rstd_rope(h, w, rstd, positions, **ROPE)
    z = (h @ w.t()) * rstd[:, None]
    rope_cols = ROPE_HEADS * HEAD_DIM
    torch.testing.assert_close(qkv[:, rope_cols:], z[:, rope_cols:])
    # head 1, pair i = 2: angle position · θ^(-2i/d_h)
    col = HEAD_DIM + 2 * 2
    angle = positions.double() * THETA ** (-4 / HEAD_DIM)
    a, b = z[:, col], z[:, col + 1]
    torch.testing.assert_close(qkv[:, col], a * angle.cos() - b * angle.sin())
    torch.testing.assert_close(qkv[:, col + 1], a * angle.sin() + b * angle.cos())


def test_qkv_backward_stages(s):
    """rope_bwd → gemm_rms_bwd (with the residual gradient) → wgrad, then F1's dgrad/wgrad."""
    leaves, (x, h, rstd) = norm_producer(s)
    w_qkv = rand(N_QKV, D, scale=D**-0.5)
    positions = torch.arange(M) % 13
    qkv = s.gemm_rstd_rope(h, w_qkv, rstd, positions, **ROPE)
    dqkv, dresidual = torch.randn_like(qkv), torch.randn_like(x)
    loss = (qkv * dqkv).sum() + (x * dresidual).sum()
    expected = torch.autograd.grad(loss, [*leaves, w_qkv])

    with torch.no_grad():
        dz, zdz = s.rope_bwd(dqkv, qkv, positions, **ROPE)
        dx, n, dgamma_partials = s.gemm_rms_bwd(dz, w_qkv, x, leaves[3], rstd, zdz, dresidual)
        assert dgamma_partials.shape == (math.ceil(M / 8), D)
        torch.testing.assert_close(n, h * rstd[:, None])
        da, dw_o, dres = producer_grads(s, leaves, dx)
        actual = [da, dw_o, dres, dgamma_partials.sum(0), s.wgrad(dz, n)]
    assert_grads(expected, actual)


def test_mlp_backward_stages(s):
    """gemm_dswiglu → gemm_rms_bwd (residual gradient = dout) → wgrads, then F1's."""
    leaves, (x, h, rstd) = norm_producer(s)
    w_gu, w_down = rand(2 * F, D, scale=D**-0.5), rand(D, F, scale=F**-0.5)
    preact, y = s.gemm_rstd_swiglu(h, w_gu, rstd)
    out = s.gemm_residual_rms(y, w_down, x, torch.ones(D, dtype=torch.float64)).x
    dout = torch.randn_like(out)
    expected = torch.autograd.grad((out * dout).sum(), [*leaves, w_gu, w_down])

    with torch.no_grad():
        dpreact, y2, zdz = s.gemm_dswiglu(dout, w_down, preact)
        torch.testing.assert_close(y2, y)
        torch.testing.assert_close(zdz, (preact * dpreact).sum(-1))
        dx, n, dgamma_partials = s.gemm_rms_bwd(dpreact, w_gu, x, leaves[3], rstd, zdz, dout)
        actual = [*producer_grads(s, leaves, dx), dgamma_partials.sum(0), s.wgrad(dpreact, n),
                  s.wgrad(dout, y2)]
    assert_grads(expected, actual)


@pytest.mark.parametrize("chunk_rows", [M, 20, 8], ids=["one-chunk", "chunks-20+17", "chunks-of-8"])
def test_lm_head_ce_gives_the_loss_and_gradients_of_norm_head_and_cross_entropy(s, chunk_rows):
    """The final norm, the head and the summed cross-entropy, forward and backward in one call,
    against torch.autograd of the plain math; ignored targets count in neither."""
    x = rand(M, D)
    gamma = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    w_lm = rand(V, D, scale=D**-0.5)
    targets = torch.randint(0, V, (M,))
    targets[::4] = IGNORE_INDEX
    n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * gamma
    row_loss = torch.nn.functional.cross_entropy(n @ w_lm.t(), targets, ignore_index=IGNORE_INDEX,
                                                 reduction="none")
    expected = torch.autograd.grad(row_loss.sum(), [x, gamma, w_lm])
    with torch.no_grad():
        out = s.lm_head_ce(x, gamma, w_lm, targets, eps=EPS, chunk_rows=chunk_rows)
    torch.testing.assert_close(out.loss, row_loss, rtol=1e-12, atol=1e-12)
    assert (out.loss[::4] == 0).all()
    assert out.dgamma.dtype == torch.float64
    dweight = s.lm_head_dweight(*out[3:], torch.ones((), dtype=torch.float64), torch.float64)
    assert_grads(expected, [out.dx, out.dgamma, dweight])


@pytest.mark.parametrize("chunk_rows", [M, 20], ids=["one-chunk", "chunks-20+17"])
def test_lm_head_leaves_its_last_chunks_weight_gradient_to_a_scaled_rounding_pass(s, chunk_rows):
    """The reference head, like the cute base pipeline, sums the weight gradient of every chunk
    but the last and keeps the last chunk's dlogits and n (activation dtype); `lm_head_dweight`
    adds that chunk, scales by the loss gradient and rounds once to the weight's dtype."""
    x, gamma = rand(M, D, requires_grad=False), 1 + 0.3 * torch.randn(D, dtype=torch.float64)
    w_lm = rand(V, D, scale=D**-0.5, requires_grad=False)
    targets = torch.randint(0, V, (M,))
    n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * gamma
    logits = n @ w_lm.t()
    dlogits = torch.softmax(logits, -1) - torch.nn.functional.one_hot(targets, V)
    out = s.lm_head_ce(x, gamma, w_lm, targets, eps=EPS, chunk_rows=chunk_rows)
    last = (M - 1) // chunk_rows * chunk_rows
    if last:
        torch.testing.assert_close(out.dweight, dlogits[:last].t() @ n[:last], rtol=1e-10, atol=1e-12)
    else:
        assert out.dweight is None
    torch.testing.assert_close(out.last_dlogits, dlogits[last:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.last_n, n[last:], rtol=1e-12, atol=1e-12)
    scale = torch.tensor(0.37, dtype=torch.float64)
    dweight = s.lm_head_dweight(*out[3:], scale, torch.float32)
    assert dweight.dtype == torch.float32
    torch.testing.assert_close(dweight, (0.37 * dlogits.t() @ n).float(), rtol=1e-6, atol=1e-7)


def test_lm_head_ce_in_bf16_keeps_its_statistics_in_fp32(s):
    """bf16 activations: the normed rows and the logits are rounded to bf16 once (the GEMMs'
    operand and result), everything after is fp32: the loss, dγ and dW (dx is written in bf16, and so
    is the last chunk's dlogits, the operand of the weight-gradient GEMM left to the backward)."""
    bf16 = {"dtype": torch.bfloat16}
    x, w_lm = torch.randn(M, D, **bf16), torch.randn(V, D, **bf16)
    gamma = (1 + 0.3 * torch.randn(D)).bfloat16()
    targets = torch.randint(0, V, (M,))
    targets[::4] = IGNORE_INDEX
    out = s.lm_head_ce(x, gamma, w_lm, targets, eps=EPS, chunk_rows=8)
    assert out.loss.dtype == out.dgamma.dtype == out.dweight.dtype == torch.float32
    assert out.dx.dtype == out.last_dlogits.dtype == out.last_n.dtype == torch.bfloat16
    xs = x.float()
    n = (xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + EPS) * gamma.float()).bfloat16()
    logits = (n @ w_lm.t()).float()
    valid = targets != IGNORE_INDEX
    picked = logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    loss = torch.where(valid, logits.logsumexp(-1) - picked, 0.0)
    torch.testing.assert_close(out.loss, loss, rtol=1e-6, atol=1e-6)
    dlogits = (logits.softmax(-1) - F_nn.one_hot(targets.clamp(min=0), V)) * valid[:, None]
    dweight = s.lm_head_dweight(*out[3:], torch.ones(()), torch.float32)
    torch.testing.assert_close(dweight, dlogits.bfloat16().float().t() @ n.float(), rtol=1e-5, atol=1e-5)


def test_logits_backward_stages(s):
    """row_dot → gemm_rms_bwd → wgrad, for the plain row-scaled GEMM (full logits)."""
    leaves, (x, h, rstd) = norm_producer(s)
    w_lm = rand(V, D, scale=D**-0.5)
    logits = s.gemm_rstd(h, w_lm, rstd)
    dlogits = torch.randn_like(logits)
    expected = torch.autograd.grad((logits * dlogits).sum(), [*leaves, w_lm])
    with torch.no_grad():
        dx, n, dgamma_partials = s.gemm_rms_bwd(dlogits, w_lm, x, leaves[3], rstd, s.row_dot(logits, dlogits))
        actual = [*producer_grads(s, leaves, dx), dgamma_partials.sum(0), s.wgrad(dlogits, n)]
    assert_grads(expected, actual)


def test_entry_backward_stages(s):
    """entry → F4 forward; rope_bwd → gemm_rms_bwd → entry_bwd backward."""
    tokens = torch.randint(0, V, (M,))
    tokens[:5] = 3  # repeated tokens: their gradients must add up
    embedding, w_qkv = rand(V, D), rand(N_QKV, D, scale=D**-0.5)
    gamma = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    positions = torch.arange(M)
    x, h, rstd = s.entry(tokens, embedding, gamma, eps=EPS)
    torch.testing.assert_close(rstd, torch.rsqrt(x.square().mean(-1) + EPS))
    qkv = s.gemm_rstd_rope(h, w_qkv, rstd, positions, **ROPE)
    dqkv, dresidual = torch.randn_like(qkv), torch.randn_like(x)
    expected = torch.autograd.grad((qkv * dqkv).sum() + (x * dresidual).sum(), [embedding, gamma, w_qkv])
    with torch.no_grad():
        dz, zdz = s.rope_bwd(dqkv, qkv, positions, **ROPE)
        dx, n, dgamma_partials = s.gemm_rms_bwd(dz, w_qkv, x, gamma, rstd, zdz, dresidual)
        actual = [s.entry_bwd(dx, tokens, num_embeddings=V), dgamma_partials.sum(0), s.wgrad(dz, n)]
    assert_grads(expected, actual)


class MatmulShapes(TorchFunctionMode):
    """Records the operand shapes of every matrix product run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__"):
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_lse_head_gives_log_sum_exp_and_target_logit_over_row_chunks(s):
    """`gemm_rstd_lse` (evaluation's head) in row chunks of 5 (a 5·V logits budget; 37 = 7·5 + 2):
    per row the log-sum-exp of the row-scaled logits and the target's logit, 0 for an ignored one.
    Each logits block holds as many whole rows as the budget allows, and at least one."""
    h, w_lm = rand(M, K, requires_grad=False), rand(V, K, scale=K**-0.5, requires_grad=False)
    rstd = torch.rand(M, dtype=torch.float64) + 0.5
    targets = torch.randint(0, V, (M,))
    targets[::4] = IGNORE_INDEX
    with MatmulShapes() as recorded:
        lse, target_logit = s.gemm_rstd_lse(h, w_lm, rstd, targets)
    assert [a for a, _ in recorded.shapes] == [(5, K)] * 7 + [(2, K)]
    logits = (h @ w_lm.t()) * rstd[:, None]
    torch.testing.assert_close(lse, logits.logsumexp(-1), rtol=1e-12, atol=1e-12)
    valid = targets != IGNORE_INDEX
    torch.testing.assert_close(target_logit[valid], logits[valid, targets[valid]], rtol=1e-12, atol=1e-12)
    assert (target_logit[~valid] == 0).all()
    # A budget below one row: one row at a time. `ignore_index` is honoured.
    targets = targets.clamp(min=0)
    targets[1] = 3
    with MatmulShapes() as recorded:
        one_row = ReferenceStages(logits_chunk_elements=1).gemm_rstd_lse(h, w_lm, rstd, targets,
                                                                         ignore_index=3)
    assert [a for a, _ in recorded.shapes] == [(1, K)] * M
    torch.testing.assert_close(one_row.lse, lse, rtol=1e-12, atol=1e-12)
    kept = targets != 3
    torch.testing.assert_close(one_row.target_logit[kept], logits[kept, targets[kept]], rtol=1e-12,
                               atol=1e-12)
    assert (one_row.target_logit[~kept] == 0).all()

def test_wgrad_adds_into_the_given_gradient_in_place(s):
    dz, a = rand(M, D, requires_grad=False), rand(M, K, requires_grad=False)
    grad = torch.randn(D, K, dtype=torch.float64)
    before = grad.clone()
    out = s.wgrad(dz, a, accumulate_into=grad)
    assert out is grad
    torch.testing.assert_close(grad, before + dz.t() @ a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.wgrad(dz, a), dz.t() @ a, rtol=1e-12, atol=1e-12)


def test_entry_without_a_dtype_writes_rows_in_the_embedding_dtype(s):
    embedding, gamma = torch.randn(V, D, dtype=torch.float64), torch.rand(D, dtype=torch.float64) + 0.5
    tokens = torch.tensor([3, 0, 3, V - 1])
    x, h, rstd = s.entry(tokens, embedding, gamma, eps=EPS)
    assert x.dtype == h.dtype == rstd.dtype == torch.float64
    torch.testing.assert_close(x, embedding[tokens], rtol=0, atol=0)
    torch.testing.assert_close(h, embedding[tokens] * gamma, rtol=1e-15, atol=0)

# ---- registries --------------------------------------------------------------------------------


def test_backend_registry_on_cpu():
    assert isinstance(get_backend("reference", "cpu"), ReferenceStages)
    with pytest.raises(BackendUnavailableError, match="'cute'"):
        get_backend("cute", "cpu")
    with pytest.raises(ValueError, match="unknown stage backend 'triton'"):
        get_backend("triton", "cpu")
    # `auto` is no backend: resolve_block decides it.
    with pytest.raises(ValueError, match="unknown stage backend 'auto'"):
        get_backend("auto", "cpu")


def test_auto_is_resolved_once_per_device():
    cpu = torch.device("cpu")
    assert resolve_block("coda", "auto", "auto", cpu) == ResolvedBlock("coda", "reference", "sdpa")
    # The precompile target (no device): a Hopper GPU with the cuda extras.
    assert resolve_block("coda", "auto", "auto", None) == ResolvedBlock("coda", "cute", "fa4")
    # A head dim FA4 computes wrongly: auto attention is SDPA, with a warning; explicit fa4 stays.
    with pytest.warns(UserWarning, match="block.attention=auto takes sdpa: .* head dim 80"):
        auto = resolve_block("coda", "auto", "auto", None, head_dim=80)
    assert auto == ResolvedBlock("coda", "cute", "sdpa")
    assert resolve_block("coda", "auto", "auto", None, head_dim=128) == ResolvedBlock("coda", "cute", "fa4")
    assert resolve_block("coda", "auto", "fa4", None, head_dim=80).fa4
    # Resolved for a device, the block holds its kernels; without one, only their names.
    portable = resolve_block("coda", "reference", "sdpa", cpu)
    assert isinstance(portable.stages, ReferenceStages) and portable.attention_fn is sdpa_attention
    assert resolve_block("coda", "auto", "auto", None).stages is None
    # Explicit names that cannot run on the device are refused here; the eager block runs no CODA kernels.
    with pytest.raises(BackendUnavailableError, match="'cute' cannot run on cpu"):
        resolve_block("coda", "cute", "sdpa", cpu)
    # The config's choices (StrEnums) are named by value, as the user wrote them.
    with pytest.raises(BackendUnavailableError, match=r"^stage backend 'cute' cannot run on cpu"):
        resolve_block(BlockImpl.coda, StageBackendChoice.cute, AttentionChoice.sdpa, cpu)
    with pytest.raises(BackendUnavailableError, match="'fa4' needs an sm_90 GPU, not cpu"):
        resolve_block("coda", "reference", "fa4", cpu)
    eager = resolve_block("eager", "auto", "auto", None)
    assert eager == ResolvedBlock("eager", None, None) and not (eager.cute_stages or eager.fa4)


def test_head_chunk_rows_are_whole_tiles():
    s = ReferenceStages()
    assert s.head_chunk_rows(128256) == 4096
    assert s.head_chunk_rows(1 << 30) == HEAD_CHUNK_MULTIPLE  # at least one multiple
    assert s.head_chunk_rows(1000) % HEAD_CHUNK_MULTIPLE == 0


def test_registering_a_backend_is_one_line():
    class Doubling(ReferenceStages):
        def dgrad(self, dz, weight):
            return 2 * super().dgrad(dz, weight)

    register_backend("test-doubling", Doubling())
    backend = get_backend("test-doubling", "cpu")
    assert isinstance(backend, StageBackend) and backend.name == "test-doubling"
    assert torch.equal(backend.dgrad(torch.ones(2, 3), torch.ones(3, 4)), torch.full((2, 4), 6.0))


def test_attention_registry_on_cpu():
    assert get_attention("sdpa", torch.device("cpu")) is sdpa_attention
    with pytest.raises(BackendUnavailableError, match="'fa4'"):
        get_attention("fa4", torch.device("cpu"))


# ---- the cute backend without a GPU ------------------------------------------------------------


def test_cute_stages_trace_under_compile():
    """Every cute stage traces under torch.compile(fullgraph=True) on meta tensors: the methods
    allocate their outputs and the out-style custom ops need no fake of their own. Outputs match
    the reference stages' shapes and dtypes (partial sums aside: their count is the kernel's)."""
    cute_extras = ("cutlass", "quack", "flash_attn")
    if not all(importlib.util.find_spec(name) for name in cute_extras):
        pytest.skip("needs the cuda extras")
    from codatrain.kernels.cute import CuteStages

    cute, ref = CuteStages(), ReferenceStages()
    m, d, f, v, pairs = 64, 32, 48, 96, {"head_dim": 8, "rope_heads": 3, "rope": Rope(THETA)}
    act = {"dtype": torch.bfloat16, "device": "meta"}
    h, x, w_gu, w_down = torch.empty(m, d, **act), torch.empty(m, d, **act), torch.empty(2 * f, d, **act), \
        torch.empty(d, f, **act)
    w_qkv, w_lm, gamma = torch.empty(32, d, **act), torch.empty(v, d, **act), torch.empty(d, **act)
    rstd = torch.empty(m, device="meta")
    tokens = torch.empty(m, dtype=torch.long, device="meta")

    def stages(s):
        e = s.entry(tokens, w_lm, gamma, eps=EPS)
        preact, y = s.gemm_rstd_swiglu(h, w_gu, rstd)
        x2, h2, _ = s.gemm_residual_rms(y, w_down, x, gamma)
        qkv = s.gemm_rstd_rope(h2, w_qkv, rstd, tokens, **pairs)
        lse, target_logit = s.gemm_rstd_lse(h2, w_lm, rstd, tokens)
        dz, zdz = s.rope_bwd(qkv, qkv, tokens, **pairs)
        dx, n, _ = s.gemm_rms_bwd(dz, w_qkv, x2, gamma, rstd, zdz, x)
        dpreact, y2, zdz2 = s.gemm_dswiglu(dx, w_down, preact)
        head = s.lm_head_ce(x2, gamma, w_lm, tokens, eps=EPS, chunk_rows=32)
        dw_lm = s.lm_head_dweight(*head[3:], torch.ones((), device="meta"), torch.bfloat16)
        dw = s.wgrad(dx, x, accumulate_into=torch.zeros(d, d, device="meta"))
        return (*e, preact, y, x2, h2, qkv, lse, target_logit, dz, zdz, dx, n, dpreact, y2, zdz2, *head,
                dw_lm, dw, s.gemm_rstd(h2, w_lm, rstd), s.row_dot(qkv, qkv), s.dgrad(dx, w_qkv.t()),
                s.entry_bwd(dx, tokens, num_embeddings=v))

    compiled = torch.compile(lambda: stages(cute), fullgraph=True, backend="eager")()
    expected = stages(ref)
    assert [(t.shape, t.dtype) for t in compiled] == [(t.shape, t.dtype) for t in expected]
