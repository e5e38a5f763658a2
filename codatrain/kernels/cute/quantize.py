"""Per-tensor FP8 quantization of an activation that no GEMM epilogue produces (block.precision=fp8):
the attention output (FlashAttention writes it) and SwiGLU's y (on sm_90 QuACK stores the gated
half-width output of an `acc_pair` epilogue in 16 bits only).

One memory-bound pass, one row per CTA: out = FP8(x·scale) with the scale given (a 0-d fp32 device
tensor: a delayed scale needs no amax first), and row_amax[m] = max_n |x[m, n]|, whose maximum is
the tensor's amax for the delayed-scaling history. The conversion saturates to the format's finite
range (PTX `cvt.rn.satfinite`), as `codatrain.kernels.fp8.quantize` clamps.
"""

from __future__ import annotations

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
from quack.reduce import row_reduce
from torch import Tensor

from codatrain.kernels.cute.common import RowTiling, copy_masked
from codatrain.kernels.fp8 import Fp8Tensor, QuantizeTo, fp8_max, scale_from_amax

_MAX_THREADS = 256


class QuantizeKernel:
    """out[m, :] = FP8(x[m, :]·scale) and row_amax[m] = max |x[m, :]|, one row per CTA, the row
    tiled in 8-element vectors (`RowTiling`)."""

    def __init__(self, dtype: type, out_dtype: type, n: int) -> None:
        self.dtype, self.out_dtype, self.n = dtype, out_dtype, n
        t = RowTiling.of(n, 8, _MAX_THREADS)
        self.vec, self.num_threads, self.steps, self.tile_n = t.vec, t.num_threads, t.steps, t.tile_n

    @cute.jit
    def __call__(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mX, mScale, mOut, mAmax).launch(
            grid=[mX.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        num_warps = const_expr(self.num_threads // cute.arch.WARP_SIZE)
        # One cross-warp buffer per reduction: the second may start while warps still read the first.
        max_buffer, min_buffer = (
            smem.allocate_tensor(Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8)
            for _ in range(2)
        )

        tiler = (self.tile_n,)
        gX = cute.local_tile(mX[row, None], tiler, (0,))
        gOut = cute.local_tile(mOut[row, None], tiler, (0,))
        gCol = cute.local_tile(cute.make_identity_tensor(self.n), tiler, (0,))
        part = tiled_copy_1d(self.dtype, self.num_threads, self.vec).get_slice(tidx)
        part_out = tiled_copy_1d(self.out_dtype, self.num_threads, self.vec).get_slice(tidx)
        tXg = part.partition_S(gX)
        tCol = part.partition_S(gCol)
        tOg = part_out.partition_D(gOut)
        tXr = cute.make_rmem_tensor_like(tXg)
        tXr.fill(0)
        copy_masked(get_copy_atom(self.dtype, self.vec), tXg, tXr, tCol, self.n, self.steps)

        x = tXr.load().to(Float32)
        tOr = cute.make_rmem_tensor_like(tOg)
        tOr.store((x * mScale[0]).to(self.out_dtype))
        copy_masked(get_copy_atom(self.out_dtype, self.vec), tOr, tOg, tCol, self.n, self.steps)

        # max |x| as max(max x, −min x): zero-filled tail vectors are neutral for both.
        high = row_reduce(x, cute.ReductionOp.MAX, self.num_threads, max_buffer, init_val=-Float32.inf)
        low = row_reduce(x, cute.ReductionOp.MIN, self.num_threads, min_buffer, init_val=Float32.inf)
        if tidx == 0:
            mAmax[row] = cute.arch.fmax(high, -low)


@jit_cache
def compile_quantize(dtype: type, out_dtype: type, n: int):
    kernel = QuantizeKernel(dtype, out_dtype, n)
    rows = cute.sym_int()
    return cute.compile(
        kernel,
        make_fake_tensor(dtype, (rows, n), divisibility=kernel.vec),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(out_dtype, (rows, n), divisibility=kernel.vec),
        make_fake_tensor(Float32, (rows,)),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


@cute_op("codatrain::cute_quantize_fp8", mutates_args=("out", "row_amax"), device_types="cuda")
def quantize_fp8(x: Tensor, scale: Tensor, out: Tensor, row_amax: Tensor) -> None:
    """out (M, N) FP8 = x·scale saturated, row_amax (M,) fp32 = max_n |x|; x (M, N) contiguous
    16-bit, scale a 1-element fp32 tensor."""
    compiled = compile_quantize(torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[out.dtype], x.shape[1])
    compiled(x, scale.reshape(1), out, row_amax)


def quantize_fp8_outputs(x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Allocated outputs (out, row_amax) of `quantize_fp8` for x."""
    return (torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))


# ---- quantize into both orientations ---------------------------------------------------------------
# An FP8 GEMM on sm_90 reads both operands contiguous along its contraction: a weight gradient
# (contracting over the tokens) needs token-contiguous copies of its operands, a dgrad the
# transposed weight. This pass writes the row-major FP8 copy and the transposed one from one read.
_TILE_ROWS, _TILE_COLS, _VEC = 32, 64, 8
_TRANSPOSE_THREADS = 256  # (32 rows × 8 vectors) in, (64 columns × 4 vectors) out


class QuantizeTransposeKernel:
    """out = FP8(x·scale) (R, C) [optional] and out_t = its transpose (C, R), both row-major, and
    tile_amax[i, j] = max |x| over the (32 × 64) tile (i, j); one tile per CTA.

    x is read once, 8-element vectors along C, and staged in shared memory (rows padded by one
    vector); the transposed copy is gathered column by column from there and stored in 8-element
    vectors along R, so both global stores are coalesced. R and C must be multiples of 8 (FP8 rows
    are multiples of 16 bytes anyway)."""

    def __init__(self, dtype: type, out_dtype: type, rows_out: bool) -> None:
        self.dtype, self.out_dtype, self.rows_out = dtype, out_dtype, rows_out

    @cute.jit
    def __call__(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor | None, mOutT: cute.Tensor,
                 mAmax: cute.Tensor, stream: cuda.CUstream):
        grid_cols = (mX.shape[1] + _TILE_COLS - 1) // _TILE_COLS
        grid_rows = (mX.shape[0] + _TILE_ROWS - 1) // _TILE_ROWS
        self.kernel(mX, mScale, mOut, mOutT, mAmax).launch(
            grid=[grid_cols, grid_rows, 1], block=[_TRANSPOSE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor | None, mOutT: cute.Tensor,
               mAmax: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tile_col, tile_row, _ = cute.arch.block_idx()
        n_rows, n_cols = mX.shape[0], mX.shape[1]
        row0, col0 = tile_row * _TILE_ROWS, tile_col * _TILE_COLS
        smem = cutlass.utils.SmemAllocator()
        tile = smem.allocate_tensor(
            self.dtype, cute.make_layout((_TILE_ROWS, _TILE_COLS), stride=(_TILE_COLS + _VEC, 1)),
            byte_alignment=16,
        )
        num_warps = const_expr(_TRANSPOSE_THREADS // cute.arch.WARP_SIZE)
        max_buffer = smem.allocate_tensor(Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8)
        scale = mScale[0]
        in_atom = get_copy_atom(self.dtype, _VEC)
        out_atom = get_copy_atom(self.out_dtype, _VEC)

        # Phase 1: thread t reads row t // 8, vector t % 8 of the tile.
        r, v = tidx // (_TILE_COLS // _VEC), tidx % (_TILE_COLS // _VEC)
        row, col = row0 + r, col0 + v * _VEC
        local_max = Float32(0.0)
        if row < n_rows and col < n_cols:
            gX = cute.local_tile(mX[row, None], (_VEC,), (col // _VEC,))
            tXr = cute.make_rmem_tensor_like(gX)
            cute.copy(in_atom, gX, tXr)
            cute.copy(in_atom, tXr, cute.local_tile(tile[r, None], (_VEC,), (v,)))
            x = tXr.load().to(Float32)
            local_max = cute.arch.fmax(x.reduce(cute.ReductionOp.MAX, -Float32.inf, 0),
                                       -x.reduce(cute.ReductionOp.MIN, Float32.inf, 0))
            if const_expr(self.rows_out):
                gOut = cute.local_tile(mOut[row, None], (_VEC,), (col // _VEC,))
                tOr = cute.make_rmem_tensor_like(gOut)
                tOr.store((x * scale).to(self.out_dtype))
                cute.copy(out_atom, tOr, gOut)
        cute.arch.barrier()

        # Phase 2: thread t writes row t // 4 of the transposed tile (column t // 4 of x), vector t % 4.
        c, w = tidx // (_TILE_ROWS // _VEC), tidx % (_TILE_ROWS // _VEC)
        out_row, out_col = col0 + c, row0 + w * _VEC
        if out_row < n_cols and out_col < n_rows:
            gOutT = cute.local_tile(mOutT[out_row, None], (_VEC,), (out_col // _VEC,))
            tTr = cute.make_rmem_tensor_like(cute.local_tile(tile[0, None], (_VEC,), (0,)))
            for i in cutlass.range_constexpr(_VEC):
                tTr[i] = tile[w * _VEC + i, c]
            tTo = cute.make_rmem_tensor_like(gOutT)
            tTo.store((tTr.load().to(Float32) * scale).to(self.out_dtype))
            cute.copy(out_atom, tTo, gOutT)

        tile_max = row_reduce(local_max, cute.ReductionOp.MAX, _TRANSPOSE_THREADS, max_buffer, init_val=0.0)
        if tidx == 0:
            mAmax[tile_row, tile_col] = tile_max


@jit_cache
def compile_quantize_transpose(dtype: type, out_dtype: type, rows_out: bool):
    rows, cols = cute.sym_int(), cute.sym_int()
    return cute.compile(
        QuantizeTransposeKernel(dtype, out_dtype, rows_out),
        make_fake_tensor(dtype, (rows, cols), divisibility=_VEC),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(out_dtype, (rows, cols), divisibility=_VEC) if rows_out else None,
        make_fake_tensor(out_dtype, (cols, rows), divisibility=_VEC),
        make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int())),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


def transpose_tiles(rows: int, cols: int) -> tuple[int, int]:
    """The (row, column) tile grid of `quantize_transpose_fp8` over an (rows, cols) input."""
    return -(-rows // _TILE_ROWS), -(-cols // _TILE_COLS)


@cute_op("codatrain::cute_quantize_transpose_fp8", mutates_args=("out", "out_t", "tile_amax"),
         device_types="cuda")
def quantize_transpose_fp8(
    x: Tensor, scale: Tensor, out: Tensor | None, out_t: Tensor, tile_amax: Tensor
) -> None:
    """out (R, C) FP8 = x·scale saturated (when given), out_t (C, R) its transpose, tile_amax
    (`transpose_tiles`) fp32 = max |x| per tile; x (R, C) contiguous 16-bit, R and C multiples
    of 8, scale a 1-element fp32 tensor."""
    compiled = compile_quantize_transpose(torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[out_t.dtype],
                                          out is not None)
    compiled(x, scale.reshape(1), out, out_t, tile_amax)


def quantize_to(x: Tensor, to: QuantizeTo, dtype: torch.dtype | None = None) -> Fp8Tensor:
    """x (any shape, its last dim contiguous rows) as the `Fp8Tensor` `to` asks for, standing for
    `dtype` (default x's), with the amax of its values (`codatrain.kernels.fp8.quantize`'s rule).

    A delayed scale is known before the pass, so the pass also yields the amax (its row or tile
    maxima); current scaling (`to.scale` None: weights, and a run's first step) reads x once more
    first. With `to.transposed`, one pass writes both orientations (`quantize_transpose_fp8`)."""
    rows = x.reshape(-1, x.shape[-1])
    current = to.scale is None
    # max |x| in one reduction (no |x| temporary); exact in x's dtype, NaN when one is.
    amax = torch.linalg.vector_norm(rows, float("inf")).float() if current else None
    scale = scale_from_amax(amax, fp8_max(to.dtype), to.margin) if current else to.scale
    out = torch.empty(rows.shape, dtype=to.dtype, device=x.device)
    if to.transposed:
        out_t = torch.empty(rows.shape[1], rows.shape[0], dtype=to.dtype, device=x.device)
        tile_amax = torch.empty(transpose_tiles(*rows.shape), dtype=torch.float32, device=x.device)
        quantize_transpose_fp8(rows, scale, out, out_t, tile_amax)
        partial_amax = tile_amax
    else:
        out_t, partial_amax = None, torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        quantize_fp8(rows, scale, out, partial_amax)
    return Fp8Tensor(out.view(x.shape), scale, dtype or x.dtype, amax if current else partial_amax.amax(),
                     out_t)

