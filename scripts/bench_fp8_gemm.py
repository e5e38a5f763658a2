"""FP8 GEMM throughput and accuracy at the Llama layer shapes: cuBLAS (`torch._scaled_mm`, per-tensor
and per-row scales, with and without fast accumulation), cuBLAS bf16, and QuACK's FP8 GEMM in the
tiles the FP8 stages may use (docs/benchmarks.md, "FP8 GEMMs").

    python scripts/bench_fp8_gemm.py [--json out.json]

Operands are e4m3 with per-tensor scales, the output bf16. Accuracy is the error of the output
against the fp32 product of the same FP8 values, divided by the error of rounding that product to
bf16 (1.00: as exact as a bf16 output can be). Times are medians of back-to-back launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {  # name: (M, K, N) of the layer GEMMs at 8B widths (M 16384) and 1B widths (M 32768)
    "8b_qkv": (16384, 4096, 6144),
    "8b_out": (16384, 4096, 4096),
    "8b_gate_up": (16384, 4096, 28672),
    "8b_down": (16384, 14336, 4096),
    "1b_qkv": (32768, 2048, 3072),
    "1b_out": (32768, 2048, 2048),
    "1b_gate_up": (32768, 2048, 16384),
    "1b_down": (32768, 8192, 2048),
}
# QuACK tiles (tile_m, tile_n, pingpong, cluster_m, cluster_n): the FP8 stages' cooperative tiles, and
# QuACK's default (pingpong, which spills the promoted accumulator).
QUACK_TILES = [(128, 128, False, 2, 1), (128, 128, False, 1, 2), (128, 192, False, 2, 1),
               (128, 192, True, 2, 1)]


def median_ms(fn: Callable[[], object], samples: int, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(samples):  # back-to-back launches: the host's overhead hides behind the kernels
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def fp8_operands(m: int, k: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    sa, sb = fp8_max / a.abs().amax(), fp8_max / b.abs().amax()
    return (a * sa).to(torch.float8_e4m3fn), (b * sb).to(torch.float8_e4m3fn), 1 / sa, 1 / sb


def variants_of(a8: torch.Tensor, b8: torch.Tensor, inv_sa: torch.Tensor,
                inv_sb: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The timed calls of one shape: a8 (M, K) and b8 (N, K) e4m3, their inverse scales 0-d."""
    from quack.gemm import gemm

    m, n = a8.shape[0], b8.shape[0]
    a16, b16 = (a8.float() * inv_sa).bfloat16(), (b8.float() * inv_sb).bfloat16()
    rows, cols = inv_sa.expand(m, 1).contiguous(), inv_sb.expand(1, n).contiguous()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    alpha = (inv_sa * inv_sb).item()
    bf16 = torch.bfloat16
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "cuBLAS bf16": lambda: a16 @ b16.t(),
        "_scaled_mm per-tensor": lambda: torch._scaled_mm(a8, b8.t(), inv_sa, inv_sb, out_dtype=bf16),
        "_scaled_mm per-tensor fast": lambda: torch._scaled_mm(a8, b8.t(), inv_sa, inv_sb, out_dtype=bf16,
                                                               use_fast_accum=True),
        "_scaled_mm per-row": lambda: torch._scaled_mm(a8, b8.t(), rows, cols, out_dtype=bf16),
    }
    for tm, tn, pingpong, cm, cn in QUACK_TILES:
        def quack_fp8(tm=tm, tn=tn, pingpong=pingpong, cm=cm, cn=cn) -> torch.Tensor:
            gemm(a8, b8, out, None, None, tm, tn, cm, cn, pingpong=pingpong, persistent=True, alpha=alpha)
            return out
        variants[f"QuACK {tm}x{tn} {'pingpong' if pingpong else 'coop'} c{cm}x{cn}"] = quack_fp8
    return variants


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm: needs a CUDA GPU (sm_90)")
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for i, (name, (m, k, n)) in enumerate(SHAPES.items()):
        a8, b8, inv_sa, inv_sb = fp8_operands(m, k, n, seed=i)
        truth = (a8.float() @ b8.float().t()) * (inv_sa * inv_sb)
        floor = ((truth.bfloat16().float() - truth).norm() / truth.norm()).item()
        variants = variants_of(a8, b8, inv_sa, inv_sb)
        for variant, fn in variants.items():
            error = ((fn().float() - truth).norm() / truth.norm()).item()
            ms = median_ms(fn, args.samples, args.calls)
            row = {"shape": name, "variant": variant, "ms": ms, "tflops": 2 * m * n * k / ms / 1e9,
                   "error_over_bf16_rounding": error / floor}
            results.append(row)
            print(f"{name:11s} {variant:34s} {ms:7.3f} ms {row['tflops']:6.0f} TFLOP/s "
                  f"error/rounding {row['error_over_bf16_rounding']:.2f}", flush=True)
        del truth
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
