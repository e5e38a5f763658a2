"""The training loop: one code path for a plain `python` run and for N processes under torchrun."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from codatrain.config import RunConfig, validate
from codatrain.data import build_loaders
from codatrain.kernels.checks import deferred_checks
from codatrain.kernels.stages import IGNORE_INDEX
from codatrain.model import build_model
from codatrain.train.attempts import Attempt, restarted_by_agent, sigterm_raises
from codatrain.train.canonical_state import init_weights
from codatrain.train.checkpoint import CHECKPOINTS_DIR, checkpoint_dirs
from codatrain.train.checkpointer import Checkpointer
from codatrain.train.distributed import (
    DistInfo,
    all_reduce_max_,
    all_reduce_sum,
    barrier,
    first_error_of_any_rank,
    init_distributed,
    shutdown_distributed,
)
from codatrain.train.float8 import apply_float8
from codatrain.train.fp8_allgather import refresh_scales, wrap_fp8_weights
from codatrain.train.kernel_cache import KernelCache
from codatrain.train.logger import LOG_FILE, RunLogger, format_duration
from codatrain.train.metrics import (
    alloc_retries,
    format_mfu,
    peak_flops,
    peak_memory_gib,
    reserved_memory_gib,
    resident_memory_gib,
    throughput,
)
from codatrain.train.optim import apply_recipe, build_optimizer, build_scheduler, update_unless
from codatrain.train.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    data_parallel_rank,
    device_mesh,
    reshard_after_eval,
)
from codatrain.train.plan import build_run_plan
from codatrain.train.profiling import StepProfiler
from codatrain.train.run_lock import RunDirLock
from codatrain.train.stopping import StopSignals

CONFIG_RECORD_DIR = ".hydra"  # where Hydra's output_subdir was: the composed config and overrides


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> mean loss over ranks
    val_losses: dict[int, float] = field(default_factory=dict)
    final_step: int = 0
    stopped_by: str | None = None  # "SIGTERM" or "SIGINT" when a signal stopped the run early


class StepOutcome(NamedTuple):
    """What the host reads of an optimizer step (train_step)."""

    loss: float  # the per-token mean over all ranks
    grad_norm: float
    amax_nonfinite: bool  # an FP8 amax of the step was inf or NaN
    data_time: float  # seconds spent waiting for data
    stopped_by: str | None  # a stop signal any rank received by the end of the step's launches


@dataclass
class StepTime:
    """Wall time spent in optimizer steps (not validation, checkpoints or logging): the rates count
    only that."""

    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0  # of which waiting for batches

    def add(self, seconds: float, data_seconds: float) -> None:
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        self.data_seconds += data_seconds


class Trainer:
    def __init__(self, run: RunConfig, dist_info: DistInfo) -> None:
        self.run, self.dist = run, dist_info
        device = dist_info.device
        tcfg = run.train
        torch.manual_seed(tcfg.seed)

        # Before any kernel can compile (or a CuTeDSL library load: resolving the block in the plan
        # loads them): point the CuTeDSL kernels at kernels.cache_dir, then rebuild it (or fail,
        # kernels.on_stale) when it was not built for this run and software.
        self.kernel_cache = KernelCache(run.kernels.cache_dir, dist_info)
        self.plan = plan = build_run_plan(run, device, dist_info.world_size, dist_info.local_world_size)
        self.kernel_cache.ensure(plan.kernel_shapes, run.kernels.on_stale)
        self.model_cfg = plan.model_cfg
        self.tokens_per_step, self.grad_accum = plan.tokens_per_step, plan.grad_accum

        # Build on the meta device, wrap, shard, then materialise: no process ever holds the full
        # model, and init is drawn per canonical tensor so it is the same for any sharding.
        with torch.device("meta"):
            model = build_model(self.model_cfg, plan.block, device, fp8=plan.fp8)
        # block.precision=fp8: the delayed-scaling state, training state beside the optimizer's.
        self.fp8_scaling = getattr(model, "fp8_scaling", None)
        if plan.fp8_all_gather:  # before the wrappers below: the model's own parameter names
            wrap_fp8_weights(model, plan.compute_dtype, plan.fp8.margin)
        if tcfg.float8 != "none":
            apply_float8(model, tcfg.float8, emulate=device.type != "cuda")
        if tcfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        if tcfg.compile:
            apply_compile(model)
        # FSDP2 at every world size, one process too: its policy computes in the plan's dtype, the
        # only place the compute dtype is applied. The loaders and validation split the batches by
        # the data-parallel rank; with data parallelism only, those are all the processes.
        mesh = device_mesh(device, plan.mesh)
        apply_fsdp(model, mesh, plan.compute_dtype)
        self.dp_rank, self.dp_size = data_parallel_rank(mesh), plan.mesh.size
        model.to_empty(device=device)
        init_weights(model, tcfg.seed)
        self.model = model

        self.optimizer = build_optimizer(model, run.optim)
        self.scheduler = build_scheduler(self.optimizer, run.optim, tcfg.steps)
        self.train_data, self.val_data = build_loaders(
            plan.data, tcfg.micro_batch_size, self.dp_rank, self.dp_size, tcfg.seed,
            device,
            max_seq_len=self.model_cfg.max_seq_len, model_vocab_size=self.model_cfg.vocab_size,
        )

        self.run_dir = tcfg.run_dir
        # Only the main process starts wandb; when it cannot, every rank stops with its error
        # (the others would wait in the next collective for a rank that is gone).
        try:
            self.logger, logger_error = RunLogger(run, enabled=dist_info.is_main), None
        except ValueError as error:
            logger_error = str(error)
        if (logger_error := first_error_of_any_rank(logger_error)) is not None:
            raise ValueError(logger_error)
        self.flops_per_token = self.model_cfg.flops_per_token(plan.data.seq_len)
        self.peak = peak_flops(device)
        # Resume (checkpoint.resume) or load init_from weights; before fit() starts the data iterators.
        self.checkpointer = Checkpointer(
            run.checkpoint, self.run_dir, self.model_cfg, model, self.optimizer, self.scheduler,
            {"train": self.train_data}, log=self.logger.info, tokenizer=plan.data.tokenizer,
            fp8_scaling=self.fp8_scaling,
        )
        self.step = self.checkpointer.restore()
        # Counted, not step × tokens_per_step: a resumed run may step by another batch size than
        # the steps before it (a checkpoint that did not record them counts them at this run's).
        resumed_tokens = self.checkpointer.resumed_tokens_seen
        self.tokens_seen = self.step * self.tokens_per_step if resumed_tokens is None else resumed_tokens
        if self.step > 0:  # resumed: the optimizer's values are this run's config, not the checkpoint's
            for change in apply_recipe(self.optimizer, self.scheduler, run.optim):
                self.logger.info(f"resumed with {change}")
            if resumed_tokens is None:
                self.logger.info("the checkpoint does not record the tokens trained (saved by an earlier "
                                 f"version): counting its {self.step} steps at this run's "
                                 f"{self.tokens_per_step} tokens a step")
        # Loop state: steps skipped as non-finite, the time since the last record and in this run,
        # and the bad data rows and allocator retries (the count at the last warning) already reported.
        self.skipped_steps, self.window, self.run_time = 0, StepTime(), StepTime()
        self.reported_rows, self.reported_retries = 0, 0
        self.defer_checks = True  # the kernels' checks read with the step's loss (train_step)
        self.stop = StopSignals(device)  # its handlers are set while fit() runs

    # ---- one optimizer step -------------------------------------------------------------------
    def train_step(self, batches) -> StepOutcome:
        """Forward/backward over `grad_accum` micro-batches: the gradients of one optimizer step,
        and the optimizer's update, which clips them, launched behind them.

        The step's loss is the sum of the token losses of all its micro-batches on all ranks divided
        by the number of their targets, counted before the first forward. So neither gradient
        accumulation nor the number of processes changes the gradient when micro-batches hold
        different numbers of targets (fine-tuning data), and a micro-batch without targets adds
        zero. The update is queued before the host reads the loss and norm and is skipped on the
        device when the loss, the gradient norm or an FP8 amax is not finite; `complete_step` or
        the skip path then does the host's part. The host waits only for those values, not for the
        update: its part of the step, and the next step's launches, run while the device updates.

        A kernel's checks on its own results (`kernels/checks.py`: the LM head's fast pipeline is
        exact only up to a per-row loss) are read with the loss, not one host sync each. A step in
        which one failed on any rank skips its update too and is computed again, each check read
        at once, so its gradients are those of the exact path; from then on this process reads
        them at once (data that failed a check once may again, and each failure would cost a step).
        """
        t0 = time.perf_counter()
        micro_batches = [next(batches) for _ in range(self.grad_accum)]
        data_time = time.perf_counter() - t0
        outcome, checks_failed = self._accumulate_and_update(micro_batches, data_time, self.defer_checks)
        if not checks_failed:
            return outcome
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp8_scaling is not None:
            self.fp8_scaling.discard_step()
        self.defer_checks = False
        self.logger.info(f"step {self.step + 1}: a kernel's fast path was not exact on this step's data "
                         "(the LM head's loss past its range); computing the step again on the exact path, "
                         "and reading such checks at once from here on (a host sync per micro-batch)")
        return self._accumulate_and_update(micro_batches, data_time, defer_checks=False)[0]

    def _accumulate_and_update(self, micro_batches: list, data_time: float,
                               defer_checks: bool) -> tuple[StepOutcome, bool]:
        """train_step on these micro-batches; also whether a deferred kernel check failed (then
        the update was skipped on the device)."""
        local_targets = sum((batch.targets != IGNORE_INDEX).sum() for batch in micro_batches)
        # The weights changed at the last optimizer step (or a checkpoint load): their FP8 scales.
        refresh_scales(self.model)
        # A step without any target gives a zero loss and zero gradients rather than 0 / 0.
        step_targets = all_reduce_sum(local_targets).clamp(min=1)
        # FSDP2 averages gradients over the data-parallel processes (both dimensions of an HSDP
        # mesh); their number turns that average into the sum.
        scale = self.dp_size / step_targets
        loss_sum = torch.zeros((), device=self.dist.device)
        with deferred_checks() if defer_checks else contextlib.nullcontext() as checks:
            for batch in micro_batches:
                loss = self.model(batch.inputs, batch.targets, documents=batch.documents, reduction="sum")
                (loss * scale).backward()
                loss_sum += loss.detach()
        checks_failed = checks.failed(loss_sum) if checks is not None else loss_sum.new_zeros(())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads).full_tensor()  # a DTensor: FSDP2's gradients
        # The stop flags and the failed checks ride on the loss's all-reduce: every rank learns of
        # them at this step.
        sums = all_reduce_sum(torch.cat([loss_sum.view(1), checks_failed.view(1), self.stop.on_device()]))
        largest_amax = loss_sum.new_zeros(())
        if self.fp8_scaling is not None:
            all_reduce_max_(self.fp8_scaling.step_amax)  # every rank records the same history
            largest_amax = self.fp8_scaling.step_amax.amax()  # inf or NaN if any amax is
        checked = torch.stack([sums[0] / step_targets, grad_norm, largest_amax])
        report = torch.cat([checked, sums[1:]])
        host_report = report.to("cpu", non_blocking=True)  # pinned: lands when the device gets here
        computed = torch.cuda.Event() if report.is_cuda else None
        if computed is not None:
            computed.record()
        # Clipping as torch's clip_grad_norm_ computes it (its 1e-6 included), applied by the update.
        clip = self.run.optim.grad_clip
        divisor = (grad_norm + 1e-6).div(clip).clamp(min=1.0) if clip > 0 else None
        skip = ((~torch.isfinite(checked).all()) | (sums[1] > 0)).float()
        update_unless(self.optimizer, skip, divisor)
        if computed is not None:
            computed.synchronize()
        loss, norm, amax, failed, *stop_sums = host_report.tolist()
        outcome = StepOutcome(loss, norm, not math.isfinite(amax), data_time, self.stop.name(stop_sums))
        return outcome, failed > 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token over the first `val_batches` batches of the held-out data,
        counted over all ranks together: the same batches each time, whatever the number of
        processes. Data-parallel rank r takes batches r, r + dp_size, ... (the loader's split);
        every rank runs the same number of forwards (FSDP2 gathers collectively), and one past the
        last batch leaves its loss out."""
        wanted, dp_size = self.run.train.val_batches, self.dp_size
        refresh_scales(self.model)  # the weights' FP8 scales, as a training step's
        loss_sum, targets = torch.zeros((), device=self.dist.device), torch.zeros((), device=self.dist.device)
        for i, batch in enumerate(itertools.islice(self.val_data, math.ceil(wanted / dp_size))):
            loss = self.model(batch.inputs, batch.targets, documents=batch.documents, reduction="sum")
            if i * dp_size + self.dp_rank < wanted:
                loss_sum += loss
                targets += (batch.targets != IGNORE_INDEX).sum()
        reshard_after_eval(self.model)
        return (all_reduce_sum(loss_sum) / all_reduce_sum(targets).clamp(min=1)).item()

    def validation_due(self) -> bool:
        every, steps = self.run.train.val_every, self.run.train.steps
        return self.val_data is not None and every > 0 and (self.step % every == 0 or self.step == steps)

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to `train.steps`, or stop at a step boundary on Ctrl-C or SIGTERM (stopping.py)."""
        with self.stop:
            return self._fit()

    def _fit(self) -> TrainResult:
        tcfg, result = self.run.train, TrainResult()
        self.log_header()
        if self.dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        batches = iter(self.train_data)
        run_started = time.perf_counter()
        self.logger.start(self.step)
        first_step = self.step + 1
        profiler = StepProfiler(self.run_dir, tcfg.profile_steps, tcfg.profile_skip, self.dist.rank,
                                self.dist.device)
        profiled = min(tcfg.profile_steps, tcfg.steps - self.step - tcfg.profile_skip - 1)
        if tcfg.profile_steps and profiled < tcfg.profile_steps:  # a resumed run, or a short one
            self.logger.info(f"warning: {tcfg.steps - self.step} steps are left to run, so the profile "
                             f"(after train.profile_skip={tcfg.profile_skip} and one warm-up step) covers "
                             + (f"{profiled} of train.profile_steps={tcfg.profile_steps}" if profiled > 0
                                else "none: no profile is written"))
        if self.step >= tcfg.steps:  # resumed from a checkpoint of a longer run, or of this one finished
            self.logger.info(f"resumed at step {self.step}, which train.steps={tcfg.steps} does not go past: "
                             "nothing to train (raise train.steps to go on)")
        result.stopped_by = self.stop.agreed()  # a signal before the first step; then each step's own
        while self.step < tcfg.steps and not result.stopped_by:
            step_started = time.perf_counter()
            loss, grad_norm, amax_nonfinite, data_time, result.stopped_by = self.train_step(batches)
            if not self.finite_or_skipped(loss, grad_norm) or not self.fp8_amax_finite(amax_nonfinite):
                continue
            lr = self.complete_step()
            for timing in (self.window, self.run_time):
                timing.add(time.perf_counter() - step_started, data_time)
            profiler.step()
            if self.step == first_step:
                self.logger.info(self.kernel_cache.first_step_report())
            result.losses[self.step] = loss
            self.logger.advance(self.step)
            record = self.train_record(loss, lr, grad_norm) if self.log_due() else {}
            if self.validation_due():
                record = {"step": self.step, **record, "val_loss": self.evaluate()}
                result.val_losses[self.step] = record["val_loss"]
            if record:
                self.logger.log(record)
                self.report_skipped_rows()
                self.report_alloc_retries(record)
            self.checkpointer.after_step(self.step, tcfg.steps, self.tokens_seen)
        profiler.stop()
        result.final_step = self.step
        if result.stopped_by:
            saved = self.checkpointer.on_stop(self.step, self.tokens_seen)
            then = f"checkpoint {saved}; resume with" if saved else "no checkpoint; start again with"
            self.logger.info(f"stopped at step {self.step} by {result.stopped_by}; {then} the same command")
            return result
        self.logger.info(self.summary(result, time.perf_counter() - run_started))
        return result

    def report_skipped_rows(self) -> None:
        """A warning when the stream skipped bad rows since the last one (data.on_bad_data=skip)."""
        count, last = self.train_data.skipped_rows
        if count > self.reported_rows:
            self.logger.info(f"warning: {count} bad data rows skipped so far on rank {self.dist.rank} "
                             f"(data.on_bad_data=skip); the last: {last}")
            self.reported_rows = count

    def report_alloc_retries(self, record: dict[str, Any]) -> None:
        """A warning when the CUDA caching allocator had to free its cache and retry: each retry
        synchronizes the device, so the step runs slower than its kernels. Warned at the first
        retries and again whenever the count has doubled since (a run at capacity retries every
        step; the count is in every metrics record)."""
        retries = record.get("alloc_retries")
        if retries is None or retries < max(1, 2 * self.reported_retries):
            return
        total = torch.cuda.get_device_properties(self.dist.device).total_memory / 2**30
        self.logger.info(
            f"warning: {retries} CUDA allocation retries by step {self.step} (no free memory: the "
            f"allocator freed its cache and synchronized the device, a stall each time; peak reserved "
            f"{record['reserved_memory_gib']:.2f} of {total:.2f} GiB): the step runs at the card's memory "
            "capacity; a smaller train.micro_batch_size avoids it")
        self.reported_retries = retries

    def finite_or_skipped(self, loss: float, grad_norm: float) -> bool:
        """True for a finite step. A non-finite one (its update was skipped on the device) drops
        its gradients and is skipped while `train.skip_nonfinite_steps` allows, else it stops the
        run (NonFiniteError)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp8_scaling is not None:
            self.fp8_scaling.discard_step()
        allowed = self.run.train.skip_nonfinite_steps
        if self.skipped_steps < allowed:
            self.skipped_steps += 1
            self.logger.info(f"step {self.step + 1}: non-finite loss {loss} / grad norm {grad_norm}; "
                             f"skipped ({self.skipped_steps}/{allowed})")
            return False
        raise NonFiniteError(
            f"step {self.step + 1}: loss {loss}, grad norm {grad_norm} is not finite; stopping "
            f"(train.skip_nonfinite_steps={allowed} allows skipping such steps)"
        )

    def fp8_amax_finite(self, amax_nonfinite: bool) -> bool:
        """True unless an FP8 amax of this step (over all ranks) is inf or NaN (`amax_nonfinite`,
        as train_step found it). Then the step's update was skipped on the device, its gradients and
        amaxes are dropped (the history keeps its values), and the run log says so in one line; a
        scale from such an amax would be meaningless."""
        if self.fp8_scaling is None or not amax_nonfinite:
            return True
        bad = self.fp8_scaling.nonfinite()  # the amaxes train_step reduced over the ranks
        self.optimizer.zero_grad(set_to_none=True)
        self.fp8_scaling.discard_step()
        self.logger.info(f"step {self.step + 1}: FP8 amax not finite ({', '.join(bad)}); update skipped, "
                         "the amax history kept")
        return False

    def complete_step(self) -> float:
        """The host's part of a finite step, whose update train_step launched: advance the schedule
        (and the FP8 amax history), drop the gradients; returns the lr the update used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        if self.fp8_scaling is not None:
            self.fp8_scaling.commit_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return lr

    def log_due(self) -> bool:
        return self.step % self.run.train.log_every == 0 or self.step == self.run.train.steps

    def train_record(self, loss: float, lr: float, grad_norm: float) -> dict[str, Any]:
        """The metrics of this step, its rates over the steps since the last record; starts a new
        window."""
        window, self.window = self.window, StepTime()
        rate = throughput(window.steps * self.tokens_per_step, window.seconds, self.dist.world_size,
                          self.flops_per_token, self.peak)
        return {
            "step": self.step, "tokens_seen": self.tokens_seen, "loss": loss, "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": rate.tokens_per_s, "tokens_per_s_per_device": rate.tokens_per_s_per_device,
            "tflops_per_device": rate.tflops_per_device, "mfu": rate.mfu,
            "step_time_s": window.seconds / window.steps, "data_time_s": window.data_seconds / window.steps,
            "peak_memory_gib": peak_memory_gib(self.dist.device),
            "resident_memory_gib": resident_memory_gib(self.dist.device),
            "reserved_memory_gib": reserved_memory_gib(self.dist.device),
            "alloc_retries": alloc_retries(self.dist.device),
        }

    def summary(self, result: TrainResult, elapsed: float) -> str:
        """The run's last line: where it ended, what it trained, how fast, and what it kept."""
        parts = [f"done: step {self.step}/{self.run.train.steps}"]
        if result.losses:
            parts.append(f"loss {result.losses[max(result.losses)]:.4f}")
        if result.val_losses:
            last = max(result.val_losses)
            parts.append(f"val loss {result.val_losses[last]:.4f} (step {last})")
        parts.append(f"{self.tokens_seen:,} tokens seen")
        parts.append(f"{format_duration(elapsed)} elapsed")
        if self.run_time.steps:
            rate = throughput(self.run_time.steps * self.tokens_per_step, self.run_time.seconds,
                              self.dist.world_size, self.flops_per_token, self.peak)
            parts.append(f"{rate.tokens_per_s:,.0f} tok/s, MFU {format_mfu(rate.mfu)} over "
                         f"{self.run_time.steps} steps")
        saved = checkpoint_dirs(f"{self.run_dir}/{CHECKPOINTS_DIR}")
        parts.append(f"checkpoint {saved[0][1]}" if saved else f"no checkpoint; run dir {self.run_dir}")
        return " | ".join(parts)

    def log_header(self) -> None:
        for line in self.plan.header():
            self.logger.info(line)
        for loader in (self.train_data, self.val_data):
            if loader is not None and loader.report:  # fine-tuning data: examples packed, cut, dropped
                self.logger.info(loader.report)

    def close(self) -> None:
        self.logger.close()


def _stopped_not_restarted(run: RunConfig, dist_info: DistInfo, attempt: Attempt) -> TrainResult:
    """A start by torchrun's agent (--max-restarts) after Ctrl-C or SIGTERM stopped the job: a
    stopped rank exits with 128 + the signal, which the agent takes for a failure and restarts, and
    only a signal to the agent itself ends it. So a stop of the workers alone would be undone: this
    start does not train, and ends as the stopped one did (so do the agent's further restarts)."""
    signal_name, step = attempt.previous_stop
    if dist_info.is_main:
        line = (f"not training: attempt {attempt.number - 1} was stopped at step {step} by {signal_name} and "
                "torchrun restarted it (--max-restarts); resume with the same command")
        print(line, flush=True)
        with open(os.path.join(run.train.run_dir, LOG_FILE), "a") as log:
            log.write(line + "\n")
    attempt.end(step, None, stopped_by=signal_name)
    barrier()
    return TrainResult(final_step=step, stopped_by=signal_name)


def train(cfg: DictConfig, config_record: dict[str, Any] | None = None) -> TrainResult:
    """Run a training job from a composed config (see configs/train.yaml); `config_record` (file
    name -> config) goes into `<run_dir>/.hydra/` once the job holds the run directory."""
    run = validate(cfg)
    dist_info = init_distributed(run.train.device)
    try:
        # One job per run directory, from before anything is read or written there.
        with RunDirLock(run.train.run_dir, dist_info.is_main), sigterm_raises():
            if config_record and dist_info.is_main:
                folder = Path(run.train.run_dir) / CONFIG_RECORD_DIR
                folder.mkdir(exist_ok=True)
                for name, config in config_record.items():
                    OmegaConf.save(config, folder / name)
            attempt, trainer = Attempt(run.train.run_dir, dist_info), None
            if attempt.previous_stop is not None and restarted_by_agent():
                return _stopped_not_restarted(run, dist_info, attempt)
            try:
                with attempt.record_signals(lambda: trainer.step if trainer else 0):
                    trainer = Trainer(run, dist_info)
                    if attempt.previous:  # a restart after a process died, or a relaunch after a failure
                        trainer.logger.info(f"restart: {attempt.previous}; resuming from step {trainer.step}")
                    result = trainer.fit()
                    barrier()  # no rank tears the process group down while another still talks to it
            except BaseException as error:
                attempt.end(trainer.step if trainer else 0, error)
                if trainer and isinstance(error, Exception):
                    trainer.logger.record_error(error)
                raise
            finally:
                if trainer:
                    trainer.close()
            attempt.end(trainer.step, None, stopped_by=result.stopped_by)
        return result
    finally:
        shutdown_distributed()
