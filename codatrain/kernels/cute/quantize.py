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


def quantize_to(x: Tensor, to: QuantizeTo, dtype: torch.dtype | None = None) -> Fp8Tensor:
    """x (any shape, its last dim contiguous rows) as the `Fp8Tensor` `to` asks for, standing for
    `dtype` (default x's), with the amax of its values (`codatrain.kernels.fp8.quantize`'s rule).

    A delayed scale is known before the pass, so the pass also yields the amax (its row maxima);
    current scaling (`to.scale` None: weights, and a run's first step) reads x once more first."""
    rows = x.reshape(-1, x.shape[-1])
    out, row_amax = quantize_fp8_outputs(rows, to.dtype)
    if to.scale is None:
        amax = rows.abs().amax().float()
        scale = scale_from_amax(amax, fp8_max(to.dtype), to.margin)
        quantize_fp8(rows, scale, out, row_amax)
    else:
        scale = to.scale
        quantize_fp8(rows, scale, out, row_amax)
        amax = row_amax.amax()
    return Fp8Tensor(out.view(x.shape), scale, dtype or x.dtype, amax)
