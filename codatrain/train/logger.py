"""Console (rich) and wandb logging; only the main process logs."""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from codatrain.config import WandbConfig


class RunLogger:
    def __init__(self, enabled: bool, wandb_cfg: WandbConfig, run_cfg: DictConfig, run_dir: str,
                 total_steps: int, progress: bool) -> None:
        self.enabled = enabled
        self.console = Console(stderr=False)
        self.wandb_run = None
        if enabled and wandb_cfg.mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name,
                mode=wandb_cfg.mode, dir=run_dir,
                config=OmegaConf.to_container(run_cfg, resolve=True),  # the resolved config
            )
        # A live bar only on a terminal; in CI/log files the periodic lines carry the ETA instead.
        self.progress = None
        if enabled and progress and sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TimeRemainingColumn(), console=self.console, transient=True,
            )
            self.task = self.progress.add_task("train", total=total_steps)
            self.progress.start()

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb_run is not None:
            self.wandb_run.finish()
