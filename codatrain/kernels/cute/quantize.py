"""Per-tensor FP8 quantization of an activation that no GEMM epilogue produces (block.precision=fp8):
the attention output (FlashAttention writes it) and SwiGLU's y (on sm_90 QuACK stores the gated
half-width output of an `acc_pair` epilogue in 16 bits only).

One memory-bound pass, one row per CTA: out = FP8(x·scale) with the scale given (a 0-d fp32 device
tensor: a delayed scale needs no amax first), and row_amax[m] = max_n |x[m, n]|, whose maximum is
the tensor's amax for the delayed-scaling history. The conversion saturates to the format's finite
range (PTX `cvt.rn.satfinite`), as `codatrain.kernels.fp8.quantize` clamps.
"""

from __future__ import annotations

import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr
from quack.activation import dswiglu
from quack.cache import jit_cache
from quack.compile_utils import make_fake_stream, make_fake_tensor
from quack.copy_utils import get_copy_atom, tiled_copy_1d
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.dsl.torch_library_op import cute_op
from quack.reduce import row_reduce, warp_reduce
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
# transposed weight. This pass writes the transposed FP8 copy, and the row-major one when asked,
# from one read.
TRANSPOSE_TILE = (128, 64)  # (rows, columns) of x per CTA: 128-byte lines of x in, of out_t out
_VEC = 8  # elements per 16-byte load of x
_TRANSPOSE_THREADS = 256
_SEGMENT = 16  # rows of x (bytes of an out_t row) one thread of the gather stores at once
_UNIT = 16  # FP8 bytes of a staged row one 16-byte shared-memory access moves


def _max_abs(acc: Float32, values: cute.TensorSSA, n: int) -> Float32:
    """max(|acc|, max |v|) over n fp32 values, one FMNMX.ABS each (NaN-quiet, as a max reduction)."""
    for i in range(n):
        acc = cute.arch.fmax(acc, values[i], abs=True)
    return cute.math.absf(acc)


def _staged(r: cutlass.Int32, unit: cutlass.Int32, tile_cols: int) -> tuple[cutlass.Int32, cutlass.Int32]:
    """Where row r's 16-byte unit `unit` of an FP8 tile (128 rows, `tile_cols` bytes) sits in shared
    memory: the 16-row segment s = r // 16 XORs the unit with s mod U (U units a row) and the row
    with (s // U) mod (8 / U), a permutation within aligned groups of rows. Phase 1's warps (8 whole
    rows each) still write contiguous bytes, and the gather's 32 lanes (4 words of one unit, 8
    segments) reach 32 distinct banks."""
    units = tile_cols // _UNIT
    segment = r // _SEGMENT
    return r ^ ((segment // units) % (8 // units)), unit ^ (segment % units)


def _gather_lane(t: cutlass.Int32) -> tuple[cutlass.Int32, cutlass.Int32, cutlass.Int32]:
    """(word, segment, unit) of gather thread t: the 32-bit word (4 columns) of a 16-byte unit and
    the 16-row segment it transposes; a warp takes one unit across all 8 segments."""
    return t % 4, (t // 4) % 8, t // 32


def _max_buffer(smem: cutlass.utils.SmemAllocator) -> cute.Tensor:
    """Shared memory for one `_store_tile_max` (one per reduction of a CTA: the second may start
    while warps still read the first)."""
    num_warps = _TRANSPOSE_THREADS // cute.arch.WARP_SIZE
    return smem.allocate_tensor(Float32, cute.make_layout((1, (num_warps, 1))), byte_alignment=8)


@cute.jit
def _store_tile_max(value: Float32, buffer: cute.Tensor, mAmax: cute.Tensor, tile_row: cutlass.Int32,
                    tile_col: cutlass.Int32, tidx: cutlass.Int32) -> None:
    """The maximum of the CTA's threads' (non-negative) `value`s into mAmax[tile_row, tile_col]."""
    tile_max = row_reduce(value, cute.ReductionOp.MAX, _TRANSPOSE_THREADS, buffer, init_val=0.0)
    if tidx == 0:
        mAmax[tile_row, tile_col] = tile_max


@cute.jit
def _store_row_run(values: cute.Tensor, mOut: cute.Tensor, row: cutlass.Int32, col: cutlass.Int32,
                   n_rows: cutlass.Int32, n_cols: cutlass.Int32, store: cutlass.Constexpr[int]) -> None:
    """A thread's run of FP8 values of row `row` from column `col` into the row-major copy, in
    `store`-element pieces masked to (n_rows, n_cols)."""
    out_atom = get_copy_atom(mOut.element_type, store)
    for k in cutlass.range_constexpr(cute.size(values.shape) // store):
        if row < n_rows and col + k * store < n_cols:
            cute.copy(out_atom, cute.local_tile(values, (store,), (k,)),
                      cute.local_tile(mOut[row, None], (store,), (col // store + k,)))


@cute.jit
def _stage(tile: cute.Tensor, values: cute.Tensor, r: cutlass.Int32, col: cutlass.Int32,
           tile_cols: cutlass.Constexpr[int]) -> None:
    """Phase 1 of the transposing passes: a run of FP8 values (16 or 8 bytes) of tile row r, starting
    at tile column `col` (a multiple of the run), into its place in shared memory (`_staged`)."""
    run = const_expr(cute.size(values.shape))
    row, unit = _staged(r, col // _UNIT, tile_cols)
    cute.copy(get_copy_atom(values.element_type, run), values,
              cute.local_tile(tile[row, None], (run,), ((unit * _UNIT + col % _UNIT) // run,)))


@cute.jit
def _store_transposed(tile: cute.Tensor, mOutT: cute.Tensor, t: cutlass.Int32, row0: cutlass.Int32,
                      col0: cutlass.Int32, n_rows: cutlass.Int32, n_cols: cutlass.Int32,
                      tile_cols: cutlass.Constexpr[int], store: cutlass.Constexpr[int]) -> None:
    """Phase 2 of the transposing passes: the FP8 tile (128 rows of x, `tile_cols` columns, staged by
    `_stage` at x's (row0, col0)) transposed into out_t, masked to x's (n_rows, n_cols); run by
    2·tile_cols threads, t their index. Thread t reads 4 columns (one 32-bit word) of 16 rows,
    transposes them 4 × 4 bytes at a time with byte permutes, and stores 16 contiguous bytes of
    each column's out_t row: a warp writes whole 128-byte lines of four out_t rows."""
    word, segment, unit = _gather_lane(t)
    words = cute.recast_tensor(tile, cutlass.Int32)
    columns = [cute.make_rmem_tensor((_SEGMENT,), mOutT.element_type) for _ in range(4)]
    column_words = [cute.recast_tensor(c, cutlass.Int32) for c in columns]
    for b in cutlass.range_constexpr(_SEGMENT // 4):
        rows = []
        for i in cutlass.range_constexpr(4):
            row, staged_unit = _staged(segment * _SEGMENT + 4 * b + i, unit, tile_cols)
            rows.append(words[row, staged_unit * 4 + word])
        # Bytes (a0 a1 a2 a3), (b0 ..), (c0 ..), (d0 ..) -> (a0 b0 a1 b1), ... -> (a0 b0 c0 d0), ...
        ab_low, ab_high = cute.arch.prmt(rows[0], rows[1], 0x5140), cute.arch.prmt(rows[0], rows[1], 0x7362)
        cd_low, cd_high = cute.arch.prmt(rows[2], rows[3], 0x5140), cute.arch.prmt(rows[2], rows[3], 0x7362)
        column_words[0][b] = cute.arch.prmt(ab_low, cd_low, 0x5410)
        column_words[1][b] = cute.arch.prmt(ab_low, cd_low, 0x7632)
        column_words[2][b] = cute.arch.prmt(ab_high, cd_high, 0x5410)
        column_words[3][b] = cute.arch.prmt(ab_high, cd_high, 0x7632)
    out_atom = get_copy_atom(mOutT.element_type, store)
    out_col = row0 + segment * _SEGMENT
    for j in cutlass.range_constexpr(4):
        out_row = col0 + (unit * 4 + word) * 4 + j
        if out_row < n_cols:
            for h in cutlass.range_constexpr(_SEGMENT // store):
                if out_col + h * store < n_rows:
                    cute.copy(out_atom, cute.local_tile(columns[j], (store,), (h,)),
                              cute.local_tile(mOutT[out_row, None], (store,), (out_col // store + h,)))


class QuantizeTransposeKernel:
    """out_t = FP8(x·scale)ᵀ (C, R), out = FP8(x·scale) (R, C) [optional], both row-major, and
    tile_amax[i, j] = max |x| over the (128 × 64) tile (i, j); one tile per CTA.

    Memory-bound, so it is built for bytes in flight and whole lines: each thread first issues all
    four of its 16-byte loads (16-element runs of two rows), then quantizes each run once, writes it
    as an FP8 row run (16 bytes) when asked and stages it in shared memory (`_stage`); after one
    barrier, half the threads gather 4 columns × 16 rows each as 32-bit words, transpose them with
    byte permutes and store 16 contiguous bytes of 4 out_t rows (`_store_transposed`).
    R and C must be multiples of 8; unless both are multiples of 16 (FP8 GEMM operands are) the
    stores move 8 bytes each."""

    def __init__(self, dtype: type, out_dtype: type, rows_out: bool, store_elems: int) -> None:
        self.dtype, self.out_dtype, self.rows_out = dtype, out_dtype, rows_out
        # FP8 elements per store: 16, or 8 where R or C is not a multiple of 16.
        self.store_elems = store_elems

    @cute.jit
    def __call__(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor | None, mOutT: cute.Tensor,
                 mAmax: cute.Tensor, stream: cuda.CUstream):
        tile_rows, tile_cols = TRANSPOSE_TILE
        grid_cols = (mX.shape[1] + tile_cols - 1) // tile_cols
        grid_rows = (mX.shape[0] + tile_rows - 1) // tile_rows
        # Row tiles vary fastest: CTAs that run together write adjacent pieces of the same out_t
        # rows (long runs in DRAM), at the price of shorter runs of the rows they read.
        self.kernel(mX, mScale, mOut, mOutT, mAmax).launch(
            grid=[grid_rows, grid_cols, 1], block=[_TRANSPOSE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor | None, mOutT: cute.Tensor,
               mAmax: cute.Tensor):
        tile_rows, tile_cols = const_expr(TRANSPOSE_TILE[0]), const_expr(TRANSPOSE_TILE[1])
        run = const_expr(2 * _VEC)  # elements of a row one thread moves at once
        runs_per_row = const_expr(tile_cols // run)
        rows_per_pass = const_expr(_TRANSPOSE_THREADS // runs_per_row)
        row_steps = const_expr(tile_rows // rows_per_pass)
        tidx, _, _ = cute.arch.thread_idx()
        tile_row, tile_col, _ = cute.arch.block_idx()
        n_rows, n_cols = mX.shape[0], mX.shape[1]
        row0, col0 = tile_row * tile_rows, tile_col * tile_cols
        smem = cutlass.utils.SmemAllocator()
        tile_layout = cute.make_layout((tile_rows, tile_cols), stride=(tile_cols, 1))
        tile = smem.allocate_tensor(self.out_dtype, tile_layout, byte_alignment=16)
        max_buffer = _max_buffer(smem)
        scale = mScale[0]
        in_atom = get_copy_atom(self.dtype, _VEC)
        store = const_expr(self.store_elems)

        # Phase 1: thread t owns run t % 4 of rows t // 4 + 64 s (s < row_steps). All loads first.
        r_first, run_idx = tidx // runs_per_row, tidx % runs_per_row
        col = col0 + run_idx * run
        loaded = [cute.make_rmem_tensor((run,), self.dtype) for _ in range(row_steps)]
        for s in cutlass.range_constexpr(row_steps):
            loaded[s].fill(0)
            row = row0 + r_first + s * rows_per_pass
            for half in cutlass.range_constexpr(2):
                if row < n_rows and col + half * _VEC < n_cols:
                    cute.copy(in_atom, cute.local_tile(mX[row, None], (_VEC,), (col // _VEC + half,)),
                              cute.local_tile(loaded[s], (_VEC,), (half,)))
        local_max = Float32(0.0)
        for s in cutlass.range_constexpr(row_steps):
            r = r_first + s * rows_per_pass
            row = row0 + r
            x = loaded[s].load().to(Float32)
            local_max = _max_abs(local_max, x, run)
            quantized = cute.make_rmem_tensor((run,), self.out_dtype)
            quantized.store((x * scale).to(self.out_dtype))
            _stage(tile, quantized, r, run_idx * run, tile_cols)
            if const_expr(self.rows_out):
                _store_row_run(quantized, mOut, row, col, n_rows, n_cols, store)
        cute.arch.barrier()

        if tidx < 2 * tile_cols:
            _store_transposed(tile, mOutT, tidx, row0, col0, n_rows, n_cols, tile_cols, store)

        _store_tile_max(local_max, max_buffer, mAmax, tile_row, tile_col, tidx)


@jit_cache
def compile_quantize_transpose(dtype: type, out_dtype: type, rows_out: bool, store_elems: int):
    rows, cols = cute.sym_int(), cute.sym_int()
    return cute.compile(
        QuantizeTransposeKernel(dtype, out_dtype, rows_out, store_elems),
        make_fake_tensor(dtype, (rows, cols), divisibility=_VEC),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(out_dtype, (rows, cols), divisibility=store_elems) if rows_out else None,
        make_fake_tensor(out_dtype, (cols, rows), divisibility=store_elems),
        make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int())),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


def transpose_tiles(rows: int, cols: int) -> tuple[int, int]:
    """The (row, column) tile grid of `quantize_transpose_fp8` over an (rows, cols) input."""
    return -(-rows // TRANSPOSE_TILE[0]), -(-cols // TRANSPOSE_TILE[1])


@cute_op("codatrain::cute_quantize_transpose_fp8", mutates_args=("out", "out_t", "tile_amax"),
         device_types="cuda")
def quantize_transpose_fp8(
    x: Tensor, scale: Tensor, out: Tensor | None, out_t: Tensor, tile_amax: Tensor
) -> None:
    """out (R, C) FP8 = x·scale saturated (when given), out_t (C, R) its transpose, tile_amax
    (`transpose_tiles`) fp32 = max |x| per tile; x (R, C) contiguous 16-bit, R and C multiples
    of 8, scale a 1-element fp32 tensor."""
    # FP8 GEMM operands are multiples of 16 both ways (16-byte stores); other sizes store 8 bytes.
    store_elems = 16 if x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0 else 8
    compiled = compile_quantize_transpose(torch2cute_dtype_map[x.dtype], torch2cute_dtype_map[out_t.dtype],
                                          out is not None, store_elems)
    compiled(x, scale.reshape(1), out, out_t, tile_amax)


def fp8_buffers(shape: tuple[int, int], to: QuantizeTo, device: torch.device,
                into: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(rows, transposed) FP8 outputs of an (R, C) quantize pass as `to` asks (None: not asked),
    in `into`'s memory when it holds them (the rows first, then the transposed copy on the next
    byte, which must start on a 16-byte boundary, as the kernels' stores do), else new."""
    r, c = shape
    sizes = [r * c if to.rows or not to.transposed else 0, r * c if to.transposed else 0]
    if (into is None or not into.is_contiguous() or into.numel() * into.element_size() < sum(sizes)
            or sizes[0] % 16):
        return (torch.empty(r, c, dtype=to.dtype, device=device) if sizes[0] else None,
                torch.empty(c, r, dtype=to.dtype, device=device) if sizes[1] else None)
    memory = into.view(-1).view(torch.uint8)
    rows = memory[:sizes[0]].view(to.dtype).view(r, c) if sizes[0] else None
    transposed = memory[sizes[0]:sizes[0] + sizes[1]].view(to.dtype).view(c, r) if sizes[1] else None
    return rows, transposed


def quantize_to(x: Tensor, to: QuantizeTo, dtype: torch.dtype | None = None, *,
                into: Tensor | None = None) -> Fp8Tensor:
    """x (any shape, its last dim contiguous rows) as the `Fp8Tensor` `to` asks for, standing for
    `dtype` (default x's), with the amax of its values (`codatrain.kernels.fp8.quantize`'s rule).
    `into`: a contiguous tensor nobody reads any more, whose memory holds the FP8 copies when it
    is large enough (both orientations of a bf16 tensor's values fill exactly its bytes).

    A delayed scale is known before the pass, so the pass also yields the amax (its row or tile
    maxima); current scaling (`to.scale` None: weights, and a run's first step) reads x once more
    first. With `to.transposed`, one pass writes both orientations (`quantize_transpose_fp8`), or
    the transposed one alone (`to.rows` False)."""
    rows = x.reshape(-1, x.shape[-1])
    current = to.scale is None
    # max |x| in one reduction (no |x| temporary); exact in x's dtype, NaN when one is.
    amax = torch.linalg.vector_norm(rows, float("inf")).float() if current else None
    scale = scale_from_amax(amax, fp8_max(to.dtype), to.margin) if current else to.scale
    if to.transposed:
        out, out_t = fp8_buffers(rows.shape, to, x.device, into)
        tile_amax = torch.empty(transpose_tiles(*rows.shape), dtype=torch.float32, device=x.device)
        quantize_transpose_fp8(rows, scale, out, out_t, tile_amax)
        partial_amax = tile_amax
        if out is None:
            out = out_t.t()  # the operand's values in its own shape, read only through data_t
    else:
        out, out_t = fp8_buffers(rows.shape, to, x.device, into)
        partial_amax = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        quantize_fp8(rows, scale, out, partial_amax)
    return Fp8Tensor(out.view(x.shape), scale, dtype or x.dtype, amax if current else partial_amax.amax(),
                     out_t)



# ---- dSwiGLU into both orientations ------------------------------------------------------------------
# With FP8 weight gradients the down-projection's dgrad is a cuBLAS FP8 GEMM (QuACK's promoted FP8
# mainloop with dSwiGLU in its epilogue ran 1.75× `_scaled_mm` at 8B widths, docs/benchmarks.md),
# and this pass turns its output dy into every tensor the rest of the MLP backward reads, from one
# read of dy and the pre-activation: dpreact in FP8 (both orientations), y's token-contiguous FP8
# copy and the norm's ZdZ partials. dpreact and y are rounded to 16 bits before their FP8 copies
# are made, as the epilogue-then-quantize path rounds them.
class DSwigluQuantizeKernel:
    """Over preact's columns [col_base, col_base + 2 Fc), with dy (M, Fc) that column chunk of the
    dgrad's output dy·W_down and preact (M, 2F) the (g, u) pairs interleaved:
    dpreact = (dg, du) interleaved (dg = dy·u·silu'(g), du = dy·silu(g)) and y = silu(g)·u, written
    as dp = FP8(dpreact·s_dp) (M, 2F) [optional] and dp_t (2F, M), y_t = FP8(y·s_y)ᵀ (F, M);
    dp_amax and y_amax per 128 × 64 tile of preact; dsum[m, t] = Σ g·dg + u·du over the pairs of
    row m in the chunk's t-th tile. One tile per CTA: phase 1 as the transposing pass's (a
    thread's 16-column run is 8 pairs, their 8 dy one 16-byte load), phase 2 its gather, dpreact's and
    y's (32 columns) side by side. M a multiple of 8, 2F and 2 Fc of 16."""

    def __init__(self, dtype: type, dp_dtype: type, y_dtype: type, rows_out: bool, store_elems: int) -> None:
        self.dtype, self.dp_dtype, self.y_dtype = dtype, dp_dtype, y_dtype
        self.rows_out, self.store_elems = rows_out, store_elems

    @cute.jit
    def __call__(self, mDy: cute.Tensor, mPreact: cute.Tensor, mDpScale: cute.Tensor, mYScale: cute.Tensor,
                 mDp: cute.Tensor | None, mDpT: cute.Tensor, mYT: cute.Tensor, mDpAmax: cute.Tensor,
                 mYAmax: cute.Tensor, mDsum: cute.Tensor, col_base: cutlass.Int32, stream: cuda.CUstream):
        tile_rows, tile_cols = TRANSPOSE_TILE
        grid_rows = (mDy.shape[0] + tile_rows - 1) // tile_rows
        grid_cols = (2 * mDy.shape[1] + tile_cols - 1) // tile_cols
        self.kernel(mDy, mPreact, mDpScale, mYScale, mDp, mDpT, mYT, mDpAmax, mYAmax, mDsum, col_base).launch(
            grid=[grid_rows, grid_cols, 1], block=[_TRANSPOSE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mDy: cute.Tensor, mPreact: cute.Tensor, mDpScale: cute.Tensor, mYScale: cute.Tensor,
               mDp: cute.Tensor | None, mDpT: cute.Tensor, mYT: cute.Tensor, mDpAmax: cute.Tensor,
               mYAmax: cute.Tensor, mDsum: cute.Tensor, col_base: cutlass.Int32):
        tile_rows, tile_cols = const_expr(TRANSPOSE_TILE[0]), const_expr(TRANSPOSE_TILE[1])
        run, pairs = const_expr(2 * _VEC), const_expr(_VEC)  # preact columns, and pairs, of a run
        runs_per_row = const_expr(tile_cols // run)
        rows_per_pass = const_expr(_TRANSPOSE_THREADS // runs_per_row)
        row_steps = const_expr(tile_rows // rows_per_pass)
        tidx, _, _ = cute.arch.thread_idx()
        tile_row, chunk_tile_col, _ = cute.arch.block_idx()
        n_rows, col_end = mDy.shape[0], col_base + 2 * mDy.shape[1]
        tile_col = col_base // tile_cols + chunk_tile_col
        row0, col0 = tile_row * tile_rows, col_base + chunk_tile_col * tile_cols
        smem = cutlass.utils.SmemAllocator()
        dp_tile = smem.allocate_tensor(
            self.dp_dtype, cute.make_layout((tile_rows, tile_cols), stride=(tile_cols, 1)), byte_alignment=16)
        y_tile = smem.allocate_tensor(
            self.y_dtype, cute.make_layout((tile_rows, tile_cols // 2), stride=(tile_cols // 2, 1)),
            byte_alignment=16)
        dp_max_buffer, y_max_buffer = _max_buffer(smem), _max_buffer(smem)
        dp_scale, y_scale = mDpScale[0], mYScale[0]
        in_atom = get_copy_atom(self.dtype, _VEC)
        store = const_expr(self.store_elems)

        # Phase 1: thread t owns run t % 4 (8 pairs) of rows t // 4 + 64 s. All loads first.
        r_first, run_idx = tidx // runs_per_row, tidx % runs_per_row
        col = col0 + run_idx * run
        pre_runs = [cute.make_rmem_tensor((run,), self.dtype) for _ in range(row_steps)]
        dy_runs = [cute.make_rmem_tensor((pairs,), self.dtype) for _ in range(row_steps)]
        for s in cutlass.range_constexpr(row_steps):
            pre_runs[s].fill(0)
            dy_runs[s].fill(0)
            row = row0 + r_first + s * rows_per_pass
            if row < n_rows and col < col_end:  # runs are whole: col_end is a multiple of 16
                for half in cutlass.range_constexpr(2):
                    cute.copy(in_atom, cute.local_tile(mPreact[row, None], (_VEC,), (col // _VEC + half,)),
                              cute.local_tile(pre_runs[s], (_VEC,), (half,)))
                cute.copy(in_atom, cute.local_tile(mDy[row, None], (_VEC,), ((col - col_base) // run,)),
                          dy_runs[s])
        dp_max, y_max = Float32(0.0), Float32(0.0)
        for s in cutlass.range_constexpr(row_steps):
            r = r_first + s * rows_per_pass
            row = row0 + r
            pre = cute.make_rmem_tensor((run,), Float32)
            pre.store(pre_runs[s].load().to(Float32))
            dy = cute.make_rmem_tensor((pairs,), Float32)
            dy.store(dy_runs[s].load().to(Float32))
            dp = cute.make_rmem_tensor((run,), Float32)
            y = cute.make_rmem_tensor((pairs,), Float32)
            dsum = Float32(0.0)
            for i in cutlass.range_constexpr(pairs):
                g, u = pre[2 * i], pre[2 * i + 1]
                dg, du, y_i = dswiglu(g, u, dy[i])
                dp[2 * i] = dg
                dp[2 * i + 1] = du
                y[i] = y_i
                dsum += g * dg + u * du
            # dsum over the row's 32 pairs of this tile: the 4 adjacent lanes of the row's runs.
            dsum = warp_reduce(dsum, operator.add, threads_in_group=runs_per_row)
            if run_idx == 0 and row < n_rows:
                mDsum[row, chunk_tile_col] = dsum
            dp16 = cute.make_rmem_tensor((run,), self.dtype)
            dp16.store(dp.load().to(self.dtype))
            y16 = cute.make_rmem_tensor((pairs,), self.dtype)
            y16.store(y.load().to(self.dtype))
            dp_values, y_values = dp16.load().to(Float32), y16.load().to(Float32)
            dp_max = _max_abs(dp_max, dp_values, run)
            y_max = _max_abs(y_max, y_values, pairs)
            dp8 = cute.make_rmem_tensor((run,), self.dp_dtype)
            dp8.store((dp_values * dp_scale).to(self.dp_dtype))
            _stage(dp_tile, dp8, r, run_idx * run, tile_cols)
            y8 = cute.make_rmem_tensor((pairs,), self.y_dtype)
            y8.store((y_values * y_scale).to(self.y_dtype))
            _stage(y_tile, y8, r, run_idx * pairs, tile_cols // 2)
            if const_expr(self.rows_out):
                _store_row_run(dp8, mDp, row, col, n_rows, col_end, store)
        cute.arch.barrier()

        # dpreact's gather on threads [0, 128), y's (half as wide) on [128, 192).
        if tidx < 2 * tile_cols:
            _store_transposed(dp_tile, mDpT, tidx, row0, col0, n_rows, col_end, tile_cols, store)
        elif tidx < 3 * tile_cols:
            _store_transposed(y_tile, mYT, tidx - 2 * tile_cols, row0, col0 // 2, n_rows, col_end // 2,
                              tile_cols // 2, store)

        _store_tile_max(dp_max, dp_max_buffer, mDpAmax, tile_row, tile_col, tidx)
        _store_tile_max(y_max, y_max_buffer, mYAmax, tile_row, tile_col, tidx)


@jit_cache
def compile_dswiglu_quantize(dtype: type, dp_dtype: type, y_dtype: type, rows_out: bool, store_elems: int):
    # width = 2 pairs; tiles: the amax grids' columns over the whole preact, chunk_tiles dsum's over dy's
    rows, chunk, width, pairs, tiles, chunk_tiles = (cute.sym_int() for _ in range(6))
    return cute.compile(
        DSwigluQuantizeKernel(dtype, dp_dtype, y_dtype, rows_out, store_elems),
        make_fake_tensor(dtype, (rows, chunk), divisibility=_VEC),
        make_fake_tensor(dtype, (rows, width), divisibility=2 * _VEC),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(dp_dtype, (rows, width), divisibility=2 * _VEC) if rows_out else None,
        make_fake_tensor(dp_dtype, (width, rows), divisibility=store_elems),
        make_fake_tensor(y_dtype, (pairs, rows), divisibility=store_elems),
        make_fake_tensor(Float32, (cute.sym_int(), tiles)),
        make_fake_tensor(Float32, (cute.sym_int(), tiles)),
        make_fake_tensor(Float32, (rows, chunk_tiles)),
        cutlass.Int32(0),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


@cute_op("codatrain::cute_dswiglu_quantize_fp8",
         mutates_args=("dp", "dp_t", "y_t", "dp_amax", "y_amax", "dsum"), device_types="cuda")
def dswiglu_quantize_fp8(
    dy: Tensor, preact: Tensor, dp_scale: Tensor, y_scale: Tensor, dp: Tensor | None, dp_t: Tensor,
    y_t: Tensor, dp_amax: Tensor, y_amax: Tensor, dsum: Tensor, col_base: int,
) -> None:
    """`DSwigluQuantizeKernel` over preact's columns [col_base, col_base + 2 Fc) for dy (M, Fc):
    dp (M, 2F) [when given], dp_t (2F, M), y_t (F, M) FP8, dp_amax and y_amax (`transpose_tiles` of
    the whole preact) fp32, dsum (M, 2 Fc / 64) fp32 the chunk's ZdZ partials. col_base a multiple
    of 64, dy and preact contiguous 16-bit, M a multiple of 8, 2F and 2 Fc of 16."""
    store_elems = 16 if dy.shape[0] % 16 == 0 and preact.shape[1] % 16 == 0 else 8
    compiled = compile_dswiglu_quantize(torch2cute_dtype_map[dy.dtype], torch2cute_dtype_map[dp_t.dtype],
                                        torch2cute_dtype_map[y_t.dtype], dp is not None, store_elems)
    compiled(dy, preact, dp_scale.reshape(1), y_scale.reshape(1), dp, dp_t, y_t, dp_amax, y_amax, dsum,
             col_base)


# ---- RMSNorm backward into both orientations ----------------------------------------------------------
# With FP8 weight gradients the norm consumer's dgrad (gate/up, QKV) is a cuBLAS FP8 GEMM as well (QuACK's
# promoted FP8 mainloop with the norm backward in its epilogue ran 1.46–1.60× `_scaled_mm` on an H100),
# and this pass turns its output dn into what the rest of the backward reads, from one read of dn, x and
# the residual gradient: dx in 16 bits (the residual path) and in FP8 (the next dgrad's and weight
# gradient's operand), n = x·rstd·γ's token-contiguous FP8 copy (the weight gradient's), and the dγ
# partials. dx and n are rounded to 16 bits before their FP8 copies are made, as the epilogue path's are.
class RmsBwdQuantizeKernel:
    """Over x (M, d), with dn (M, d) the dgrad's output, xr = x·rstd:
    dx = rstd·(dn·γ − xr·zdz/d) [+ c], written in 16 bits (M, d), and as dxq = FP8(dx·s_dx) (M, d)
    [optional] and dxq_t (d, M) [optional]; n_t = FP8(xr·γ·s_n)ᵀ (d, M); dx_amax and n_amax per
    128 × 64 tile; dgamma[i, j] = Σ dn·xr over row tile i's rows of column j. One tile per CTA:
    phase 1 as the transposing pass's, dγ summed over the tile's rows through lane shuffles and a
    warp-per-row buffer in shared memory, phase 2 its gather for n and dx side by side. M and d
    multiples of 8."""

    def __init__(self, dtype: type, out_dtype: type, n_dtype: type, residual: bool, rows_out: bool,
                 dx_t_out: bool, store_elems: int) -> None:
        self.dtype, self.out_dtype, self.n_dtype = dtype, out_dtype, n_dtype
        self.residual, self.rows_out, self.dx_t_out = residual, rows_out, dx_t_out
        self.store_elems = store_elems

    @cute.jit
    def __call__(self, mDn: cute.Tensor, mX: cute.Tensor, mC: cute.Tensor | None, mGamma: cute.Tensor,
                 mRstd: cute.Tensor, mZdz: cute.Tensor, mDxScale: cute.Tensor, mNScale: cute.Tensor,
                 mDx: cute.Tensor, mDxq: cute.Tensor | None, mDxqT: cute.Tensor | None, mNT: cute.Tensor,
                 mDxAmax: cute.Tensor, mNAmax: cute.Tensor, mDgamma: cute.Tensor, inv_dim: Float32,
                 stream: cuda.CUstream):
        tile_rows, tile_cols = TRANSPOSE_TILE
        grid_rows = (mX.shape[0] + tile_rows - 1) // tile_rows
        grid_cols = (mX.shape[1] + tile_cols - 1) // tile_cols
        self.kernel(mDn, mX, mC, mGamma, mRstd, mZdz, mDxScale, mNScale, mDx, mDxq, mDxqT, mNT, mDxAmax,
                    mNAmax, mDgamma, inv_dim).launch(
            grid=[grid_rows, grid_cols, 1], block=[_TRANSPOSE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mDn: cute.Tensor, mX: cute.Tensor, mC: cute.Tensor | None, mGamma: cute.Tensor,
               mRstd: cute.Tensor, mZdz: cute.Tensor, mDxScale: cute.Tensor, mNScale: cute.Tensor,
               mDx: cute.Tensor, mDxq: cute.Tensor | None, mDxqT: cute.Tensor | None, mNT: cute.Tensor,
               mDxAmax: cute.Tensor, mNAmax: cute.Tensor, mDgamma: cute.Tensor, inv_dim: Float32):
        tile_rows, tile_cols = const_expr(TRANSPOSE_TILE[0]), const_expr(TRANSPOSE_TILE[1])
        run = const_expr(2 * _VEC)
        runs_per_row = const_expr(tile_cols // run)
        rows_per_pass = const_expr(_TRANSPOSE_THREADS // runs_per_row)
        row_steps = const_expr(tile_rows // rows_per_pass)
        num_warps = const_expr(_TRANSPOSE_THREADS // cute.arch.WARP_SIZE)
        tidx, _, _ = cute.arch.thread_idx()
        tile_row, tile_col, _ = cute.arch.block_idx()
        n_rows, n_cols = mX.shape[0], mX.shape[1]
        row0, col0 = tile_row * tile_rows, tile_col * tile_cols
        smem = cutlass.utils.SmemAllocator()
        tile_layout = cute.make_layout((tile_rows, tile_cols), stride=(tile_cols, 1))
        dx_tile = smem.allocate_tensor(self.out_dtype, tile_layout, byte_alignment=16) if const_expr(
            self.dx_t_out) else None
        n_tile = smem.allocate_tensor(self.n_dtype, tile_layout, byte_alignment=16)
        # dγ of each warp's rows, per column: lanes of one run are reduced by shuffles first.
        dgamma_buffer = smem.allocate_tensor(
            Float32, cute.make_layout((num_warps, tile_cols), stride=(tile_cols, 1)), byte_alignment=16)
        dx_max_buffer, n_max_buffer = _max_buffer(smem), _max_buffer(smem)
        dx_scale, n_scale = mDxScale[0], mNScale[0]
        in_atom = get_copy_atom(self.dtype, _VEC)
        store = const_expr(self.store_elems)

        # Phase 1: thread t owns run t % 4 (16 columns) of rows t // 4 + 64 s. All loads first.
        r_first, run_idx = tidx // runs_per_row, tidx % runs_per_row
        col = col0 + run_idx * run
        n_inputs = const_expr(3 if self.residual else 2)
        loaded = [[cute.make_rmem_tensor((run,), self.dtype) for _ in range(n_inputs)]
                  for _ in range(row_steps)]
        gamma16 = cute.make_rmem_tensor((run,), self.dtype)
        gamma16.fill(0)
        for half in cutlass.range_constexpr(2):
            if col + half * _VEC < n_cols:
                cute.copy(in_atom, cute.local_tile(mGamma, (_VEC,), (col // _VEC + half,)),
                          cute.local_tile(gamma16, (_VEC,), (half,)))
        sources = [mDn, mX, mC] if const_expr(self.residual) else [mDn, mX]
        for s in cutlass.range_constexpr(row_steps):
            row = row0 + r_first + s * rows_per_pass
            for k in cutlass.range_constexpr(n_inputs):
                loaded[s][k].fill(0)
                for half in cutlass.range_constexpr(2):
                    if row < n_rows and col + half * _VEC < n_cols:
                        cute.copy(in_atom,
                                  cute.local_tile(sources[k][row, None], (_VEC,), (col // _VEC + half,)),
                                  cute.local_tile(loaded[s][k], (_VEC,), (half,)))
        # Rows past M read row M − 1's statistics: their dn, x and c are zero, so are their outputs.
        stat_rows = [cutlass.min(row0 + r_first + s * rows_per_pass, n_rows - 1) for s in range(row_steps)]
        rstd_of, zdz_of = [mRstd[row] for row in stat_rows], [mZdz[row] for row in stat_rows]
        gamma = gamma16.load().to(Float32)
        dgamma = cute.make_rmem_tensor((run,), Float32)
        dgamma.fill(0.0)
        dx_max, n_max = Float32(0.0), Float32(0.0)
        for s in cutlass.range_constexpr(row_steps):
            r = r_first + s * rows_per_pass
            row = row0 + r
            dn = loaded[s][0].load().to(Float32)
            xr = loaded[s][1].load().to(Float32) * rstd_of[s]
            dx = (dn * gamma - xr * (zdz_of[s] * inv_dim)) * rstd_of[s]
            if const_expr(self.residual):
                dx = dx + loaded[s][2].load().to(Float32)
            dgamma.store(dgamma.load() + dn * xr)
            dx16 = cute.make_rmem_tensor((run,), self.dtype)
            dx16.store(dx.to(self.dtype))
            n16 = cute.make_rmem_tensor((run,), self.dtype)
            n16.store((xr * gamma).to(self.dtype))
            dx_values, n_values = dx16.load().to(Float32), n16.load().to(Float32)
            dx_max = _max_abs(dx_max, dx_values, run)
            n_max = _max_abs(n_max, n_values, run)
            for half in cutlass.range_constexpr(2):
                if row < n_rows and col + half * _VEC < n_cols:
                    cute.copy(in_atom, cute.local_tile(dx16, (_VEC,), (half,)),
                              cute.local_tile(mDx[row, None], (_VEC,), (col // _VEC + half,)))
            n8 = cute.make_rmem_tensor((run,), self.n_dtype)
            n8.store((n_values * n_scale).to(self.n_dtype))
            _stage(n_tile, n8, r, run_idx * run, tile_cols)
            if const_expr(self.rows_out or self.dx_t_out):
                dx8 = cute.make_rmem_tensor((run,), self.out_dtype)
                dx8.store((dx_values * dx_scale).to(self.out_dtype))
                if const_expr(self.dx_t_out):
                    _stage(dx_tile, dx8, r, run_idx * run, tile_cols)
                if const_expr(self.rows_out):
                    _store_row_run(dx8, mDxq, row, col, n_rows, n_cols, store)
        # dγ: the 8 lanes of a warp that share a run (lanes ≡ run_idx mod 4) by shuffles, then the
        # warps' sums through shared memory.
        for j in cutlass.range_constexpr(run):
            v = dgamma[j]
            for offset in cutlass.range_constexpr(3):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=runs_per_row << offset)
            dgamma[j] = v
        warp, lane = tidx // cute.arch.WARP_SIZE, tidx % cute.arch.WARP_SIZE
        if lane < runs_per_row:
            for j in cutlass.range_constexpr(run):
                dgamma_buffer[warp, lane * run + j] = dgamma[j]
        cute.arch.barrier()
        if tidx < tile_cols and col0 + tidx < n_cols:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(num_warps):
                total += dgamma_buffer[w, tidx]
            mDgamma[tile_row, col0 + tidx] = total

        # n's gather on threads [0, 128), dx's on [128, 256).
        if tidx < 2 * tile_cols:
            _store_transposed(n_tile, mNT, tidx, row0, col0, n_rows, n_cols, tile_cols, store)
        if const_expr(self.dx_t_out):
            if tidx >= 2 * tile_cols:
                _store_transposed(dx_tile, mDxqT, tidx - 2 * tile_cols, row0, col0, n_rows, n_cols, tile_cols,
                                  store)

        _store_tile_max(dx_max, dx_max_buffer, mDxAmax, tile_row, tile_col, tidx)
        _store_tile_max(n_max, n_max_buffer, mNAmax, tile_row, tile_col, tidx)


@jit_cache
def compile_rms_bwd_quantize(dtype: type, out_dtype: type, n_dtype: type, residual: bool, rows_out: bool,
                             dx_t_out: bool, store_elems: int):
    rows, cols, row_tiles, col_tiles = (cute.sym_int() for _ in range(4))
    acts = [make_fake_tensor(dtype, (rows, cols), divisibility=_VEC) for _ in range(3)]
    return cute.compile(
        RmsBwdQuantizeKernel(dtype, out_dtype, n_dtype, residual, rows_out, dx_t_out, store_elems),
        acts[0],
        acts[1],
        acts[2] if residual else None,
        make_fake_tensor(dtype, (cols,), divisibility=_VEC),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (rows,)),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(Float32, (1,)),
        make_fake_tensor(dtype, (rows, cols), divisibility=_VEC),
        make_fake_tensor(out_dtype, (rows, cols), divisibility=store_elems) if rows_out else None,
        make_fake_tensor(out_dtype, (cols, rows), divisibility=store_elems) if dx_t_out else None,
        make_fake_tensor(n_dtype, (cols, rows), divisibility=store_elems),
        make_fake_tensor(Float32, (row_tiles, col_tiles)),
        make_fake_tensor(Float32, (row_tiles, col_tiles)),
        make_fake_tensor(Float32, (row_tiles, cols)),
        Float32(1.0),
        make_fake_stream(),
        options="--enable-tvm-ffi",
    )


@cute_op("codatrain::cute_rms_bwd_quantize_fp8",
         mutates_args=("dx", "dxq", "dxq_t", "n_t", "dx_amax", "n_amax", "dgamma"), device_types="cuda")
def rms_bwd_quantize_fp8(
    dn: Tensor, x: Tensor, residual_grad: Tensor | None, gamma: Tensor, rstd: Tensor, zdz: Tensor,
    dx_scale: Tensor, n_scale: Tensor, dx: Tensor, dxq: Tensor | None, dxq_t: Tensor | None, n_t: Tensor,
    dx_amax: Tensor, n_amax: Tensor, dgamma: Tensor,
) -> None:
    """`RmsBwdQuantizeKernel`: dn, x, residual_grad [optional], dx (M, d) contiguous 16-bit, gamma (d,),
    rstd and zdz (M,) fp32; dxq (M, d) and dxq_t (d, M) [each optional] and n_t (d, M) FP8; dx_amax and
    n_amax (`transpose_tiles`) and dgamma ((M + 127) // 128, d) fp32. M and d multiples of 8."""
    store_elems = 16 if x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0 else 8
    fp8_out = dxq if dxq is not None else dxq_t
    out_dtype = torch2cute_dtype_map[(fp8_out if fp8_out is not None else n_t).dtype]
    compiled = compile_rms_bwd_quantize(
        torch2cute_dtype_map[x.dtype], out_dtype, torch2cute_dtype_map[n_t.dtype], residual_grad is not None,
        dxq is not None, dxq_t is not None, store_elems)
    compiled(dn, x, residual_grad, gamma, rstd, zdz, dx_scale.reshape(1), n_scale.reshape(1), dx, dxq, dxq_t,
             n_t, dx_amax, n_amax, dgamma, 1.0 / x.shape[1])
