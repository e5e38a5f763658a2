"""The final RMSNorm, LM head and cross-entropy in the fused-linear-cross-entropy order, on QuACK.

Three pieces, all QuACK's:
1. its RMSNorm row kernel writes n = rstd ⊙ x ⊙ γ once. The head's weight gradient needs n as a
   GEMM operand (dW = dlogitsᵀ·n) whatever the logits GEMM does, so folding the row scale into
   that GEMM's epilogue instead would still leave n to be written;
2. its chunked linear cross-entropy (`quack.linear_cross_entropy`): per chunk of rows the logits
   GEMM once, loss and dlogits in place of the logits, dn = dlogits·W and dW += dlogitsᵀ·n in
   fp32. The scaled-exp pipeline (dlogits as bf16 exponentials with per-tile power-of-two
   offsets, so no row pass over them) where it applies, the base pipeline elsewhere. The base
   pipeline leaves its last chunk's dW GEMM to the backward (`lm_head_dweight`), which runs it
   with the loss gradient as alpha and beta and writes the weight's dtype: the V×d fp32 sum is
   then read once, where adding the last chunk in the forward and scaling in the backward would
   read it twice and write it twice (QuACK's own autograd function does the same).
   Any vocabulary: QuACK keeps chunks of logits as (rows, V) TMA and cp.async operands, whose rows
   must be whole 16-byte units. A vocabulary that is not a multiple of 8 runs the same chunk loop
   here over logits rows padded to that multiple, the padded columns set to −inf before the
   cross-entropy, so they never enter the log-sum-exp and their dlogits are 0; the weight and
   every gradient keep the real V rows.
   Any logits: the scaled-exp pipeline carries each row's target term at its n-tile's power-of-two
   offset, e^(L − k_y ln 2), which overflows (and the offset 2^(k_y − k_r) underflows bf16) once a
   row's loss nears 88 nats: every gradient then comes out NaN. A micro-batch with a loss past
   SCALED_EXP_MAX_LOSS is recomputed on the base pipeline, whose dlogits are formed in fp32 at any
   magnitude. Read at once the check is a host sync per micro-batch; a training step defers it to
   its end (`kernels/checks.py`) and computes a step that failed it again;
3. its RMSNorm-backward row kernel on dn, which forms the ZdZ row sum Σ n·dn itself.
The op is functional (QuACK allocates its outputs), with a fake for torch.compile.
"""

from __future__ import annotations

import torch
from quack.cross_entropy import cross_entropy_fwd_out
from quack.gemm_interface import gemm, gemm_add, gemm_add_inplace
from quack.linear_cross_entropy import chunked_linear_cross_entropy_fwd, scaled_exp_linear_cross_entropy_fwd
from quack.rmsnorm import rmsnorm_fwd
from quack.rmsnorm_config import get_sm_count
from torch import Tensor

from codatrain.kernels.checks import holds
from codatrain.kernels.cute.common import ROW_MULTIPLE, padded_width

# The scaled-exp pipeline pads its last chunk to whole 128-row tiles and tiles the vocabulary by
# 128 rows in its weight-gradient GEMM; the base pipeline's GEMMs need rows in multiples of 8
# (16-byte TMA rows of bf16).
SCALED_EXP_TILE = 128
BASE_ROWS = 8
# The largest per-row loss (nats) at which the scaled-exp pipeline is exact: its target term
# e^(L - k_y ln 2) ≤ e^loss stays far below fp32's e^88.7 and the tile offset 2^(k_y - k_r) far
# above bf16's 2^-133 (the tile offsets k are rounded log2 units).
SCALED_EXP_MAX_LOSS = 64.0


def chunk_heights(rows: int, chunk_rows: int, multiple: int) -> set[int]:
    """The row counts of the chunks a pipeline launches over `rows` rows (the last one padded)."""
    last = rows - (rows - 1) // chunk_rows * chunk_rows
    return {min(rows, chunk_rows), -(-last // multiple) * multiple}


def scaled_exp_applies(rows: int, dim: int, vocab_size: int, chunk_rows: int) -> bool:
    """Whether the head takes QuACK's scaled-exp pipeline (bf16 on sm_90, as the cute backend
    always is): V and the chunks in whole 128-row tiles, d in 16-byte rows, and no chunk exactly
    d rows high. QuACK 0.6.5 infers the orientation of its per-row dx scale from the GEMM shape,
    which such a chunk makes ambiguous ("m == n makes row/col inference ambiguous")."""
    return (
        vocab_size % SCALED_EXP_TILE == 0 and chunk_rows % SCALED_EXP_TILE == 0 and dim % 8 == 0
        and dim not in chunk_heights(rows, chunk_rows, SCALED_EXP_TILE)
    )


def _padded(t: Tensor, rows: int, value: float | int) -> Tensor:
    """`t` with rows appended up to `rows`, filled with `value`."""
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _base_rows(rows: int) -> int:
    return -(-rows // BASE_ROWS) * BASE_ROWS


def dweight_parts(rows: int, dim: int, vocab_size: int, chunk_rows: int) -> tuple[bool, int]:
    """How `linear_cross_entropy` returns the weight gradient over `rows` rows: whether it has a
    summed fp32 part, and the rows of the last chunk it leaves pending (0: none)."""
    if scaled_exp_applies(rows, dim, vocab_size, chunk_rows):
        return True, 0
    padded = _base_rows(rows)
    last = padded - (padded - 1) // chunk_rows * chunk_rows
    return padded > chunk_rows, last


def _base_pipeline(n: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int,
                   ignore_index: int) -> list[Tensor]:
    """QuACK's base chunked pipeline: [loss, dn, dW of all chunks but the last (when there are
    several), the last chunk's dlogits and n]."""
    rows = _base_rows(n.shape[0])
    # Padded rows are zeros with ignored targets: no loss and no gradient.
    n_pad, targets_pad = _padded(n, rows, 0.0), _padded(targets, rows, ignore_index)
    if weight.shape[0] % ROW_MULTIPLE:
        return _padded_vocab_pipeline(n_pad, weight, targets_pad, chunk_rows, ignore_index)
    loss, dn, dweight, last_dlogits, last_n = chunked_linear_cross_entropy_fwd(
        n_pad, weight, targets_pad, chunk_rows, ignore_index, tuned=False
    )
    return [loss, dn, *([] if dweight is None else [dweight]), last_dlogits, last_n]


def _padded_vocab_pipeline(n: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int,
                           ignore_index: int) -> list[Tensor]:
    """The base pipeline's chunk loop (cuBLAS logits and dn GEMMs, QuACK's cross-entropy row kernel
    and dW GEMMs) for a vocabulary that is not a multiple of 8, over logits rows padded to 16
    bytes: the GEMMs see the (rows, V) view, the padded columns are −inf before the cross-entropy
    (outside its log-sum-exp; their dlogits come out 0). The dW sum runs over the whole padded
    width and is returned as its first V rows; the pending last chunk's dlogits as the (rows, V)
    view, whose padded row stride the weight-gradient GEMM reads by TMA."""
    vocab = weight.shape[0]
    loss = torch.empty(n.shape[0], dtype=torch.float32, device=n.device)
    dn = torch.empty_like(n)
    logits = torch.empty(min(chunk_rows, n.shape[0]), padded_width(vocab), dtype=n.dtype, device=n.device)
    chunks = list(zip(*(t.split(chunk_rows) for t in (n, targets, loss, dn)), strict=True))
    dweight = None
    for i, (n_chunk, target_chunk, loss_chunk, dn_chunk) in enumerate(chunks):
        dlogits = logits[: n_chunk.shape[0]]
        torch.mm(n_chunk, weight.T, out=dlogits[:, :vocab])
        dlogits[:, vocab:] = float("-inf")
        # The cross-entropy writes dlogits = softmax − onehot in place of the logits.
        cross_entropy_fwd_out(dlogits, target_chunk, None, loss_chunk, None, dlogits, None, ignore_index)
        torch.mm(dlogits[:, :vocab], weight, out=dn_chunk)
        if i == len(chunks) - 1:
            break
        if dweight is None:
            dweight = gemm(dlogits.T, n_chunk, out_dtype=torch.float32, tuned=False)
        else:
            gemm_add_inplace(dlogits.T, n_chunk, dweight, tuned=False)
    return [loss, dn, *([] if dweight is None else [dweight[:vocab]]), dlogits[:, :vocab], n_chunk]


def last_dlogits_like(rows: int, vocab_size: int, like: Tensor) -> Tensor:
    """An empty tensor laid out as the base pipeline's pending dlogits: (rows, V), rows padded to
    16 bytes (`_padded_vocab_pipeline`)."""
    return torch.empty_strided((rows, vocab_size), (padded_width(vocab_size), 1), dtype=like.dtype,
                               device=like.device)


def scaled_exp_is_exact(loss: Tensor) -> bool:
    """Whether a scaled-exp result holds (SCALED_EXP_MAX_LOSS): a host sync, or, inside a training
    step's `deferred_checks()`, taken to hold and checked at the step's end."""
    return holds(loss.max() <= SCALED_EXP_MAX_LOSS)


def summed_base_pipeline(n: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int,
                         ignore_index: int) -> list[Tensor]:
    """[loss, dn, dW] on the base pipeline with the last chunk's dW added (fp32), shaped as the
    scaled-exp pipeline returns them."""
    loss, dn, *parts = _base_pipeline(n, weight, targets, chunk_rows, ignore_index)
    *summed, last_dlogits, last_n = parts
    if not summed:
        return [loss, dn, gemm(last_dlogits.T, last_n, out_dtype=torch.float32, tuned=False)]
    gemm_add_inplace(last_dlogits.T, last_n, summed[0], tuned=False)
    return [loss, dn, summed[0]]


def linear_cross_entropy(n: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int,
                         ignore_index: int) -> list[Tensor]:
    """[loss, dn, *dW parts] of Σ cross-entropy(n·Wᵀ) over QuACK's pipelines, the dW parts as
    `dweight_parts` says (loss and dn may carry padded rows past n's)."""
    if scaled_exp_applies(n.shape[0], n.shape[1], weight.shape[0], chunk_rows):
        parts = scaled_exp_linear_cross_entropy_fwd(n, weight, targets, chunk_rows, ignore_index)
        if scaled_exp_is_exact(parts[0]):
            return list(parts)
        return summed_base_pipeline(n, weight, targets, chunk_rows, ignore_index)
    return _base_pipeline(n, weight, targets, chunk_rows, ignore_index)


def _lm_head_ce(x: Tensor, gamma: Tensor, weight: Tensor, targets: Tensor, eps: float, chunk_rows: int,
                ignore_index: int) -> list[Tensor]:
    m, d = x.shape
    n, _, rstd = rmsnorm_fwd(x, gamma, eps=eps, store_rstd=True)
    loss, dn, *dweight = linear_cross_entropy(n, weight, targets, chunk_rows, ignore_index)
    sm_count = get_sm_count(d, x.device)
    dx, dgamma_partials = torch.ops.quack.rmsnorm_bwd_f(x, gamma, dn[:m], rstd, None, sm_count)
    return [loss[:m].clone() if loss.shape[0] != m else loss, dx, dgamma_partials.sum(0), *dweight]


_lm_head_ce_op = torch.library.custom_op(
    "codatrain::cute_lm_head_ce", _lm_head_ce, mutates_args=(), device_types="cuda"
)


@_lm_head_ce_op.register_fake
def _(x, gamma, weight, targets, eps, chunk_rows, ignore_index):
    (m, d), vocab_size = x.shape, weight.shape[0]
    summed, last_rows = dweight_parts(m, d, vocab_size, chunk_rows)
    outs = [x.new_empty(m, dtype=torch.float32), torch.empty_like(x), x.new_empty(d, dtype=torch.float32)]
    if summed:
        outs.append(weight.new_empty(weight.shape, dtype=torch.float32))
    if last_rows:
        outs += [last_dlogits_like(last_rows, vocab_size, x), x.new_empty(last_rows, d)]
    return outs


def lm_head_ce(
    x: Tensor, gamma: Tensor, weight: Tensor, targets: Tensor, eps: float, chunk_rows: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(loss (M,), dx (M, d), dγ (d,) fp32, and the weight gradient's parts for `lm_head_dweight`:
    dW (V, d) fp32 or None, the pending last chunk's dlogits and n or None) for a unit gradient of
    Σ loss. Under torch.compile through the custom op (one graph node); in eager mode around it
    (the dispatcher costs tens of microseconds)."""
    fn = _lm_head_ce_op if torch.compiler.is_compiling() else _lm_head_ce
    loss, dx, dgamma, *parts = fn(x, gamma, weight, targets, eps, chunk_rows, ignore_index)
    return loss, dx, dgamma, *split_dweight(parts, x.shape[0], x.shape[1], weight.shape[0], chunk_rows)


def split_dweight(parts: list[Tensor], rows: int, dim: int, vocab_size: int,
                  chunk_rows: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """`linear_cross_entropy`'s weight-gradient parts as (dW or None, last dlogits, last n or None)."""
    summed, last_rows = dweight_parts(rows, dim, vocab_size, chunk_rows)
    dweight = parts[0] if summed else None
    last_dlogits, last_n = parts[summed:] if last_rows else (None, None)
    return dweight, last_dlogits, last_n


def lm_head_dweight(dweight: Tensor | None, last_dlogits: Tensor | None, last_n: Tensor | None,
                    scale: Tensor, dtype: torch.dtype) -> Tensor:
    """scale · (dweight + last_dlogitsᵀ·last_n) in `dtype`: the pending chunk's GEMM with the sum
    as its C and scale as alpha and beta (one read of the fp32 sum), else one scaling pass."""
    if last_dlogits is None:
        return torch.mul(dweight, scale, out=torch.empty(dweight.shape, dtype=dtype, device=dweight.device))
    if dweight is None:
        return gemm(last_dlogits.T, last_n, out_dtype=dtype, alpha=scale, tuned=False)
    if dweight.dtype == dtype:
        gemm_add_inplace(last_dlogits.T, last_n, dweight, alpha=scale, beta=scale, tuned=False)
        return dweight
    return gemm_add(last_dlogits.T, last_n, dweight, alpha=scale, beta=scale, out_dtype=dtype, tuned=False)
