"""Throughput, TFLOP/s and MFU (docs/design.md §6), and peak memory.

MFU is achieved model FLOPs over the device's dense bf16 peak. Devices not in the table (and CPUs)
have no MFU: it is reported as None ("n/a"), never estimated.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

# Dense (non-sparse) bf16 tensor-core peaks, FLOP/s, matched against torch.cuda.get_device_name().
# Order matters: the first substring that matches wins, so specific names precede generic ones.
DENSE_BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM / HBM3
    ("H800 PCIe", 756e12),
    ("H800", 989e12),  # SXM
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in DENSE_BF16_PEAK_FLOPS:
        if key in name:
            return flops
    return None


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # all processes together
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None  # fraction of peak, None when the peak is unknown


def throughput(
    tokens: int, seconds: float, world_size: int, flops_per_token: float, peak: float | None
) -> Throughput:
    """Rates for `tokens` trained (globally) in `seconds` of wall time."""
    total = tokens / seconds
    per_device = total / world_size
    achieved = per_device * flops_per_token
    return Throughput(total, per_device, achieved / 1e12, None if peak is None else achieved / peak)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # Linux reports KiB


def resident_memory_gib(device: torch.device) -> float | None:
    """GPU memory allocated right now; between steps that is the model's state alone (parameters
    and optimizer state: gradients are freed, activations gone), so peak − resident is what one
    step needs on top of it. None on CPU."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def alloc_retries(device: torch.device) -> int | None:
    """How often the CUDA caching allocator has found no free cached block and no free device
    memory for a request since the process started, and so released its whole cache
    (synchronizing the device) and tried again; None on CPU. Each retry stalls the step: the GPU
    drains and idles while the host frees and reallocates. Retries mean the step runs at the
    card's capacity (torchtitan warns on them too)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else None


def reserved_memory_gib(device: torch.device) -> float | None:
    """Peak memory the caching allocator held from the device (allocated plus its cached free
    blocks): what the card must have; None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"

