"""AdamW and the learning-rate schedules (warmup + cosine, warmup-stable-decay, constant)."""

from __future__ import annotations

import math

import torch
from torch import nn

from codatrain.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not on norm weights); torch's fused kernels (CUDA and CPU),
    which take the device-side skip flag of `update_unless`."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True
    )


def update_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor,
                  grad_divisor: torch.Tensor | None = None) -> None:
    """Launch the optimizer's update, which its fused kernels skip on the device (parameters,
    moments and step counts left as they were) when `nonfinite`, a 0-d float32 tensor, is
    nonzero. So the update can be queued before the host knows whether the step is finite, and
    the host's launches overlap the step's last kernels instead of following a synchronization.
    The kernels divide each gradient by `grad_divisor` (0-d) as they read it: gradient clipping
    without a pass of its own over the gradients. Both are the inputs torch.amp.GradScaler hands
    fused optimizers (`found_inf`, `grad_scale`)."""
    optimizer.found_inf = nonfinite
    optimizer.grad_scale = grad_divisor
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        return floor + (1 - floor) * max(0.0, 1 - (step - decay_start) / decay_steps)
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of cosine, wsd, constant")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
