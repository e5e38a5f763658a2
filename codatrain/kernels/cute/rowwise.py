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
from codatrain.kernels.cute.gemm_stages import rope_freq
from codatrain.kernels.cute.pins import sincos_turns

_MAX_THREADS = 256
# The QK-norm backward (`QkNormRopeBwdKernel`): CTAs of QKNORM_ROWS rows, _QKNORM_WARPS warps each
# taking its own rows in 128-column chunks; a CTA writes one row of norm-weight gradient partials,
# QKNORM_PARTIAL_COLS wide (the q heads' then the k heads' sums by position in a chunk).
QKNORM_ROWS = 32
_QKNORM_WARPS = 8
_QKNORM_CHUNK = 128
_QKNORM_GROUP = 4  # chunks whose loads a warp issues together
QKNORM_PARTIAL_COLS = 2 * _QKNORM_CHUNK


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
    """The backward of F4's QK-norm + RoPE epilogue (`gemm_stages.gemm_rstd_qknorm_rope`).

    Each warp takes QKNORM_ROWS / _QKNORM_WARPS rows of its CTA in turn, a row in chunks of 128
    columns (whole heads: head_dim divides 128), 4 columns a lane, so that a head's sums and the
    row's zdz are shuffles within the warp: no row waits on a barrier. A warp loads _QKNORM_GROUP
    chunks at once, and the SM's many warps (few registers each) keep those loads in flight.

    Per chunk: dn = dqkv rotated back by −angle (as `RowDotKernel`; v columns have frequency 0, an
    exact identity); z from the forward's two planes as it wrote them
    (mZe the even, mZo the odd column of each pair, v columns included); each q and k head has
    r = (mean z² + eps)^-1/2, x̂ = z·r and dz = r·(dn⊙γ − x̂·mean(x̂·dn⊙γ)), each v column dz = dn
    (γ 0 there, passthrough 1: the head terms vanish); zdz[m] = Σ_n (z − bias)·dz over all columns.

    The norm weights' gradients Σ_m dn·x̂: a lane's columns are the same positions of a head in
    every chunk, so it sums them for the q heads and for the k heads in registers; the CTA adds
    its warps' sums into row `block` of mDgamma, (2 · 128): q then k, by position in the chunk
    (the caller folds the 128 / head_dim heads of a chunk).
    """

    def __init__(self, dtype: type, n: int, head_dim: int, q_cols: int, rope_cols: int, bias: bool) -> None:
        assert n % 4 == 0 and _QKNORM_CHUNK % head_dim == 0 and head_dim % 4 == 0, "heads of lane groups"
        assert n % head_dim == 0 and q_cols % head_dim == 0 and rope_cols % head_dim == 0
        self.dtype, self.n, self.head_dim, self.bias = dtype, n, head_dim, bias
        self.q_cols, self.rope_cols = q_cols, rope_cols
        group_cols = _QKNORM_CHUNK * _QKNORM_GROUP
        self.groups = (n + group_cols - 1) // group_cols
        self.num_threads = _QKNORM_WARPS * cute.arch.WARP_SIZE

    @cute.jit
    def __call__(
        self,
        mDqkv: cute.Tensor,
        mZe: cute.Tensor,
        mZo: cute.Tensor,
        mPos: cute.Tensor,
        mFreq: cute.Tensor,
        mQw: cute.Tensor,
        mKw: cute.Tensor,
        mBias: cute.Tensor | None,
        mDz: cute.Tensor,
        mZdz: cute.Tensor,
        mDgamma: cute.Tensor,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(mDqkv, mZe, mZo, mPos, mFreq, mQw, mKw, mBias, mDz, mZdz, mDgamma, eps).launch(
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
        mQw: cute.Tensor,
        mKw: cute.Tensor,
        mBias: cute.Tensor | None,
        mDz: cute.Tensor,
        mZdz: cute.Tensor,
        mDgamma: cute.Tensor,
        eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        warp, lane = tidx // cute.arch.WARP_SIZE, tidx % cute.arch.WARP_SIZE
        chunk = const_expr(_QKNORM_CHUNK)
        masked = const_expr(self.n % (_QKNORM_CHUNK * _QKNORM_GROUP) != 0)  # columns past n in the last group
        part = tiled_copy_1d(self.dtype, cute.arch.WARP_SIZE, 4).get_slice(lane)
        part_half = tiled_copy_1d(self.dtype, cute.arch.WARP_SIZE, 2).get_slice(lane)
        part_f32 = tiled_copy_1d(Float32, cute.arch.WARP_SIZE, 4).get_slice(lane)
        atom, atom_f32 = get_copy_atom(self.dtype, 4), get_copy_atom(Float32, 4)
        atom_half = get_copy_atom(self.dtype, 2)

        def chunk_of(mRow: cute.Tensor, width: int, c) -> cute.Tensor:
            return cute.local_tile(mRow, (width,), (c,))

        # This lane's head positions (the same in every chunk) and their norm weights.
        tCol0 = part.partition_S(chunk_of(cute.make_identity_tensor(self.n), chunk, 0))
        tQw = cute.make_rmem_tensor_like(part_f32.partition_S(chunk_of(mFreq, chunk, 0)))
        tKw = cute.make_rmem_tensor_like(tQw)
        position = tCol0[0, 0] % self.head_dim
        for k in cutlass.range_constexpr(4):
            tQw[k, 0] = mQw[position + k]
            tKw[k, 0] = mKw[position + k]
        tAccQ = cute.make_rmem_tensor_like(tQw)  # Σ over this warp's rows of dn·x̂, q heads
        tAccK = cute.make_rmem_tensor_like(tQw)  # and k heads
        tAccQ.fill(0)
        tAccK.fill(0)
        tTerms = cute.make_rmem_tensor_like(tQw)
        tDn = cute.make_rmem_tensor_like(tQw)
        tZf = cute.make_rmem_tensor_like(tQw)
        tDzf = cute.make_rmem_tensor_like(tQw)

        rows = mDqkv.shape[0]
        inv_head_dim = const_expr(1.0 / self.head_dim)
        head_lanes = const_expr(self.head_dim // 4)
        rows_per_warp = const_expr(QKNORM_ROWS // _QKNORM_WARPS)
        for i in cutlass.range(rows_per_warp, unroll=1):
            row = block * QKNORM_ROWS + warp * rows_per_warp + i
            if row < rows:
                pos = mPos[row]
                tTerms.fill(0)
                for group in cutlass.range(self.groups, unroll=1):
                    # Every load of the group's chunks first, so that they are in flight together
                    # (a chunk's loads cannot pass the stores of the chunk before it).
                    loaded = []
                    for u in cutlass.range_constexpr(_QKNORM_GROUP):
                        c = group * _QKNORM_GROUP + u
                        tCol = part.partition_S(chunk_of(cute.make_identity_tensor(self.n), chunk, c))
                        tColHalf = part_half.partition_S(
                            chunk_of(cute.make_identity_tensor(self.n // 2), chunk // 2, c))
                        tDg = part.partition_S(chunk_of(mDqkv[row, None], chunk, c))
                        tZeg = part_half.partition_S(chunk_of(mZe[row, None], chunk // 2, c))
                        tZog = part_half.partition_S(chunk_of(mZo[row, None], chunk // 2, c))
                        tFg = part_f32.partition_S(chunk_of(mFreq, chunk, c))
                        tDr = cute.make_rmem_tensor_like(tDg)
                        tZer = cute.make_rmem_tensor_like(tZeg)
                        tZor = cute.make_rmem_tensor_like(tZog)
                        tFr = cute.make_rmem_tensor_like(tFg)
                        tBiasr = None
                        if const_expr(self.bias):
                            tBiasg = part.partition_S(chunk_of(mBias, chunk, c))
                            tBiasr = cute.make_rmem_tensor_like(tBiasg)
                        if const_expr(masked):
                            for buffer in (tDr, tZer, tZor, tFr):
                                buffer.fill(0)
                            copy_masked(atom, tDg, tDr, tCol, self.n, 1)
                            copy_masked(atom_half, tZeg, tZer, tColHalf, self.n // 2, 1)
                            copy_masked(atom_half, tZog, tZor, tColHalf, self.n // 2, 1)
                            copy_masked(atom_f32, tFg, tFr, tCol, self.n, 1)
                            if const_expr(self.bias):
                                tBiasr.fill(0)
                                copy_masked(atom, tBiasg, tBiasr, tCol, self.n, 1)
                        else:
                            cute.copy(atom, tDg, tDr)
                            cute.copy(atom_half, tZeg, tZer)
                            cute.copy(atom_half, tZog, tZor)
                            cute.copy(atom_f32, tFg, tFr)
                            if const_expr(self.bias):
                                cute.copy(atom, tBiasg, tBiasr)
                        loaded.append((c, tCol, tDr, tZer, tZor, tFr, tBiasr))
                    for c, tCol, tDr, tZer, tZor, tFr, tBiasr in loaded:
                        # Which heads these columns are in: q, k (normed), or v (passed through).
                        col = tCol[0, 0]
                        w_q, w_k, passthrough = Float32(0.0), Float32(0.0), Float32(0.0)
                        if col < self.q_cols:
                            w_q = Float32(1.0)
                        elif col < self.rope_cols:
                            w_k = Float32(1.0)
                        else:
                            passthrough = Float32(1.0)
                        for j in cutlass.range_constexpr(2):
                            fh, fl = tFr[2 * j, 0], tFr[2 * j + 1, 0]
                            t = pos * fh
                            lo = cute.math.fma(pos, fl, cute.math.fma(pos, fh, -t))
                            s, cos = sincos_turns(t, lo)
                            x1 = tDr[2 * j, 0].to(Float32)
                            x2 = tDr[2 * j + 1, 0].to(Float32)
                            tDn[2 * j, 0] = x1 * cos + x2 * s
                            tDn[2 * j + 1, 0] = x2 * cos - x1 * s
                            tZf[2 * j, 0] = tZer[j, 0].to(Float32)
                            tZf[2 * j + 1, 0] = tZor[j, 0].to(Float32)
                        # The head's sums over its lane group: Σ z², then Σ x̂·dn·γ.
                        sq = Float32(0.0)
                        dot = Float32(0.0)
                        for k in cutlass.range_constexpr(4):
                            gamma = w_q * tQw[k, 0] + w_k * tKw[k, 0]
                            sq += tZf[k, 0] * tZf[k, 0]
                            dot += tZf[k, 0] * tDn[k, 0] * gamma
                        sq = warp_reduce(sq, operator.add, threads_in_group=head_lanes, dtype=Float32)
                        dot = warp_reduce(dot, operator.add, threads_in_group=head_lanes, dtype=Float32)
                        r = cute.math.rsqrt(sq * inv_head_dim + eps)
                        mean = dot * r * inv_head_dim  # mean x̂·dn·γ
                        for k in cutlass.range_constexpr(4):
                            gamma = w_q * tQw[k, 0] + w_k * tKw[k, 0]
                            x_hat = tZf[k, 0] * r
                            dn = tDn[k, 0]
                            dz = r * (dn * gamma - x_hat * mean) + dn * passthrough
                            tDzf[k, 0] = dz
                            tAccQ[k, 0] += w_q * (dn * x_hat)
                            tAccK[k, 0] += w_k * (dn * x_hat)
                            z = tZf[k, 0]
                            if const_expr(self.bias):
                                z = z - tBiasr[k, 0].to(Float32)
                            tTerms[k, 0] += z * dz
                        tDzg = part.partition_D(chunk_of(mDz[row, None], chunk, c))
                        tDzr = cute.make_rmem_tensor_like(tDzg)
                        tDzr.store(tDzf.load().to(self.dtype))
                        if const_expr(masked):
                            copy_masked(atom, tDzr, tDzg, tCol, self.n, 1)
                        else:
                            cute.copy(atom, tDzr, tDzg)
                zdz = Float32(0.0)
                for k in cutlass.range_constexpr(4):
                    zdz += tTerms[k, 0]
                zdz = warp_reduce(zdz, operator.add, dtype=Float32)
                if lane == 0:
                    mZdz[row] = zdz
        # The CTA's norm-weight gradient partial: its warps' sums added in shared memory.
        smem = cutlass.utils.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((_QKNORM_WARPS, 2 * chunk)), byte_alignment=16)
        for k in cutlass.range_constexpr(4):
            sums[warp, lane * 4 + k] = tAccQ[k, 0]
            sums[warp, chunk + lane * 4 + k] = tAccK[k, 0]
        cute.arch.barrier()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(_QKNORM_WARPS):
            total += sums[w, tidx]
        mDgamma[block, tidx] = total


@jit_cache
def compile_qknorm_rope_bwd(dtype: type, n: int, head_dim: int, q_cols: int, rope_cols: int, bias: bool):
    kernel = QkNormRopeBwdKernel(dtype, n, head_dim, q_cols, rope_cols, bias)
    rows, blocks = cute.sym_int(), cute.sym_int()
    return cute.compile(
        kernel,
        make_fake_tensor(dtype, (rows, n), divisibility=4),
        make_fake_tensor(dtype, (rows, n // 2), divisibility=2),
        make_fake_tensor(dtype, (rows, n // 2), divisibility=2),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (n,), divisibility=4),
        make_fake_tensor(Float32, (head_dim,), divisibility=4),
        make_fake_tensor(Float32, (head_dim,), divisibility=4),
        make_fake_tensor(dtype, (n,), divisibility=4) if bias else None,
        make_fake_tensor(dtype, (rows, n), divisibility=4),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (blocks, QKNORM_PARTIAL_COLS), divisibility=4),
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
    dqkv: Tensor, z_pairs: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor,
    bias: Tensor | None, dz: Tensor, zdz: Tensor, dgamma_partials: Tensor, head_dim: int, q_heads: int,
    rope_heads: int, eps: float, rope_theta: float, rope_type: str, rope_factor: float,
    rope_low_freq_factor: float, rope_high_freq_factor: float, rope_original_max_positions: int,
) -> None:
    """dz, zdz (M,) fp32 and dgamma_partials (qknorm_blocks(M), QKNORM_PARTIAL_COLS) fp32 of the
    QK-norm + RoPE backward (`QkNormRopeBwdKernel`; `qknorm_weight_grads` sums the partials);
    dqkv contiguous, z_pairs (2, M, N/2) as the forward wrote it (`gemm_stages.gemm_rstd_qknorm_rope`);
    q_weight and k_weight (head_dim,) fp32; the rope_* arguments as in `gemm_stages.gemm_rstd_rope`."""
    n = dqkv.shape[1]
    compiled = compile_qknorm_rope_bwd(torch2cute_dtype_map[dqkv.dtype], n, head_dim, q_heads * head_dim,
                                       rope_heads * head_dim, bias is not None)
    freq = rope_freq(head_dim, rope_heads, n, dqkv.device, rope_theta, rope_type, rope_factor,
                     rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions)
    bias = None if bias is None else aligned16(bias)
    compiled(dqkv, z_pairs[0], z_pairs[1], positions.to(torch.float32), freq, q_weight, k_weight, bias, dz,
             zdz, dgamma_partials, eps)


def qknorm_weight_grads(dgamma_partials: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """The q and k norm weights' gradients (head_dim,) from `qknorm_rope_bwd`'s partials: summed over
    the CTAs, then over the heads that share a 128-column chunk."""
    sums = dgamma_partials.sum(0).view(2, _QKNORM_CHUNK // head_dim, head_dim).sum(1)
    return sums[0], sums[1]
