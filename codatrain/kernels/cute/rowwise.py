"""Row-wise CuTeDSL kernels of the CODA backward: RoPE backward with the attention norm's ZdZ (and,
for Qwen3, with the QK-norm's backward), and the plain row dot product.

The RoPE backward cannot live in a GEMM epilogue: its output dz is the A operand (a mainloop
input) of the dgrad and wgrad GEMMs that follow. It is one memory-bound pass instead: each CTA
reads a row of dqkv and qkv once, writes dz = dqkv rotated back by −angle, and reduces
zdz = Σ qkv·dqkv, which equals Σ z·dz because RoPE is orthogonal.

Angles come from the same float-float per-column frequency table (in turns) and the same sin/cos
routine as the forward's `rstd_rope_posfreq_epi`, so the backward applies the exact transpose of
the rotation the forward applied. Zero-frequency (v) columns rotate by angle 0, an exact identity.
"""

from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr
from quack.cache import jit_cache
from quack.compile_utils import make_fake_stream, make_fake_tensor
from quack.copy_utils import get_copy_atom, tiled_copy_1d
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.dsl.torch_library_op import cute_op

# The forward epilogue's (sin, cos) of a float-float angle in turns; quack-kernels is pinned.
from quack.reduce import row_reduce, warp_reduce
from torch import Tensor

from codatrain.kernels.cute.common import RowTiling, aligned16, copy_masked
from codatrain.kernels.cute.gemm_stages import qknorm_passthrough, rope_freq
from codatrain.kernels.cute.pins import sincos_turns

_MAX_THREADS = 256
# The QK-norm backward: up to 512 threads, so that a row of the widest QKV (8B: 6144 columns) is
# three 4-column vectors per thread; each CTA takes QKNORM_ROWS rows in turn and keeps the norm
# weight's gradient over them in registers, written once as a partial sum (M / QKNORM_ROWS rows of
# partials, summed after).
_QKNORM_MAX_THREADS = 512
QKNORM_ROWS = 32


class RowDotKernel:
    """zdz[m] = Σ_n a[m, n]·b[m, n] for one row per CTA and, with `rotate`, out = b with each
    adjacent column pair (x1, x2) rotated by −angle: (x1·c + x2·s, x2·c − x1·s), where the angle
    of pair (2j, 2j+1) in row m is pos[m]·(freq[2j] + freq[2j+1]) turns (a float-float split).
    With `bias` (rotate only), zdz[m] −= Σ_n bias[n]·out[m, n] in fp32, before out is rounded:
    a QKV bias is no part of the norm's consumer z (docs/design.md §3).

    The row is tiled in 4-element vectors (two rotation pairs, 16 bytes of the fp32 frequency
    table; `RowTiling`); vectors past `n` are masked off and count as zeros in the sum.
    """

    def __init__(self, dtype: type, n: int, rotate: bool, bias: bool = False) -> None:
        assert rotate or not bias, "the bias term needs the rotated-back gradient"
        self.dtype, self.n, self.rotate, self.bias = dtype, n, rotate, bias
        t = RowTiling.of(n, 4, _MAX_THREADS)
        self.vec, self.num_threads, self.steps, self.tile_n = t.vec, t.num_threads, t.steps, t.tile_n

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mPos: cute.Tensor | None,
        mFreq: cute.Tensor | None,
        mBias: cute.Tensor | None,
        mOut: cute.Tensor | None,
        mDot: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(mA, mB, mPos, mFreq, mBias, mOut, mDot).launch(
            grid=[mA.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mPos: cute.Tensor | None,
        mFreq: cute.Tensor | None,
        mBias: cute.Tensor | None,
        mOut: cute.Tensor | None,
        mDot: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        num_warps = const_expr(self.num_threads // cute.arch.WARP_SIZE)
        # row_reduce's cross-warp buffer: (rows per CTA, (warps per row, cluster size)).
        reduction_buffer = smem.allocate_tensor(
            Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8
        )

        tiler = (self.tile_n,)
        gA = cute.local_tile(mA[row, None], tiler, (0,))
        gB = cute.local_tile(mB[row, None], tiler, (0,))
        gCol = cute.local_tile(cute.make_identity_tensor(self.n), tiler, (0,))
        part = tiled_copy_1d(self.dtype, self.num_threads, self.vec).get_slice(tidx)
        tAg = part.partition_S(gA)
        tBg = part.partition_S(gB)
        tCol = part.partition_S(gCol)
        tAr = cute.make_rmem_tensor_like(tAg)
        tBr = cute.make_rmem_tensor_like(tBg)
        tAr.fill(0)
        tBr.fill(0)
        atom = get_copy_atom(self.dtype, self.vec)
        copy_masked(atom, tAg, tAr, tCol, self.n, self.steps)
        copy_masked(atom, tBg, tBr, tCol, self.n, self.steps)

        if const_expr(self.rotate):
            # Same thread partition in fp32: thread t gets the frequencies of its own columns.
            part_freq = tiled_copy_1d(Float32, self.num_threads, self.vec).get_slice(tidx)
            tFg = part_freq.partition_S(cute.local_tile(mFreq, tiler, (0,)))
            tFr = cute.make_rmem_tensor_like(tFg)
            tFr.fill(0)
            copy_masked(get_copy_atom(Float32, self.vec), tFg, tFr, tCol, self.n, self.steps)

            pos = mPos[row]
            tRot = cute.make_rmem_tensor_like(tFr)
            for step in cutlass.range_constexpr(self.steps):
                for j in cutlass.range_constexpr(self.vec // 2):
                    fh, fl = tFr[2 * j, step], tFr[2 * j + 1, step]
                    # The angle pos·(fh + fl) as an unevaluated float-float sum (t + lo): the
                    # fma recovers the bits the rounded product t drops.
                    t = pos * fh
                    lo = cute.math.fma(pos, fl, cute.math.fma(pos, fh, -t))
                    s, c = sincos_turns(t, lo)
                    x1 = tBr[2 * j, step].to(Float32)
                    x2 = tBr[2 * j + 1, step].to(Float32)
                    tRot[2 * j, step] = x1 * c + x2 * s
                    tRot[2 * j + 1, step] = x2 * c - x1 * s
            gOut = cute.local_tile(mOut[row, None], tiler, (0,))
            tOg = part.partition_D(gOut)
            tOr = cute.make_rmem_tensor_like(tOg)
            tOr.store(tRot.load().to(self.dtype))
            copy_masked(atom, tOr, tOg, tCol, self.n, self.steps)

        terms = tAr.load().to(Float32) * tBr.load().to(Float32)
        if const_expr(self.bias):
            tBiasg = part.partition_S(cute.local_tile(mBias, tiler, (0,)))
            tBiasr = cute.make_rmem_tensor_like(tBiasg)
            tBiasr.fill(0)
            copy_masked(atom, tBiasg, tBiasr, tCol, self.n, self.steps)
            terms = terms - tBiasr.load().to(Float32) * tRot.load()
        dot = row_reduce(terms, cute.ReductionOp.ADD, self.num_threads, reduction_buffer)
        if tidx == 0:
            mDot[row] = dot


@jit_cache
def compile_row_dot(dtype: type, n: int, rotate: bool, bias: bool = False):
    kernel = RowDotKernel(dtype, n, rotate, bias)
    rows = cute.sym_int()
    row_major = (rows, n)
    return cute.compile(
        kernel,
        make_fake_tensor(dtype, row_major, divisibility=kernel.vec),
        make_fake_tensor(dtype, row_major, divisibility=kernel.vec),
        make_fake_tensor(Float32, (rows,)) if rotate else None,
        make_fake_tensor(Float32, (n,), divisibility=kernel.vec) if rotate else None,
        make_fake_tensor(dtype, (n,), divisibility=kernel.vec) if bias else None,
        make_fake_tensor(dtype, row_major, divisibility=kernel.vec) if rotate else None,
        make_fake_tensor(Float32, (rows,)),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


@cute_op("codatrain::cute_rope_bwd", mutates_args=("dz", "zdz"), device_types="cuda")
def rope_bwd(
    dqkv: Tensor, qkv: Tensor, positions: Tensor, bias: Tensor | None, dz: Tensor, zdz: Tensor, head_dim: int,
    rope_heads: int, rope_theta: float, rope_type: str, rope_factor: float, rope_low_freq_factor: float,
    rope_high_freq_factor: float, rope_original_max_positions: int,
) -> None:
    """dz = dqkv rotated back by −angle on the first rope_heads heads, zdz (M,) fp32 = Σ qkv·dqkv
    [− Σ bias·dz]; dqkv and qkv contiguous; the rope_* arguments as in `gemm_stages.gemm_rstd_rope`."""
    n = dqkv.shape[1]
    compiled = compile_row_dot(torch2cute_dtype_map[dqkv.dtype], n, True, bias is not None)
    freq = rope_freq(head_dim, rope_heads, n, dqkv.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    # Positions are exact in fp32 up to 2^24, as in the forward epilogue.
    bias = None if bias is None else aligned16(bias)
    compiled(qkv, dqkv, positions.to(torch.float32), freq, bias, dz, zdz)


@cute_op("codatrain::cute_row_dot", mutates_args=("zdz",), device_types="cuda")
def row_dot(z: Tensor, dz: Tensor, zdz: Tensor) -> None:
    """zdz (M,) fp32 = Σ_n z·dz; z and dz contiguous."""
    compile_row_dot(torch2cute_dtype_map[z.dtype], z.shape[1], False)(z, dz, None, None, None, None, zdz)


class QkNormRopeBwdKernel:
    """The backward of F4's QK-norm + RoPE epilogue (`gemm_stages.gemm_rstd_qknorm_rope`), row by row.

    Per row: dn = dqkv rotated back by −angle (as `RowDotKernel`; v columns have frequency 0, an
    exact identity). z, every column's pre-norm value, is read from the forward's two planes as it
    wrote them (mZe the even, mZo the odd column of each pair; the v columns' z is their qkv).
    Each q and k head (head_dim columns) has
    r = (mean z² + eps)^-1/2, x̂ = z·r and dz = r·(dn⊙γ − x̂·mean(x̂·dn⊙γ)); each v column dz = dn
    (γ 0 there, passthrough 1: the head terms vanish). zdz[m] = Σ_n (z − bias)·dz over all
    columns. The norm weight's gradient Σ_m dn·x̂ per column is
    summed over the CTA's rows in registers and written to row `block` of mDgamma.

    The row is tiled in 4-column vectors as `RowDotKernel` (`RowTiling`), each z plane in the
    2-column vectors of the same pairs; the head_dim / 4 lanes of a head are consecutive lanes of
    one warp (head_dim divides 128), so its sums are warp shuffles within that lane group.
    """

    def __init__(self, dtype: type, n: int, head_dim: int, bias: bool) -> None:
        t = RowTiling.of(n, 4, _QKNORM_MAX_THREADS)
        assert t.vec == 4 and 128 % head_dim == 0 and n % head_dim == 0, "heads of whole lane groups"
        self.dtype, self.n, self.head_dim, self.bias = dtype, n, head_dim, bias
        self.vec, self.num_threads, self.steps, self.tile_n = t.vec, t.num_threads, t.steps, t.tile_n
        self.head_lanes = head_dim // t.vec

    @cute.jit
    def __call__(
        self,
        mDqkv: cute.Tensor,
        mZe: cute.Tensor,
        mZo: cute.Tensor,
        mPos: cute.Tensor,
        mFreq: cute.Tensor,
        mGamma: cute.Tensor,
        mPass: cute.Tensor,
        mBias: cute.Tensor | None,
        mDz: cute.Tensor,
        mZdz: cute.Tensor,
        mDgamma: cute.Tensor,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(mDqkv, mZe, mZo, mPos, mFreq, mGamma, mPass, mBias, mDz, mZdz, mDgamma, eps).launch(
            grid=[mDgamma.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mDqkv: cute.Tensor,
        mZe: cute.Tensor,
        mZo: cute.Tensor,
        mPos: cute.Tensor,
        mFreq: cute.Tensor,
        mGamma: cute.Tensor,
        mPass: cute.Tensor,
        mBias: cute.Tensor | None,
        mDz: cute.Tensor,
        mZdz: cute.Tensor,
        mDgamma: cute.Tensor,
        eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        num_warps = const_expr(self.num_threads // cute.arch.WARP_SIZE)
        reduction_buffer = smem.allocate_tensor(
            Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8
        )
        tiler = (self.tile_n,)
        part = tiled_copy_1d(self.dtype, self.num_threads, self.vec).get_slice(tidx)
        part_f32 = tiled_copy_1d(Float32, self.num_threads, self.vec).get_slice(tidx)
        atom = get_copy_atom(self.dtype, self.vec)
        atom_f32 = get_copy_atom(Float32, self.vec)
        tCol = part.partition_S(cute.local_tile(cute.make_identity_tensor(self.n), tiler, (0,)))
        # The z planes: pair p of vector v (columns 4v + 2p, 4v + 2p + 1) is element 2v + p of each.
        half = const_expr(self.n // 2)
        tiler_half = (self.tile_n // 2,)
        part_half = tiled_copy_1d(self.dtype, self.num_threads, self.vec // 2).get_slice(tidx)
        atom_half = get_copy_atom(self.dtype, self.vec // 2)
        tColHalf = part_half.partition_S(cute.local_tile(cute.make_identity_tensor(half), tiler_half, (0,)))

        # The row-invariant columns: frequencies, norm weights, passthrough, bias.
        def load_f32(mVec: cute.Tensor) -> cute.Tensor:
            tg = part_f32.partition_S(cute.local_tile(mVec, tiler, (0,)))
            tr = cute.make_rmem_tensor_like(tg)
            tr.fill(0)
            copy_masked(atom_f32, tg, tr, tCol, self.n, self.steps)
            return tr

        tFr, tGr, tPr = load_f32(mFreq), load_f32(mGamma), load_f32(mPass)
        tBiasr = None
        if const_expr(self.bias):
            tBiasg = part.partition_S(cute.local_tile(mBias, tiler, (0,)))
            tBiasr = cute.make_rmem_tensor_like(tBiasg)
            tBiasr.fill(0)
            copy_masked(atom, tBiasg, tBiasr, tCol, self.n, self.steps)
        tAcc = cute.make_rmem_tensor_like(tFr)  # Σ over this CTA's rows of dn·x̂
        tAcc.fill(0)
        tDn = cute.make_rmem_tensor_like(tFr)
        tZf = cute.make_rmem_tensor_like(tFr)
        tDzf = cute.make_rmem_tensor_like(tFr)
        tTerms = cute.make_rmem_tensor_like(tFr)

        rows = mDqkv.shape[0]
        inv_head_dim = const_expr(1.0 / self.head_dim)
        for i in cutlass.range(QKNORM_ROWS, unroll=1):
            row = block * QKNORM_ROWS + i
            if row < rows:
                gD = cute.local_tile(mDqkv[row, None], tiler, (0,))
                tDg = part.partition_S(gD)
                tDr = cute.make_rmem_tensor_like(tDg)
                tDr.fill(0)
                copy_masked(atom, tDg, tDr, tCol, self.n, self.steps)
                tZeg = part_half.partition_S(cute.local_tile(mZe[row, None], tiler_half, (0,)))
                tZog = part_half.partition_S(cute.local_tile(mZo[row, None], tiler_half, (0,)))
                tZer = cute.make_rmem_tensor_like(tZeg)
                tZor = cute.make_rmem_tensor_like(tZog)
                tZer.fill(0)
                tZor.fill(0)
                copy_masked(atom_half, tZeg, tZer, tColHalf, half, self.steps)
                copy_masked(atom_half, tZog, tZor, tColHalf, half, self.steps)
                for step in cutlass.range_constexpr(self.steps):
                    for j in cutlass.range_constexpr(self.vec // 2):
                        tZf[2 * j, step] = tZer[j, step].to(Float32)
                        tZf[2 * j + 1, step] = tZor[j, step].to(Float32)

                pos = mPos[row]
                for step in cutlass.range_constexpr(self.steps):
                    for j in cutlass.range_constexpr(self.vec // 2):
                        fh, fl = tFr[2 * j, step], tFr[2 * j + 1, step]
                        t = pos * fh
                        lo = cute.math.fma(pos, fl, cute.math.fma(pos, fh, -t))
                        s, c = sincos_turns(t, lo)
                        x1 = tDr[2 * j, step].to(Float32)
                        x2 = tDr[2 * j + 1, step].to(Float32)
                        tDn[2 * j, step] = x1 * c + x2 * s
                        tDn[2 * j + 1, step] = x2 * c - x1 * s
                    # The head's sums over its lane group: Σ z², then Σ x̂·dn·γ.
                    sq = Float32(0.0)
                    for k in cutlass.range_constexpr(self.vec):
                        sq += tZf[k, step] * tZf[k, step]
                    sq = warp_reduce(sq, operator.add, threads_in_group=self.head_lanes, dtype=Float32)
                    r = cute.math.rsqrt(sq * inv_head_dim + eps)
                    dot = Float32(0.0)
                    for k in cutlass.range_constexpr(self.vec):
                        dot += tZf[k, step] * tDn[k, step] * tGr[k, step]
                    dot = warp_reduce(dot, operator.add, threads_in_group=self.head_lanes, dtype=Float32)
                    mean = dot * r * inv_head_dim  # mean x̂·dn·γ
                    for k in cutlass.range_constexpr(self.vec):
                        x_hat = tZf[k, step] * r
                        dn = tDn[k, step]
                        dz = r * (dn * tGr[k, step] - x_hat * mean) + dn * tPr[k, step]
                        tDzf[k, step] = dz
                        tAcc[k, step] += dn * x_hat
                        z = tZf[k, step]
                        if const_expr(self.bias):
                            z = z - tBiasr[k, step].to(Float32)
                        tTerms[k, step] = z * dz
                tDzg = part.partition_D(cute.local_tile(mDz[row, None], tiler, (0,)))
                tDzr = cute.make_rmem_tensor_like(tDzg)
                tDzr.store(tDzf.load().to(self.dtype))
                copy_masked(atom, tDzr, tDzg, tCol, self.n, self.steps)
                zdz = row_reduce(tTerms.load(), cute.ReductionOp.ADD, self.num_threads, reduction_buffer)
                if tidx == 0:
                    mZdz[row] = zdz
                # The next row's reduction reuses the buffer.
                cute.arch.barrier()
        tAccg = part_f32.partition_D(cute.local_tile(mDgamma[block, None], tiler, (0,)))
        copy_masked(atom_f32, tAcc, tAccg, tCol, self.n, self.steps)


@jit_cache
def compile_qknorm_rope_bwd(dtype: type, n: int, head_dim: int, bias: bool):
    kernel = QkNormRopeBwdKernel(dtype, n, head_dim, bias)
    rows, blocks = cute.sym_int(), cute.sym_int()
    row_major = (rows, n)
    return cute.compile(
        kernel,
        make_fake_tensor(dtype, row_major, divisibility=kernel.vec),
        make_fake_tensor(dtype, (rows, n // 2), divisibility=kernel.vec // 2),
        make_fake_tensor(dtype, (rows, n // 2), divisibility=kernel.vec // 2),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (n,), divisibility=kernel.vec),
        make_fake_tensor(Float32, (n,), divisibility=kernel.vec),
        make_fake_tensor(Float32, (n,), divisibility=kernel.vec),
        make_fake_tensor(dtype, (n,), divisibility=kernel.vec) if bias else None,
        make_fake_tensor(dtype, row_major, divisibility=kernel.vec),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (blocks, n), divisibility=kernel.vec),
        Float32(0),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


def qknorm_blocks(m: int) -> int:
    """CTAs of the QK-norm backward over m rows: rows of its norm-weight gradient partials."""
    return (m + QKNORM_ROWS - 1) // QKNORM_ROWS


@cute_op("codatrain::cute_qknorm_rope_bwd", mutates_args=("dz", "zdz", "dgamma_partials"),
         device_types="cuda")
def qknorm_rope_bwd(
    dqkv: Tensor, z_pairs: Tensor, positions: Tensor, norm_weight: Tensor, bias: Tensor | None,
    dz: Tensor, zdz: Tensor, dgamma_partials: Tensor, head_dim: int, rope_heads: int, eps: float,
    rope_theta: float, rope_type: str, rope_factor: float, rope_low_freq_factor: float,
    rope_high_freq_factor: float, rope_original_max_positions: int,
) -> None:
    """dz, zdz (M,) fp32 and dgamma_partials (qknorm_blocks(M), N) fp32 of the QK-norm + RoPE
    backward (`QkNormRopeBwdKernel`); dqkv contiguous, z_pairs (2, M, N/2) as the forward wrote it
    (`gemm_stages.gemm_rstd_qknorm_rope`); norm_weight (N,) fp32 as the forward's; the rope_*
    arguments as in `gemm_stages.gemm_rstd_rope`."""
    n, rope_cols = dqkv.shape[1], rope_heads * head_dim
    compiled = compile_qknorm_rope_bwd(torch2cute_dtype_map[dqkv.dtype], n, head_dim, bias is not None)
    freq = rope_freq(head_dim, rope_heads, n, dqkv.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    bias = None if bias is None else aligned16(bias)
    compiled(dqkv, z_pairs[0], z_pairs[1], positions.to(torch.float32), freq, norm_weight,
             qknorm_passthrough(rope_cols, n, dqkv.device), bias, dz, zdz, dgamma_partials, eps)
