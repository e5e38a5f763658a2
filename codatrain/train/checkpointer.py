"""The trainer's side of checkpoints: when to save, what to resume, init_from, keep_last, HF exports.

The format itself (what a checkpoint holds and how it is read and checked) is in
codatrain/train/checkpoint.py; Hugging Face import and export in codatrain/train/hf_io.py.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from codatrain.config import CheckpointConfig
from codatrain.data.tokenizer import load_tokenizer
from codatrain.kernels.fp8 import Fp8Scaling
from codatrain.model.config import LlamaConfig
from codatrain.train.canonical_state import CanonicalMapping, full_canonical_tensors
from codatrain.train.checkpoint import (
    CHECKPOINTS_DIR,
    TMP_PREFIX,
    CheckpointError,
    CheckpointMismatch,
    Log,
    Stateful,
    checkpoint_dirs,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    process_rank,
    replace_dir,
    write_checkpoint,
)
from codatrain.train.distributed import barrier, decide_on_rank0, first_error_of_any_rank
from codatrain.train.hf_io import is_checkpoint, load_init_weights, save_hf_with_tokenizer

HF_EXPORTS_DIR = "hf"


class Checkpointer:
    """Saves and restores a training run: `restore()` once before training, `after_step()` after
    every optimizer step. Every rank calls both (they contain collectives)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike, model_cfg: LlamaConfig,
                 model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loaders: Mapping[str, Stateful],
                 log: Log, tokenizer: str = "byte", fp8_scaling: Fp8Scaling | None = None) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.fp8_scaling = fp8_scaling  # block.precision=fp8: the amax histories, saved and resumed
        self.tokenizer = tokenizer  # the data.tokenizer spec the run trains with, saved with its weights
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.model, self.optimizer, self.scheduler, self.loaders = model, optimizer, scheduler, loaders
        self.log = log
        self.mapping = CanonicalMapping(model)
        # Checkpoints whose checksums rank 0 has checked or written in this process: pruning counts
        # only verified ones and reads each at most once.
        self.verified: set[Path] = set()
        self.last_saved: tuple[int, Path] | None = None  # (step, directory) resumed from or saved last
        # The tokens trained before the step restore() returned, as the checkpoint counted them (None:
        # a checkpoint saved before they were recorded, or no resume).
        self.resumed_tokens_seen: int | None = None

    # ---- restore ------------------------------------------------------------------------------
    def restore(self) -> int:
        """Resume per `checkpoint.resume`, else start from `init_from` weights if set; returns the
        step training continues from. A resumable checkpoint takes precedence over `init_from`
        (an interrupted finetuning run continues from its own checkpoint)."""
        path = decide_on_rank0(self._resume_path, CheckpointError)
        if path is not None:
            if self.cfg.init_from:
                self.log(f"checkpoint.init_from={self.cfg.init_from} ignored: resuming from {path}")
            try:
                return self.load(Path(path))
            except CheckpointMismatch as error:
                raise CheckpointMismatch(self._mismatch_message(error)) from None
        if self.cfg.init_from:
            manifest = None
            if is_checkpoint(self.cfg.init_from):  # rank 0 checks it once, for every rank
                manifest = decide_on_rank0(lambda: inspect_checkpoint(self.cfg.init_from, log=self.log),
                                           CheckpointError)
            load_init_weights(self.model, self.cfg.init_from, self.model_cfg, self.log, manifest)
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
        else:
            path = Path(resume)
            if not path.exists():  # a misspelt keyword reads as a path
                raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint directory; "
                                      "checkpoint.resume takes auto, none or a step_<n> directory")
            inspect_checkpoint(path, log=self.log)  # a checkpoint named explicitly must be complete
        if path is None:
            return None
        self.verified.add(path)
        return str(path)

    def _mismatch_message(self, error: CheckpointMismatch) -> str:
        """What a run that cannot continue the checkpoint it would resume should do instead."""
        if self.cfg.resume != "auto":
            return (f"checkpoint.resume={self.cfg.resume} is another experiment's: {error}. Resume it with "
                    "the settings it was started with, or leave checkpoint.resume unset")
        return (f"train.run_dir={self.run_dir} holds another experiment: {error}. Start this one in a "
                "directory of its own (train.run_dir=<a new directory>), or resume that one with the "
                "settings it was started with")

    def load(self, path: Path) -> int:
        """Load everything from a checkpoint directory; returns its step. A checkpoint trained with
        another tokenizer than this run's is a CheckpointError: its data state and weights belong
        to that tokenizer's ids."""
        manifest = inspect_checkpoint(path, verify=False)
        recorded = manifest.get("tokenizer")
        if recorded is not None and recorded["fingerprint"] != load_tokenizer(self.tokenizer).fingerprint:
            raise CheckpointError(
                f"{path} was trained with the tokenizer {recorded['source']}, this run's is "
                f"{self.tokenizer}: resume with the same data.tokenizer, or start a new run from its weights "
                "(checkpoint.init_from) with another train.run_dir"
            )
        step = load_checkpoint(path, self.model_cfg, self.model, self.optimizer, self.scheduler, self.loaders,
                               self.mapping, self.log, self.fp8_scaling)
        self.last_saved = (step, path)
        self.resumed_tokens_seen = manifest.get("tokens_seen")
        return step

    # ---- save ---------------------------------------------------------------------------------
    def after_step(self, step: int, total_steps: int, tokens_seen: int) -> None:
        """Save a checkpoint and/or an HF export when one is due after optimizer step `step`, which
        ended with `tokens_seen` tokens trained."""
        final = step == total_steps
        if (self.cfg.every > 0 and step % self.cfg.every == 0) or (final and self.cfg.at_end):
            self.save(step, tokens_seen)
        if self.cfg.save_hf_every > 0 and (step % self.cfg.save_hf_every == 0 or final):
            self.export_hf(step)

    def on_stop(self, step: int, tokens_seen: int) -> Path | None:
        """The checkpoint a run stopped by a signal after `step` leaves: a new one when the last (or
        the start) is `checkpoint.stop_save_after` or more steps old, else the last one (None: none)."""
        last_step = self.last_saved[0] if self.last_saved else 0
        if self.cfg.stop_save_after > 0 and step - last_step >= self.cfg.stop_save_after:
            self.save(step, tokens_seen)
        return None if self.last_saved is None else self.last_saved[1]

    def save(self, step: int, tokens_seen: int) -> Path:
        """Write `<run_dir>/checkpoints/step_<step>` atomically (with the `tokens_seen` up to it); keep
        the newest `keep_last`.

        A failed save (a full disk, say) removes its partial directory and raises a CheckpointError
        on every rank; the checkpoints saved before stay as they were."""
        final = self.root / f"step_{step}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        decide_on_rank0(lambda: self._prepare(tmp), CheckpointError)
        error: Exception | None = None
        try:
            write_checkpoint(tmp, step, self.model_cfg, self.model, self.optimizer, self.scheduler,
                             self.loaders, self.mapping, tokens_seen, self.tokenizer, self.fp8_scaling)
            if process_rank() == 0:
                replace_dir(tmp, final)
        except (CheckpointError, OSError) as save_error:
            error = save_error
        message = first_error_of_any_rank(None if error is None else str(error))
        if message is not None:
            if process_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a partial save must not keep the disk full
            raise CheckpointError(
                f"saving {final} failed ({message}); removed the partial {tmp.name}, earlier checkpoints "
                "are kept"
            ) from error
        self.last_saved = (step, final)
        if process_rank() == 0:
            self.verified.add(final)  # its checksums were computed from the bytes written
            self._prune(keep=final)
            self.log(f"saved checkpoint {final}")
        barrier()
        return final

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):  # left by a crash during an earlier save
            shutil.rmtree(stale)
        tmp.mkdir()

    def _prune(self, keep: Path) -> None:
        """Delete verified checkpoints beyond the newest `keep_last` (never `keep`, the one just
        written). Incomplete or corrupted ones are left for inspection and never counted: a broken
        newest checkpoint does not push good ones out."""
        if self.cfg.keep_last <= 0:
            return
        good = []
        for _, path in checkpoint_dirs(self.root):
            if path not in self.verified:
                try:
                    inspect_checkpoint(path, log=self.log)
                except CheckpointError:
                    continue
                self.verified.add(path)
            good.append(path)
        for path in good[self.cfg.keep_last:]:
            if path != keep:
                shutil.rmtree(path)
                self.verified.discard(path)

    def export_hf(self, step: int) -> Path:
        """Write the current weights as an HF Llama directory `<run_dir>/hf/step_<step>`, with the
        run's tokenizer.

        A failed export (a full disk, an `hf` that is not a folder) removes its partial directory
        and raises a CheckpointError on every rank, as a failed save does; the checkpoints stay."""
        out = self.run_dir / HF_EXPORTS_DIR / f"step_{step}"
        tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
        tensors = full_canonical_tensors(self.model, self.mapping)
        error: OSError | None = None
        if process_rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                save_hf_with_tokenizer(tmp, self.model_cfg, tensors, self.tokenizer)
                replace_dir(tmp, out)
            except OSError as export_error:
                error = export_error
                shutil.rmtree(tmp, ignore_errors=True)  # a partial export must not keep the disk full
        # Every rank takes part in every gather: the other ranks, and rank 0 after an export that
        # failed part of the way (else the others would wait in the next gather for it).
        for _ in tensors:
            pass
        message = first_error_of_any_rank(None if error is None else f"{type(error).__name__}: {error}")
        if message is not None:
            raise CheckpointError(f"exporting Hugging Face weights to {out} failed ({message}); removed the "
                                  f"partial {tmp.name}, the checkpoints are kept") from error
        if process_rank() == 0:
            self.log(f"exported Hugging Face weights to {out}")
        barrier()
        return out
