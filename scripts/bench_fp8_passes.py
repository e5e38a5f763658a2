"""The memory-bound FP8 passes of the backward (the one-pass dSwiGLU, the one-pass norm backward, the
quantize into both orientations) at 8B widths, this checkout's against those of an earlier revision,
in one process (docs/benchmarks.md, session 18).

    python scripts/bench_fp8_passes.py --before 8841d09 [--json out.json]
    git show 8841d09:codatrain/kernels/cute/quantize.py > /tmp/q.py   # where the run has no git
    python scripts/bench_fp8_passes.py --before /tmp/q.py

The earlier `codatrain/kernels/cute/quantize.py` is read from git and loaded under other names (its
kernel classes, compile functions and torch ops renamed): QuACK's compile cache files kernels by
name and arguments, so two modules with the same names would share one compiled kernel and measure
one thing twice. Both versions run on the same inputs; their outputs are compared byte for byte.
Times are medians of 30; the bandwidth counts each pass's bytes read and written once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

M, D, F = 16384, 4096, 14336  # llama3_8b widths, 2 × 8192 tokens
QUANTIZE = "codatrain/kernels/cute/quantize.py"


def load_revision(revision: str):
    """`QUANTIZE` at `revision` (a git revision, or a copy of that file where there is no git, as on
    the GPU machine) as a module whose kernels and ops do not collide with this checkout's."""
    if Path(revision).is_file():
        source = Path(revision).read_text()
    else:
        source = subprocess.run(["git", "show", f"{revision}:{QUANTIZE}"], check=True, capture_output=True,
                                text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    source = re.sub(r"\bcompile_(quantize|dswiglu|rms)", r"before_compile_\1", source)
    source = source.replace('"codatrain::cute_', '"codatrain::before_cute_')
    source = re.sub(r"\b(\w+QuantizeKernel|QuantizeTransposeKernel|QuantizeKernel)\b", r"Before\1", source)
    path = Path(tempfile.mkdtemp()) / "quantize_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("quantize_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def median_ms(fn: Callable[[], None], iters: int = 30, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def passes(device: torch.device) -> dict[str, tuple[Callable, int]]:
    """name: (make(module) -> (run, outputs), bytes moved)."""
    from codatrain.kernels.cute.quantize import transpose_tiles

    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=bf16, generator=gen)

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, device=device, dtype=dtype)

    one = torch.ones(1, device=device)
    dy, preact = randn(M, F), randn(M, 2 * F)
    dn, x, residual_grad, gamma = randn(M, D), randn(M, D), randn(M, D), randn(D)
    rstd = torch.rand(M, device=device, generator=gen) + 0.5
    zdz = torch.randn(M, device=device, generator=gen)
    wide, narrow = transpose_tiles(M, 2 * F), transpose_tiles(M, D)

    def dswiglu(module):
        out = (empty(M, 2 * F, dtype=e4m3), empty(2 * F, M, dtype=e4m3), empty(F, M, dtype=e4m3),
               empty(*wide), empty(*wide), empty(M, 2 * F // 64))
        return lambda: module.dswiglu_quantize_fp8(dy, preact, one, one, *out, 0), out

    def rms_bwd(module):
        out = (empty(M, D, dtype=bf16), empty(M, D, dtype=e4m3), empty(D, M, dtype=e4m3),
               empty(D, M, dtype=e4m3), empty(*narrow), empty(*narrow), empty(narrow[0], D))
        inputs = (dn, x, residual_grad, gamma, rstd, zdz, one, one)
        return lambda: module.rms_bwd_quantize_fp8(*inputs, *out), out

    def quantize_both(module):
        out = (empty(M, 2 * F, dtype=e4m3), empty(2 * F, M, dtype=e4m3), empty(*wide))
        return lambda: module.quantize_transpose_fp8(preact, one, *out), out

    return {
        "dSwiGLU: dy, preact -> dpreact both ways, y_t": (dswiglu, 2 * M * F + 4 * M * F + 4 * M * F + M * F),
        "norm bwd + residual: dx bf16 and both ways, n_t": (rms_bwd, 3 * 2 * M * D + 2 * M * D + 3 * M * D),
        "quantize preact (M x 2F) into both orientations": (quantize_both, 4 * M * F + 4 * M * F),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True,
                        help="the git revision to compare against, or that revision's quantize.py")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_passes: needs a CUDA GPU (sm_90)")
    from codatrain.kernels.cute import quantize

    before, device = load_revision(args.before), torch.device("cuda")
    source = torch.empty(M, 2 * F, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    copy_ms = median_ms(lambda: target.copy_(source))
    copy_bytes = 2 * source.numel() * source.element_size()
    print(f"{torch.cuda.get_device_name()}: bf16 copy of M x 2F {copy_ms:.3f} ms "
          f"= {copy_bytes / copy_ms / 1e9:.2f} TB/s")
    print(f"{'pass':48s} {'before':>8s} {'after':>8s} {'ratio':>7s} {'TB/s':>6s}  outputs equal")
    results = {"device": torch.cuda.get_device_name(), "before": args.before, "copy_ms": copy_ms,
               "passes": {}}
    for name, (make, nbytes) in passes(device).items():
        (run_before, out_before), (run_after, out_after) = make(before), make(quantize)
        run_before()
        run_after()
        torch.cuda.synchronize()
        equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(out_before, out_after, strict=True))
        ms_before, ms_after = median_ms(run_before), median_ms(run_after)
        results["passes"][name] = {"before_ms": ms_before, "after_ms": ms_after, "bytes": nbytes,
                                   "equal": equal}
        print(f"{name:48s} {ms_before:8.3f} {ms_after:8.3f} {ms_after / ms_before:7.3f} "
              f"{nbytes / ms_after / 1e9:6.2f}  {equal}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
