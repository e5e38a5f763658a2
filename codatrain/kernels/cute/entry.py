"""Model entry and its backward as CuTeDSL kernels.

Forward: one CTA per token row gathers the embedding row of the token, writes x (rounded to the
activation dtype, the x every later stage reads), h = x ⊙ γ, and rstd of x as written, so the
row is read from memory once. A row of a Llama-3-8B embedding is 8 KB in bf16; with 128 threads
moving 16 bytes each per step that is four steps, and M rows give M CTAs to fill the GPU.

Backward: one CTA per token row adds its dx row into row `token` of an fp32 gradient table with
atomic reductions (rows of repeated tokens meet in the same table row), then the table is
rounded once to the activation dtype.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr
from quack.cache import jit_cache
from quack.compile_utils import make_fake_stream, make_fake_tensor
from quack.copy_utils import get_copy_atom, tiled_copy_1d
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.reduce import row_reduce
from torch import Tensor

from codatrain.kernels.cute.torch_op import stage_op

_MAX_THREADS = 128


class EntryKernel:
    """x = E[tok], h = x ⊙ γ, rstd = (mean x² + eps)^-1/2 for one row per CTA.

    Columns are split into `vec`-element vectors (16 bytes for the widest dtype involved);
    thread t owns vectors t, t + threads, … of the row. `tile_n` rounds the row up to a whole
    number of such sweeps; vectors past `dim` are masked off and count as zeros in the sum.
    """

    def __init__(self, emb_dtype: type, out_dtype: type, gamma_dtype: type, dim: int) -> None:
        self.emb_dtype, self.out_dtype, self.gamma_dtype, self.dim = emb_dtype, out_dtype, gamma_dtype, dim
        widest = max(emb_dtype.width, out_dtype.width, gamma_dtype.width)
        self.vec = math.gcd(dim, 128 // widest)
        vectors = dim // self.vec
        self.num_threads = min(_MAX_THREADS, 32 * math.ceil(vectors / 32))
        self.steps = math.ceil(vectors / self.num_threads)
        self.tile_n = self.steps * self.num_threads * self.vec

    @cute.jit
    def __call__(
        self,
        mTok: cute.Tensor,
        mEmb: cute.Tensor,
        mGamma: cute.Tensor,
        mX: cute.Tensor,
        mH: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(mTok, mEmb, mGamma, mX, mH, mRstd, eps).launch(
            grid=[mX.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mTok: cute.Tensor,
        mEmb: cute.Tensor,
        mGamma: cute.Tensor,
        mX: cute.Tensor,
        mH: cute.Tensor,
        mRstd: cute.Tensor,
        eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        num_warps = const_expr(self.num_threads // cute.arch.WARP_SIZE)
        # row_reduce's cross-warp buffer: (rows per CTA, (warps per row, cluster size)).
        reduction_buffer = smem.allocate_tensor(
            Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8
        )

        tok = mTok[row]
        tiler = (self.tile_n,)
        gEmb = cute.local_tile(mEmb[tok, None], tiler, (0,))
        gGamma = cute.local_tile(mGamma, tiler, (0,))
        gX = cute.local_tile(mX[row, None], tiler, (0,))
        gH = cute.local_tile(mH[row, None], tiler, (0,))
        gCol = cute.local_tile(cute.make_identity_tensor(self.dim), tiler, (0,))

        # One thread partition per dtype (the copy atom carries the element type); all of
        # them give thread t the same columns.
        part_emb = tiled_copy_1d(self.emb_dtype, self.num_threads, self.vec).get_slice(tidx)
        part_gamma = tiled_copy_1d(self.gamma_dtype, self.num_threads, self.vec).get_slice(tidx)
        part_out = tiled_copy_1d(self.out_dtype, self.num_threads, self.vec).get_slice(tidx)
        tEg = part_emb.partition_S(gEmb)
        tGg = part_gamma.partition_S(gGamma)
        tXg = part_out.partition_D(gX)
        tHg = part_out.partition_D(gH)
        tCol = part_out.partition_S(gCol)

        tEr = cute.make_rmem_tensor_like(tEg)
        tGr = cute.make_rmem_tensor_like(tGg)
        tEr.fill(0)
        tGr.fill(0)
        emb_atom = get_copy_atom(self.emb_dtype, self.vec)
        gamma_atom = get_copy_atom(self.gamma_dtype, self.vec)
        out_atom = get_copy_atom(self.out_dtype, self.vec)
        for step in cutlass.range_constexpr(self.steps):
            if tCol[0, step] < self.dim:
                cute.copy(emb_atom, tEg[None, step], tEr[None, step])
                cute.copy(gamma_atom, tGg[None, step], tGr[None, step])

        # Round to the activation dtype first: h and rstd describe x as written.
        x = tEr.load().to(self.out_dtype)
        xf = x.to(Float32)
        tXr = cute.make_rmem_tensor_like(tXg)
        tHr = cute.make_rmem_tensor_like(tHg)
        tXr.store(x)
        tHr.store((xf * tGr.load().to(Float32)).to(self.out_dtype))
        for step in cutlass.range_constexpr(self.steps):
            if tCol[0, step] < self.dim:
                cute.copy(out_atom, tXr[None, step], tXg[None, step])
                cute.copy(out_atom, tHr[None, step], tHg[None, step])

        sum_sq = row_reduce(xf * xf, cute.ReductionOp.ADD, self.num_threads, reduction_buffer)
        if tidx == 0:
            mRstd[row] = cute.math.rsqrt(sum_sq / self.dim + eps)


@jit_cache
def compile_entry(tok_dtype: type, emb_dtype: type, out_dtype: type, gamma_dtype: type, dim: int):
    kernel = EntryKernel(emb_dtype, out_dtype, gamma_dtype, dim)
    rows, vocab = cute.sym_int(), cute.sym_int()
    return cute.compile(
        kernel,
        make_fake_tensor(tok_dtype, (rows,)),
        make_fake_tensor(emb_dtype, (vocab, dim), divisibility=kernel.vec),
        make_fake_tensor(gamma_dtype, (dim,), divisibility=kernel.vec),
        make_fake_tensor(out_dtype, (rows, dim), divisibility=kernel.vec),
        make_fake_tensor(out_dtype, (rows, dim), divisibility=kernel.vec),
        make_fake_tensor(Float32, (rows,)),
        Float32(0),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _entry_outputs(tokens: Tensor, embedding: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    m, dim, device = tokens.shape[0], embedding.shape[1], embedding.device
    x = _empty(m, dim, dtype=dtype, device=device)
    h = _empty(m, dim, dtype=dtype, device=device)
    return x, h, _empty(m, dtype=torch.float32, device=device)


def _entry_fake(tokens: Tensor, embedding: Tensor, gamma: Tensor, eps: float, dtype: torch.dtype):
    return _entry_outputs(tokens, embedding, dtype)


@stage_op("cute_entry", _entry_fake)
def _entry(
    tokens: Tensor, embedding: Tensor, gamma: Tensor, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    x, h, rstd = _entry_outputs(tokens, embedding, dtype)
    # The kernel loads 16-byte vectors; a view that starts off that alignment (a parameter inside
    # a flat buffer, say) is copied first.
    embedding, gamma = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (embedding, gamma))
    compiled = compile_entry(
        torch2cute_dtype_map[tokens.dtype],
        torch2cute_dtype_map[embedding.dtype],
        torch2cute_dtype_map[dtype],
        torch2cute_dtype_map[gamma.dtype],
        embedding.shape[1],
    )
    compiled(tokens, embedding, gamma, x, h, rstd, eps)
    return x, h, rstd


def entry(
    tokens: Tensor, embedding: Tensor, gamma: Tensor, *, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """x = embedding[tokens] in `dtype`, h = x ⊙ γ and rstd (fp32) of x as written."""
    if not (embedding.is_contiguous() and gamma.is_contiguous()):
        raise ValueError("cute entry: the embedding table and gamma must be contiguous")
    return _entry(tokens.contiguous(), embedding, gamma, eps, dtype)


# ---- backward ------------------------------------------------------------------------------------


class EntryBwdKernel:
    """grad[tok[m], :] += dx[m, :] in fp32 for one row m per CTA.

    The dx row is loaded in `vec`-element (16-byte) vectors as in the forward; each element then
    goes to the table with one fp32 atomic add (its unused old value lets ptxas emit a RED).
    """

    def __init__(self, dx_dtype: type, dim: int) -> None:
        self.dx_dtype, self.dim = dx_dtype, dim
        self.vec = math.gcd(dim, 128 // dx_dtype.width)
        vectors = dim // self.vec
        self.num_threads = min(_MAX_THREADS, 32 * math.ceil(vectors / 32))
        self.steps = math.ceil(vectors / self.num_threads)
        self.tile_n = self.steps * self.num_threads * self.vec

    @cute.jit
    def __call__(self, mTok: cute.Tensor, mDx: cute.Tensor, mGrad: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mTok, mDx, mGrad).launch(
            grid=[mDx.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mTok: cute.Tensor, mDx: cute.Tensor, mGrad: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tiler = (self.tile_n,)
        gDx = cute.local_tile(mDx[row, None], tiler, (0,))
        gCol = cute.local_tile(cute.make_identity_tensor(self.dim), tiler, (0,))
        part = tiled_copy_1d(self.dx_dtype, self.num_threads, self.vec).get_slice(tidx)
        tDg = part.partition_S(gDx)
        tCol = part.partition_S(gCol)
        tDr = cute.make_rmem_tensor_like(tDg)
        tDr.fill(0)
        atom = get_copy_atom(self.dx_dtype, self.vec)
        for step in cutlass.range_constexpr(self.steps):
            if tCol[0, step] < self.dim:
                cute.copy(atom, tDg[None, step], tDr[None, step])

        grad_row = mGrad[mTok[row], None].iterator
        for step in cutlass.range_constexpr(self.steps):
            if tCol[0, step] < self.dim:
                for i in cutlass.range_constexpr(self.vec):
                    cute.arch.atomic_add(grad_row + tCol[i, step], tDr[i, step].to(Float32))


@jit_cache
def compile_entry_bwd(tok_dtype: type, dx_dtype: type, dim: int):
    kernel = EntryBwdKernel(dx_dtype, dim)
    rows, vocab = cute.sym_int(), cute.sym_int()
    return cute.compile(
        kernel,
        make_fake_tensor(tok_dtype, (rows,)),
        make_fake_tensor(dx_dtype, (rows, dim), divisibility=kernel.vec),
        make_fake_tensor(Float32, (vocab, dim)),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


def _entry_bwd_fake(dx: Tensor, tokens: Tensor, num_embeddings: int):
    return _empty(num_embeddings, dx.shape[1], dtype=dx.dtype, device=dx.device)


@stage_op("cute_entry_bwd", _entry_bwd_fake)
def _entry_bwd(dx: Tensor, tokens: Tensor, num_embeddings: int) -> Tensor:
    # The table starts at zero: rows of tokens absent from the batch get no gradient.
    grad = torch.zeros(num_embeddings, dx.shape[1], dtype=torch.float32, device=dx.device)
    dtypes = torch2cute_dtype_map[tokens.dtype], torch2cute_dtype_map[dx.dtype]
    compile_entry_bwd(*dtypes, dx.shape[1])(tokens, dx, grad)
    return grad.to(dx.dtype)


def entry_bwd(dx: Tensor, tokens: Tensor, *, num_embeddings: int) -> Tensor:
    """dembedding (num_embeddings, d) in dx's dtype: row v = Σ of the dx rows of token v, summed
    in fp32 and rounded once."""
    return _entry_bwd(dx.contiguous(), tokens.contiguous(), num_embeddings)
