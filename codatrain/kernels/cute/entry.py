"""Model entry and its backward as CuTeDSL kernels.

Forward: one CTA per token row gathers the embedding row of the token and writes it as x (the
table is in the activation dtype: FSDP2's mixed-precision policy casts it), h = x ⊙ γ, and rstd of
x, so the row is read from memory once. A row of a Llama-3-8B embedding is 8 KB in bf16; with 128
threads moving 16 bytes each per step that is four steps, and M rows give M CTAs to fill the GPU.

Backward: one CTA per token row adds its dx row into row `token` of an fp32 gradient table with
atomic reductions (rows of repeated tokens meet in the same table row), then the table is
rounded once to the activation dtype.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from quack.cache import jit_cache
from quack.compile_utils import make_fake_stream, make_fake_tensor
from quack.copy_utils import get_copy_atom, tiled_copy_1d
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.dsl.torch_library_op import cute_op
from quack.reduce import row_reduce
from torch import Tensor

from codatrain.kernels.cute.common import RowTiling, aligned16, copy_masked

_MAX_THREADS = 128


class EntryKernel:
    """x = E[tok], h = x ⊙ γ, rstd = (mean x² + eps)^-1/2 for one row per CTA; E, γ, x and h in one
    activation dtype.

    The row is tiled in 16-byte vectors (`RowTiling`); vectors past `dim` are masked off and count
    as zeros in the sum.
    """

    def __init__(self, dtype: type, dim: int) -> None:
        self.dtype, self.dim = dtype, dim
        t = RowTiling.of(dim, 128 // dtype.width, _MAX_THREADS)
        self.vec, self.num_threads, self.steps, self.tile_n = t.vec, t.num_threads, t.steps, t.tile_n

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

        part = tiled_copy_1d(self.dtype, self.num_threads, self.vec).get_slice(tidx)
        tEg = part.partition_S(gEmb)
        tGg = part.partition_S(gGamma)
        tXg = part.partition_D(gX)
        tHg = part.partition_D(gH)
        tCol = part.partition_S(gCol)

        tEr = cute.make_rmem_tensor_like(tEg)
        tGr = cute.make_rmem_tensor_like(tGg)
        tEr.fill(0)
        tGr.fill(0)
        atom = get_copy_atom(self.dtype, self.vec)
        copy_masked(atom, tEg, tEr, tCol, self.dim, self.steps)
        copy_masked(atom, tGg, tGr, tCol, self.dim, self.steps)

        # x is the row as read; h and rstd are computed from it in fp32.
        x = tEr.load()
        xf = x.to(Float32)
        tXr = cute.make_rmem_tensor_like(tXg)
        tHr = cute.make_rmem_tensor_like(tHg)
        tXr.store(x)
        tHr.store((xf * tGr.load().to(Float32)).to(self.dtype))
        copy_masked(atom, tXr, tXg, tCol, self.dim, self.steps)
        copy_masked(atom, tHr, tHg, tCol, self.dim, self.steps)

        sum_sq = row_reduce(xf * xf, cute.ReductionOp.ADD, self.num_threads, reduction_buffer)
        if tidx == 0:
            mRstd[row] = cute.math.rsqrt(sum_sq / self.dim + eps)


@jit_cache
def compile_entry(tok_dtype: type, dtype: type, dim: int):
    kernel = EntryKernel(dtype, dim)
    rows, vocab = cute.sym_int(), cute.sym_int()
    return cute.compile(
        kernel,
        make_fake_tensor(tok_dtype, (rows,)),
        make_fake_tensor(dtype, (vocab, dim), divisibility=kernel.vec),
        make_fake_tensor(dtype, (dim,), divisibility=kernel.vec),
        make_fake_tensor(dtype, (rows, dim), divisibility=kernel.vec),
        make_fake_tensor(dtype, (rows, dim), divisibility=kernel.vec),
        make_fake_tensor(Float32, (rows,)),
        Float32(0),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


@cute_op("codatrain::cute_entry", mutates_args=("x", "h", "rstd"), device_types="cuda")
def entry(
    tokens: Tensor, embedding: Tensor, gamma: Tensor, x: Tensor, h: Tensor, rstd: Tensor, eps: float
) -> None:
    """x = embedding[tokens], h = x ⊙ γ and rstd (fp32) of x; embedding, gamma, x and h in one
    dtype. tokens contiguous; embedding (V, d) and gamma contiguous."""
    embedding, gamma = aligned16(embedding), aligned16(gamma)
    compiled = compile_entry(torch2cute_dtype_map[tokens.dtype], torch2cute_dtype_map[embedding.dtype],
                             embedding.shape[1])
    compiled(tokens, embedding, gamma, x, h, rstd, eps)


# ---- backward ------------------------------------------------------------------------------------


class EntryBwdKernel:
    """grad[tok[m], :] += dx[m, :] in fp32 for one row m per CTA.

    The dx row is loaded in 16-byte vectors as in the forward; each element then goes to the
    table with one fp32 atomic add (its unused old value lets ptxas emit a RED).
    """

    def __init__(self, dx_dtype: type, dim: int) -> None:
        self.dx_dtype, self.dim = dx_dtype, dim
        t = RowTiling.of(dim, 128 // dx_dtype.width, _MAX_THREADS)
        self.vec, self.num_threads, self.steps, self.tile_n = t.vec, t.num_threads, t.steps, t.tile_n

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
        copy_masked(get_copy_atom(self.dx_dtype, self.vec), tDg, tDr, tCol, self.dim, self.steps)

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


@cute_op("codatrain::cute_entry_bwd", mutates_args=("grad",), device_types="cuda")
def entry_bwd(dx: Tensor, tokens: Tensor, grad: Tensor) -> None:
    """grad (V, d) fp32 += the dx rows of each token, in its row; dx and tokens contiguous."""
    dtypes = torch2cute_dtype_map[tokens.dtype], torch2cute_dtype_map[dx.dtype]
    compile_entry_bwd(*dtypes, dx.shape[1])(tokens, dx, grad)
