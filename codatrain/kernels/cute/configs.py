"""The GEMM tile config of every cute GEMM + epilogue stage, forward and backward.

Each was chosen by `scripts/bench_block.py --sweep` on an H200 at Llama-3.2-1B and Llama-3-8B
widths; the timings are in docs/benchmarks.md. A stage reads its config with `gemm_config` at
every call, and the sweep tries candidates with `overridden`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from quack.gemm_config import GemmConfig


def sm90_config(tile_m: int, tile_n: int, *, pingpong: bool, cluster_m: int, cluster_n: int) -> GemmConfig:
    """A Hopper GEMM config with the static persistent tile scheduler (QuACK's SM90 default)."""
    return GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        pingpong=pingpong,
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        is_dynamic_persistent=False,
        device_capacity=9,
    )


# QuACK keys its launch cache on the config object's identity, so each config is built once.
_PINGPONG_128x192 = sm90_config(128, 192, pingpong=True, cluster_m=2, cluster_n=1)
_PINGPONG_192x128 = sm90_config(192, 128, pingpong=True, cluster_m=1, cluster_n=2)
_PINGPONG_128x128 = sm90_config(128, 128, pingpong=True, cluster_m=1, cluster_n=2)
# FP8 operands (fp8_stages.py): QuACK's FP8 mainloop adds the WGMMA accumulator into an fp32 one
# after every k-tile, two accumulators per thread, which pingpong tiles (one warpgroup per tile)
# spill; on fast accumulation (FP8_FAST_ACCUM) it keeps one, and pingpong tiles take it.
_COOPERATIVE_128x128 = sm90_config(128, 128, pingpong=False, cluster_m=1, cluster_n=2)
# The FP8 backward epilogues stage C, a TileLoad and their outputs in shared memory, which in
# 128×128 tiles leaves the A/B pipeline 3 k-tiles (a latency-bound mainloop); 128×112 tiles leave
# 4–5 (QuACK's stage count at compile; docs/benchmarks.md, "FP8 backward tiles").
_COOPERATIVE_128x112 = sm90_config(128, 112, pingpong=False, cluster_m=2, cluster_n=1)

_CONFIGS: dict[str, GemmConfig] = {
    # forward (gemm_stages.py)
    # F3 down-proj (K = F > N): 192×128 (8B widths 1.059× cuBLAS against 128×192's 1.198×; 1B
    # 1.158× against 1.149×; docs/benchmarks.md, "session 12").
    "residual_rms": _PINGPONG_192x128,
    # F1 out-proj (K = attention width ≤ N = d): its epilogue stores two M × N tensors behind a
    # short mainloop, which 128×128 tiles hide better (docs/benchmarks.md).
    "residual_rms_short_k": _PINGPONG_128x128,
    "rstd_swiglu": _PINGPONG_192x128,  # F2 gate/up
    "rstd_rope": _PINGPONG_192x128,  # F4 QKV
    # F4 with the QK-norm: its per-head statistic needs tiles of whole heads (resolve.QKNORM_HEAD_DIMS
    # divide 128); QuACK found 192×128 clustered pingpong the best config for its own fused QK-norm +
    # RoPE epilogue.
    "rstd_qknorm_rope": _PINGPONG_192x128,
    "rstd": _PINGPONG_128x192,  # LM head, full logits
    "rstd_lse": _PINGPONG_128x192,  # LM head, loss
    # backward (gemm_bwd_stages.py)
    "rms_bwd": _PINGPONG_192x128,  # norm backward in the gate/up, QKV and LM-head dgrads
    # dSwiGLU's epilogue reads the pre-activation and writes two tensors per output element of a
    # short (K = d) mainloop: 128×128 tiles hide that traffic behind the next tile's mainloop.
    "dswiglu": _PINGPONG_128x128,
    # FP8 forward (fp8_stages.py), from the 8B-width sweeps (docs/benchmarks.md, "FP8 fast accumulation")
    "fp8_residual_rms": _COOPERATIVE_128x128,  # F1 and F3
    "fp8_rstd_swiglu": _PINGPONG_128x128,  # F2, fast accumulation
    "fp8_rstd_rope": _PINGPONG_128x128,  # F4, fast accumulation
    # F4 with the QK-norm: 128-column tiles hold whole heads, as in bf16 (pingpong on fast accumulation)
    "fp8_rstd_qknorm_rope": _COOPERATIVE_128x128,
    # FP8 backward (fp8_bwd_stages.py)
    "fp8_rms_bwd": _COOPERATIVE_128x112,  # norm backward in the gate/up and QKV dgrads
    "fp8_dswiglu": _COOPERATIVE_128x112,  # dSwiGLU in the down-projection's dgrad
}
# The FP8 stages that run on fast accumulation (the tensor cores' adder keeps about 14 bits): those
# whose outputs still meet the stage tests' criterion with it (tests/gpu/test_cute_fp8_backend.py).
# F1/F3's Σx² and the backward stages' dγ and Σ g·dg + u·du do not (docs/benchmarks.md, "FP8 fast
# accumulation"); they take it only when a run asks (block.fp8_fast_accum), in these tiles.
FP8_FAST_ACCUM = frozenset({"fp8_rstd_swiglu", "fp8_rstd_rope", "fp8_rstd_qknorm_rope"})
_FP8_FAST_CONFIGS: dict[str, GemmConfig] = {
    "fp8_residual_rms": _PINGPONG_128x128,
    "fp8_rms_bwd": _PINGPONG_128x128,
    "fp8_dswiglu": _PINGPONG_128x128,
    "fp8_rstd_qknorm_rope": _PINGPONG_128x128,
}
_overrides: dict[str, tuple[GemmConfig, bool | None]] = {}

STAGES = tuple(_CONFIGS)


def gemm_config(stage: str) -> GemmConfig:
    """The tile config of `stage` (one of STAGES)."""
    return _overrides[stage][0] if stage in _overrides else _CONFIGS[stage]


def fp8_stage_config(stage: str, fast_accum: bool) -> tuple[GemmConfig, bool]:
    """The tile config of FP8 stage `stage` and whether its mainloop runs on fast accumulation: its
    own choice (FP8_FAST_ACCUM), or, in a run that asks for it (`fast_accum`), every stage fast."""
    fast = fast_accum or stage in FP8_FAST_ACCUM
    if stage in _overrides:
        config, fast_override = _overrides[stage]
        return config, fast if fast_override is None else fast_override
    return (_FP8_FAST_CONFIGS.get(stage, _CONFIGS[stage]) if fast else _CONFIGS[stage]), fast


@contextlib.contextmanager
def overridden(stage: str, config: GemmConfig, *, fast_accum: bool | None = None) -> Iterator[None]:
    """Run `stage` with `config` (and, for an FP8 stage, on fast accumulation or not unless None)
    inside the block (for benchmarks, `bench_block.py --sweep` and `--fp8-sweep`, and GPU tests)."""
    if stage not in _CONFIGS:
        raise KeyError(f"no cute GEMM stage {stage!r}; known: {', '.join(STAGES)}")
    _overrides[stage] = (config, fast_accum)
    try:
        yield
    finally:
        del _overrides[stage]
