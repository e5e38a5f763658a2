"""The trainer's side of checkpoints: when to save, what to resume, init_from, keep_last, HF exports.

The format itself (what a checkpoint holds and how it is read and checked) is in
codatrain/train/checkpoint.py; Hugging Face import and export in codatrain/train/hf_io.py.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from codatrain.config import CheckpointConfig
from codatrain.model.config import LlamaConfig
from codatrain.model.hf import save_hf
from codatrain.train.checkpoint import (
    CHECKPOINTS_DIR,
    TMP_PREFIX,
    CanonicalMapping,
    CheckpointError,
    Log,
    Stateful,
    checkpoint_dirs,
    full_canonical_tensors,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    process_rank,
    replace_dir,
    write_checkpoint,
)
from codatrain.train.distributed import barrier
from codatrain.train.hf_io import load_hf_weights

HF_EXPORTS_DIR = "hf"


class Checkpointer:
    """Saves and restores a training run: `restore()` once before training, `after_step()` after
    every optimizer step. Every rank calls both (they contain collectives)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike, model_cfg: LlamaConfig,
                 model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loaders: Mapping[str, Stateful],
                 log: Log) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.model, self.optimizer, self.scheduler, self.loaders = model, optimizer, scheduler, loaders
        self.log = log
        self.mapping = CanonicalMapping(model)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self) -> int:
        """Resume per `checkpoint.resume`, else start from `init_from` weights if set; returns the
        step training continues from. A resumable checkpoint takes precedence over `init_from`
        (an interrupted finetuning run continues from its own checkpoint)."""
        path = self._rank0_decides(self._resume_path)
        if path is not None:
            if self.cfg.init_from:
                self.log(f"checkpoint.init_from={self.cfg.init_from} ignored: resuming from {path}")
            return self.load(Path(path))
        if self.cfg.init_from:
            load_hf_weights(self.model, self.cfg.init_from, self.model_cfg, self.log)
        return 0

    def _resume_path(self) -> str | None:
        resume = self.cfg.resume
        if resume == "none":
            if checkpoint_dirs(self.root):
                raise CheckpointError(
                    f"checkpoint.resume=none, but {self.root} holds checkpoints of an earlier run that "
                    "later saves would mix with: resume them (checkpoint.resume=auto), or use another "
                    "train.run_dir"
                )
            return None
        if resume == "auto":
            path = latest_checkpoint(self.root, self.log)
            return None if path is None else str(path)
        inspect_checkpoint(resume)  # a checkpoint named explicitly must be complete
        return resume

    @staticmethod
    def _rank0_decides(decide: Callable[[], str | None]) -> str | None:
        """Run `decide` on rank 0 only (one scan of the file system, one set of warnings) and give
        its answer, or its error, to every rank (so no rank waits for an answer that never comes)."""
        answer: list[str | None] = [None, None]  # result, error
        if process_rank() == 0:
            try:
                answer[0] = decide()
            except CheckpointError as error:
                answer[1] = str(error)
            except Exception as error:  # an OSError, say: the other ranks must not hang
                answer[1] = f"{type(error).__name__}: {error}"
        if dist.is_initialized():
            dist.broadcast_object_list(answer, src=0)
        if answer[1] is not None:
            raise CheckpointError(answer[1])
        return answer[0]

    def load(self, path: Path) -> int:
        """Load everything from a checkpoint directory; returns its step."""
        return load_checkpoint(path, self.model_cfg, self.model, self.optimizer, self.scheduler, self.loaders,
                               self.mapping, self.log)

    # ---- save ---------------------------------------------------------------------------------
    def after_step(self, step: int, total_steps: int) -> None:
        """Save a checkpoint and/or an HF export when one is due after optimizer step `step`."""
        final = step == total_steps
        if (self.cfg.every > 0 and step % self.cfg.every == 0) or (final and self.cfg.at_end):
            self.save(step)
        if self.cfg.save_hf_every > 0 and (step % self.cfg.save_hf_every == 0 or final):
            self.export_hf(step)

    def save(self, step: int) -> Path:
        """Write `<run_dir>/checkpoints/step_<step>` atomically; keep the newest `keep_last`."""
        final = self.root / f"step_{step}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        rank = process_rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{TMP_PREFIX}*"):  # left by a crash during an earlier save
                shutil.rmtree(stale)
            tmp.mkdir()
        barrier()
        write_checkpoint(tmp, step, self.model_cfg, self.model, self.optimizer, self.scheduler, self.loaders,
                         self.mapping)
        if rank == 0:
            replace_dir(tmp, final)
            self._prune(keep=final)
            self.log(f"saved checkpoint {final}")
        barrier()
        return final

    def _prune(self, keep: Path) -> None:
        """Delete complete checkpoints beyond the newest `keep_last` (never `keep`, the one just
        written). Incomplete ones are left for inspection; they never count as resumable."""
        if self.cfg.keep_last <= 0:
            return
        complete = []
        for _, path in checkpoint_dirs(self.root):
            try:
                inspect_checkpoint(path)
            except CheckpointError:
                continue
            complete.append(path)
        for path in complete[self.cfg.keep_last:]:
            if path != keep:
                shutil.rmtree(path)

    def export_hf(self, step: int) -> Path:
        """Write the current weights as an HF Llama directory `<run_dir>/hf/step_<step>`."""
        out = self.run_dir / HF_EXPORTS_DIR / f"step_{step}"
        tensors = full_canonical_tensors(self.model, self.mapping)
        if process_rank() == 0:
            tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            save_hf(tmp, self.model_cfg, tensors)
            replace_dir(tmp, out)
            self.log(f"exported Hugging Face weights to {out}")
        else:
            for _ in tensors:  # take part in the gathers
                pass
        barrier()
        return out
