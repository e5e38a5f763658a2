"""Where the FP8 backward stages' time goes in cooperative tiles (docs/benchmarks.md, "FP8 fast
accumulation"): a QuACK FP8 GEMM whose epilogue only scales the sum, at the 8B gate/up dgrad shape
(K 28672) and F3's (K 14336), with A in e5m2 and e4m3, in cooperative 128×128 tiles promoting to
fp32 every k-tile, cooperative on fast accumulation, pingpong 128×128 on fast accumulation and
pingpong 128×64 promoted; then the norm-backward stage itself in its shipped config. Each against
cuBLAS's `_scaled_mm` of the same operands. Medians of 20 after 3 warm-up calls, on an sm_90 GPU.

    python scripts/bench_fp8_cooperative.py
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from quack.epilogue.frontend import EpiMod
from quack.epilogue.ops import Scalar

from codatrain.kernels.cute import fp8_bwd_stages
from codatrain.kernels.cute.configs import fp8_stage_config
from codatrain.kernels.cute.gemm_bwd_stages import rms_bwd_row_tiles
from codatrain.kernels.cute.pins import FastAccumEpiMod

M = 16384
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (label, pingpong, tile_n, fast accumulation)
TILES = [("coop128 promoted", False, 128, False), ("coop128 fast", False, 128, True),
         ("pp128 fast", True, 128, True), ("pp128x64 promoted", True, 64, False)]


def scaled(acc, s):
    """The epilogue: the sum times the dequantization scale."""
    return {"D": acc * s}


# By fast accumulation: QuACK's promoted mainloop, or fast accumulation.
SCALED = {False: EpiMod(scaled, ops={"s": Scalar("s")}),
          True: FastAccumEpiMod(scaled, ops={"s": Scalar("s")})}


def median_ms(fn: Callable[..., object], *args: object, iters: int = 20, warmup: int = 3,
              **kwargs: object) -> float:
    """Median time of fn(*args, **kwargs)."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_cooperative: needs a CUDA GPU (sm_90)")
    one = torch.ones((), device="cuda")
    for name, k, n in (("gate/up dgrad", 28672, 4096), ("F3 down", 14336, 4096)):
        for a_dtype in (E5M2, E4M3):
            a = torch.randn(M, k, device="cuda").to(a_dtype)
            b_t = torch.randn(n, k, device="cuda").to(E4M3)
            d = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
            base = median_ms(torch._scaled_mm, a, b_t.t(), one, one, out_dtype=torch.bfloat16)
            row = [f"{name:14s} A {str(a_dtype).split('_')[-1]:6s} _scaled_mm {base:.3f} ms"]
            for label, pingpong, tile_n, fast in TILES:
                t = median_ms(SCALED[fast].gemm, a, b_t.t(), d, None, epi_args={"s": one}, tile_M=128,
                              tile_N=tile_n, cluster_M=1, cluster_N=2, pingpong=pingpong, persistent=True,
                              b_kn=True)
                row.append(f"{label} {t:.3f} ({t / base:.3f}x)")
            print("  ".join(row), flush=True)
    d, k = 4096, 28672
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    rstd, zdz = torch.rand(M, device="cuda"), torch.randn(M, device="cuda")
    w_t = torch.randn(d, k, device="cuda").to(E4M3)
    dx, n_out = torch.empty_like(x), torch.empty_like(x)
    partials = torch.empty(rms_bwd_row_tiles(M, fp8_stage_config("fp8_rms_bwd", False)[0]), d, device="cuda")
    for a_dtype in (E5M2, E4M3):
        dz = torch.randn(M, k, device="cuda").to(a_dtype)
        base = median_ms(torch._scaled_mm, dz, w_t.t(), one, one, out_dtype=torch.bfloat16)
        t = median_ms(fp8_bwd_stages.fp8_gemm_rms_bwd, dz, w_t, one, x, gamma, rstd, zdz, x, dx, n_out,
                      partials, False)
        print(f"norm-backward stage (shipped config), dz {str(a_dtype).split('_')[-1]}: {t:.3f} ms "
              f"({t / base:.3f}x _scaled_mm {base:.3f})", flush=True)


if __name__ == "__main__":
    main()
