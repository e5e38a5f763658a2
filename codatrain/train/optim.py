"""AdamW and the learning-rate schedules (warmup + cosine, warmup-stable-decay, constant)."""

from __future__ import annotations

import math

import torch
from torch import nn

from codatrain.config import OptimConfig


def group_hyperparameters(cfg: OptimConfig) -> list[dict[str, float | tuple[float, float]]]:
    """AdamW's values per parameter group: the matrices (weight decay), then the rest (none)."""
    shared = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    return [{**shared, "weight_decay": cfg.weight_decay}, {**shared, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not on norm weights); torch's fused kernels (CUDA and CPU),
    which take the device-side skip flag of `update_unless`."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": params, **values}
              for params, values in zip((decay, no_decay), group_hyperparameters(cfg), strict=True)]
    return torch.optim.AdamW(groups, fused=True)


def apply_recipe(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                 cfg: OptimConfig) -> list[str]:
    """After a resume, the run's optim.* values in force: a checkpoint's parameter groups and
    scheduler state carry the values it was trained with, which would otherwise silently win over
    the config the run's header prints. The next step's learning rate follows the run's schedule.
    Returns what changed, `key=new (the checkpoint was trained with old)` each, for the log."""
    changes = {}
    for group, values, base in zip(optimizer.param_groups, group_hyperparameters(cfg), scheduler.base_lrs,
                                   strict=True):
        saved = {"optim.lr": base, "optim.beta1": group["betas"][0], "optim.beta2": group["betas"][1],
                 "optim.eps": group["eps"], "optim.weight_decay": group["weight_decay"]}
        wanted = {"optim.lr": cfg.lr, "optim.beta1": cfg.beta1, "optim.beta2": cfg.beta2,
                  "optim.eps": cfg.eps, "optim.weight_decay": values["weight_decay"]}
        for key, value in wanted.items():
            if saved[key] != value:
                changes.setdefault(key, f"{key}={value} (the checkpoint was trained with {saved[key]})")
        group.update(betas=values["betas"], eps=values["eps"], weight_decay=values["weight_decay"],
                     initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    return list(changes.values())


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
        # A warmup that runs past the decay's start ends the stable phase at the peak and decays from
        # there: decaying on from where the decay would have been by then dropped the lr at once
        # (llama3_125m's 715 warmup steps in 800: from the peak to 0.58 of it in one step).
        decay_start = max(total_steps - max(1, round(cfg.decay_fraction * total_steps)), cfg.warmup_steps)
        decay_steps = max(1, total_steps - decay_start)
        if step < decay_start:
            return 1.0
        return floor + (1 - floor) * max(0.0, 1 - (step - decay_start) / decay_steps)
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of cosine, wsd, constant")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
