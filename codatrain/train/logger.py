"""Where a run's metrics go, and the one reader of them.

`RunLogger` (main process only) writes every message to the console (rich) and to
`<run_dir>/train.log`, and every metrics record to wandb and to `<run_dir>/metrics.jsonl`, one JSON
object per line. `read_records`, `read_losses` and `windowed` read such a file back (benchmarks,
loss-curve comparisons, tests).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import IO, Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from codatrain.config import RunConfig
from codatrain.train.metrics import format_mfu

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class RunLogger:
    """The sink of one run's messages and metrics records; does nothing when not `enabled`."""

    def __init__(self, run: RunConfig, enabled: bool) -> None:
        self.enabled, self.total_steps = enabled, run.train.steps
        self.run_dir = run.train.run_dir
        self.console = Console(stderr=False)
        self.log_file: IO[str] | None = None
        self.wandb_run = None
        self.failed = False  # record_error: the run ends on an error
        self.progress = None
        self.clock = (time.perf_counter(), 0)  # (when, at which step) the rates' ETA counts from
        if not enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self.log_file = open(os.path.join(self.run_dir, LOG_FILE), "a")  # noqa: SIM115 (closed by close())
        wandb_cfg = run.logger.wandb
        if wandb_cfg.mode != "disabled":
            import wandb

            try:
                self.wandb_run = wandb.init(
                    project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name,
                    mode=str(wandb_cfg.mode), dir=self.run_dir,
                    config=OmegaConf.to_container(OmegaConf.structured(run), enum_to_str=True),
                )
            except wandb.errors.Error as error:  # no API key, no network: before any step, one line
                self.close()
                raise ValueError(
                    f"logger.wandb.mode={wandb_cfg.mode}: wandb did not start: {error} (online runs need "
                    "`wandb login` or WANDB_API_KEY and the network; logger.wandb.mode=offline logs into "
                    "the run directory, for `wandb sync` later)"
                ) from None
        # A live bar only on a terminal; in CI/log files the periodic lines carry the ETA instead.
        if run.train.progress and sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TimeRemainingColumn(), console=self.console, transient=True,
            )
            self.task = self.progress.add_task("train", total=self.total_steps)
            self.progress.start()

    def start(self, step: int) -> None:
        """Training (re)starts after `step`: records of later steps, written by an earlier attempt
        that did not reach its next checkpoint, are dropped, so each step appears once."""
        self.clock = (time.perf_counter(), step)
        path = os.path.join(self.run_dir, METRICS_FILE)
        if self.enabled and os.path.exists(path):
            kept = [r for r in read_records(self.run_dir) if r["step"] <= step]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def info(self, message: str) -> None:
        if self.log_file is not None:  # the main process: the console shows what the file keeps
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)
            self.log_file.write(message + "\n")
            self.log_file.flush()

    def record_error(self, error: Exception) -> None:
        """The error that ends the run, into train.log only: the console shows it already (the
        script's error line or the traceback), and without it the log of a diverged or failed run
        just stops, with no word of why. wandb then closes the run as failed."""
        if self.log_file is not None:
            self.log_file.write(f"error: {type(error).__name__}: {error}\n")
            self.log_file.flush()
        self.failed = True  # wandb marks the run failed, not finished

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log(self, record: dict[str, Any]) -> None:
        """One metrics record of optimizer step `record["step"]`: a console line for its training
        metrics (`loss` and the rates) and one for its `val_loss`, whichever it holds."""
        if not self.enabled:
            return
        step = record["step"]
        if "loss" in record:
            self.info(self._train_line(record))
        if "val_loss" in record:
            self.info(f"step {step}/{self.total_steps} | val loss {record['val_loss']:.4f}")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=step)
        with open(os.path.join(self.run_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _train_line(self, r: dict[str, Any]) -> str:
        started, start_step = self.clock
        per_step = (time.perf_counter() - started) / max(r["step"] - start_step, 1)
        return (
            f"step {r['step']}/{self.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"gnorm {r['grad_norm']:.3f} | "
            f"{r['tokens_per_s']:,.0f} tok/s ({r['tokens_per_s_per_device']:,.0f}/dev) | "
            f"{r['tflops_per_device']:.2f} TFLOP/s/dev | MFU {format_mfu(r['mfu'])} | "
            f"mem {r['peak_memory_gib']:.2f} GiB | data {r['data_time_s'] * 1e3:.1f} ms/step | "
            f"eta {format_duration(per_step * (self.total_steps - r['step']))}"
        )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if self.failed else None)
        if self.log_file is not None:
            self.log_file.close()


def read_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl, in the order written. A last line cut short (a full
    disk, or a kill, in the middle of its write) is left out: it would stop every resume of the run
    (RunLogger.start rewrites the file), and it holds no whole record. Any other line that is not a
    record is a ValueError naming the file and line."""
    path = os.path.join(run_dir, METRICS_FILE)
    with open(path) as f:
        lines = f.readlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}, line {number}: not a metrics record ({error})") from None
    return records


def read_losses(run_dir: str | os.PathLike) -> dict[int, float]:
    """step → training loss from a run's metrics.jsonl (the later record of a step wins)."""
    return {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}


def windowed(losses: dict[int, float], window: int) -> dict[int, float]:
    """Mean loss of each complete window of `window` logged steps, keyed by the window's last step."""
    steps = sorted(losses)
    return {
        steps[i + window - 1]: statistics.fmean(losses[s] for s in steps[i : i + window])
        for i in range(0, len(steps) - window + 1, window)
    }
