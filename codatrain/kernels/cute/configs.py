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
# FP8 operands (fp8_stages.py): QuACK adds the WGMMA accumulator into an fp32 copy after every
# k-tile, two accumulators per thread, which pingpong tiles (one warpgroup per tile) spill.
_COOPERATIVE_128x128 = sm90_config(128, 128, pingpong=False, cluster_m=1, cluster_n=2)
_COOPERATIVE_128x192 = sm90_config(128, 192, pingpong=False, cluster_m=1, cluster_n=2)

_CONFIGS: dict[str, GemmConfig] = {
    # forward (gemm_stages.py)
    "residual_rms": _PINGPONG_128x192,  # F3 down-proj (K = F > N)
    # F1 out-proj (K = attention width ≤ N = d): its epilogue stores two M × N tensors behind a
    # short mainloop, which 128×128 tiles hide better (docs/benchmarks.md), while F3's long
    # mainloop runs best in 128×192.
    "residual_rms_short_k": _PINGPONG_128x128,
    "rstd_swiglu": _PINGPONG_192x128,  # F2 gate/up
    "rstd_rope": _PINGPONG_192x128,  # F4 QKV
    "rstd": _PINGPONG_128x192,  # LM head, full logits
    "rstd_lse": _PINGPONG_128x192,  # LM head, loss
    # backward (gemm_bwd_stages.py)
    "rms_bwd": _PINGPONG_192x128,  # norm backward in the gate/up, QKV and LM-head dgrads
    # dSwiGLU's epilogue reads the pre-activation and writes two tensors per output element of a
    # short (K = d) mainloop: 128×128 tiles hide that traffic behind the next tile's mainloop.
    "dswiglu": _PINGPONG_128x128,
    # FP8 forward (fp8_stages.py), from the 8B-width sweep (docs/benchmarks.md, "FP8 forward stages")
    "fp8_residual_rms": _COOPERATIVE_128x128,  # F1 and F3
    "fp8_rstd_swiglu": _COOPERATIVE_128x192,  # F2
    "fp8_rstd_rope": _COOPERATIVE_128x192,  # F4
    # FP8 backward (fp8_bwd_stages.py): not swept yet, the forward's cooperative 128×128
    "fp8_rms_bwd": _COOPERATIVE_128x128,  # norm backward in the gate/up and QKV dgrads
    "fp8_dswiglu": _COOPERATIVE_128x128,  # dSwiGLU in the down-projection's dgrad
}
_overrides: dict[str, GemmConfig] = {}

STAGES = tuple(_CONFIGS)


def gemm_config(stage: str) -> GemmConfig:
    """The tile config of `stage` (one of STAGES)."""
    return _overrides.get(stage) or _CONFIGS[stage]


@contextlib.contextmanager
def overridden(stage: str, config: GemmConfig) -> Iterator[None]:
    """Run `stage` with `config` inside the block (for benchmarks: `bench_block.py --sweep`)."""
    if stage not in _CONFIGS:
        raise KeyError(f"no cute GEMM stage {stage!r}; known: {', '.join(STAGES)}")
    _overrides[stage] = config
    try:
        yield
    finally:
        del _overrides[stage]
