"""Checkpoints through the trainer: kill-and-resume bit for bit, resume of a resume, 2 processes onto
1, non-finite losses, HF exports during training and init_from finetuning."""

import itertools
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from mesh_runs import launch
from torch.distributed.tensor import DTensor

from codatrain.config import load_config, validate
from codatrain.model import Llama
from codatrain.model.hf import HFCheckpoint
from codatrain.train.checkpoint import CheckpointMismatch, inspect_checkpoint
from codatrain.train.distributed import init_distributed
from codatrain.train.hf_io import export_checkpoint_to_hf
from codatrain.train.logger import LOG_FILE, read_losses, read_records
from codatrain.train.trainer import NonFiniteError, Trainer, train

STEPS = 8
FAST = [
    "train.log_every=1", "train.val_every=0", "train.progress=false", "data=synthetic",
    "data.num_workers=0", "data.seq_len=64", "train.micro_batch_size=4", "train.tokens_per_step=512",
    "optim.warmup_steps=2", f"train.steps={STEPS}",
]


class Crash(Exception):
    """Stands in for the process being killed."""


def run(run_dir, *overrides):
    return train(load_config([*FAST, f"train.run_dir={run_dir}", *overrides]))


def crash_on_step_call(monkeypatch, n: int) -> None:
    """The n-th optimizer step of the next run raises before it computes anything."""
    original, calls = Trainer.train_step, itertools.count(1)

    def train_step(self, batches):
        if next(calls) == n:
            raise Crash
        return original(self, batches)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def nan_loss_on_steps(monkeypatch, steps: set[int], grad_accum: int = 2) -> None:
    """The training loss of the given optimizer steps (1-based, this run) becomes NaN."""
    original, calls = Llama.forward, itertools.count()

    def forward(self, tokens, targets=None, **options):
        out = original(self, tokens, targets, **options)
        if targets is not None and next(calls) // grad_accum + 1 in steps:
            return out * float("nan")
        return out

    monkeypatch.setattr(Llama, "forward", forward)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    return run(tmp_path_factory.mktemp("full"), "checkpoint.at_end=false").losses


def test_kill_and_resume_matches_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch, uninterrupted):
    with monkeypatch.context() as patch:
        crash_on_step_call(patch, 4)  # dies during step 4, after the checkpoint of step 2
        with pytest.raises(Crash):
            run(tmp_path, "checkpoint.every=2")
    with monkeypatch.context() as patch:
        crash_on_step_call(patch, 4)  # resumes at 2, saves 4, dies during step 6
        with pytest.raises(Crash):
            run(tmp_path, "checkpoint.every=2")
    final = run(tmp_path, "checkpoint.every=2")  # a resume of the resume, from step 4
    assert final.losses == {s: uninterrupted[s] for s in range(5, STEPS + 1)}
    assert read_losses(tmp_path) == uninterrupted  # steps 1-3, 3-5 and 5-8 of the three runs
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]


def test_a_plain_process_saves_after_validation_and_resumes_bit_for_bit(tmp_path, uninterrupted):
    """The README's plain `python scripts/train.py` shards its model with FSDP2 too (one precision
    path): its saves follow evaluation forwards, which leave FSDP2's root unsharded until
    `reshard_after_eval`, and a resume from one trains on as the run that never stopped."""
    validating = ["train.val_every=4", "train.val_batches=2", "checkpoint.every=4"]
    first = run(tmp_path / "a", *validating)
    assert first.losses == uninterrupted and sorted(first.val_losses) == [4, 8]
    resumed = run(tmp_path / "b", *validating, f"checkpoint.resume={tmp_path / 'a/checkpoints/step_4'}")
    assert resumed.losses == {s: uninterrupted[s] for s in range(5, STEPS + 1)}
    assert resumed.val_losses == {8: first.val_losses[8]}


def test_eager_and_coda_resume_each_others_checkpoints(tmp_path, uninterrupted):
    run(tmp_path / "eager", "checkpoint.every=4", "checkpoint.at_end=false")
    coda = run(tmp_path / "coda", f"checkpoint.resume={tmp_path / 'eager/checkpoints/step_4'}",
               "block=coda", "block.backend=reference", "checkpoint.every=6")
    back = run(tmp_path / "back", f"checkpoint.resume={tmp_path / 'coda/checkpoints/step_6'}")
    # fp32: the CODA stages round differently from the eager modules, nothing more.
    assert coda.losses == pytest.approx({s: uninterrupted[s] for s in range(5, 9)}, rel=1e-5)
    assert back.losses == pytest.approx({s: uninterrupted[s] for s in range(7, 9)}, rel=1e-5)


def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, uninterrupted):
    with monkeypatch.context() as patch:
        nan_loss_on_steps(patch, {5})
        with pytest.raises(NonFiniteError, match="step 5: loss nan.*not finite"):
            run(tmp_path, "checkpoint.every=2")
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_4"]
    assert inspect_checkpoint(checkpoints / "step_4")["step"] == 4
    resumed = run(tmp_path, "checkpoint.every=2")
    assert resumed.losses == {s: uninterrupted[s] for s in range(5, STEPS + 1)}


def test_the_error_that_stops_a_run_ends_its_train_log(tmp_path, monkeypatch):
    # train.log keeps the console's lines, but the error went to the console alone: the log of a
    # diverged run stopped after its last record, with no word of why.
    with monkeypatch.context() as patch:
        nan_loss_on_steps(patch, {3})
        with pytest.raises(NonFiniteError) as error:
            run(tmp_path)
    last = (tmp_path / LOG_FILE).read_text().splitlines()[-1]
    assert last == f"error: NonFiniteError: {error.value}"
    assert last.startswith("error: NonFiniteError: step 3: ")


def test_skip_nonfinite_steps_skips_up_to_n(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        nan_loss_on_steps(patch, {3})
        result = run(tmp_path / "a", "train.skip_nonfinite_steps=1")
    assert result.final_step == STEPS
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result.losses.values())
    with monkeypatch.context() as patch:
        nan_loss_on_steps(patch, {3, 4})  # the second bad step is one too many
        with pytest.raises(NonFiniteError, match="skip_nonfinite_steps=1"):
            run(tmp_path / "b", "train.skip_nonfinite_steps=1")


def test_a_skipped_step_leaves_the_weights_as_they_were(tmp_path, monkeypatch):
    original, calls, weights = Llama.forward, itertools.count(), {}

    def forward(self, tokens, targets=None, **options):  # two micro-batches a step
        n = next(calls)
        if n in (2, 4, 6):  # the start of steps 2 and 3, and of step 3's second attempt
            weights[n] = [p.full_tensor().clone() if isinstance(p, DTensor) else p.detach().clone()
                          for p in self.parameters()]
        out = original(self, tokens, targets, **options)
        return out * float("nan") if n in (4, 5) else out

    monkeypatch.setattr(Llama, "forward", forward)
    result = run(tmp_path, "train.skip_nonfinite_steps=1", "train.steps=4")
    assert result.final_step == 4 and next(calls) == 10
    # Step 2's update changed the weights; the non-finite step's, launched before its loss was
    # read, changed nothing.
    assert not all(torch.equal(a, b) for a, b in zip(weights[2], weights[4], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights[4], weights[6], strict=True))


def trainer(run_dir, *overrides) -> Trainer:
    cfg = load_config([*FAST, f"train.run_dir={run_dir}", *overrides])
    return Trainer(validate(cfg), init_distributed("cpu"))


def test_hf_exports_during_training_and_init_from_finetuning(tmp_path):
    run(tmp_path / "pre", "train.steps=4", "checkpoint.save_hf_every=3")
    exports = tmp_path / "pre/hf"
    assert sorted(p.name for p in exports.iterdir()) == ["step_3", "step_4"]  # every 3, and the end
    # The live export (gathered from the model) equals the export of the final checkpoint.
    export_checkpoint_to_hf(tmp_path / "pre/checkpoints/step_4", tmp_path / "offline")
    live, offline = HFCheckpoint(exports / "step_4"), HFCheckpoint(tmp_path / "offline")
    assert live.keys() == offline.keys()
    assert all(torch.equal(live.get(k), offline.get(k)) for k in live.keys())

    finetune = trainer(tmp_path / "ft", f"checkpoint.init_from={exports / 'step_4'}")
    assert finetune.step == 0 and not finetune.optimizer.state
    for name, param in finetune.model.named_parameters():
        assert torch.equal(param.full_tensor(), live.canonical(name)), name
    finetune.close()

    with pytest.raises(ValueError, match=r"n_layers: 4 there, 3 here.*model\.n_layers=4"):
        trainer(tmp_path / "bad", f"checkpoint.init_from={exports / 'step_4'}", "model.n_layers=3")


# Validation on, as in the README's torchrun command: each save follows an evaluation forward,
# which left FSDP2's root unsharded and lost the run (KeyError in get_optimizer_state_dict).
# 3 validation batches: not a multiple of 2 ranks, so one rank's second forward is left out.
WITH_VALIDATION = [o for o in FAST if not o.startswith("train.val_every=")] + [
    "train.val_every=4", "train.val_batches=3"
]
# A tied head and scaled RoPE, validation and checkpoints on.
TIED_LLAMA3 = [o for o in FAST if not o.startswith("train.val_every=")] + [
    "train.val_every=4", "train.val_batches=2", "model.tie_embeddings=true", "model.rope_type=llama3",
    "model.rope_factor=8", "model.rope_original_max_positions=32",  # windows of 64 reach past it
]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, Path]:
    """The two-process runs of the tests below, one after the other in one torchrun job of 2 FSDP2
    processes (tests/mesh_runs.py: its start-up paid once); the run dir of each."""
    root = tmp_path_factory.mktemp("two")
    dirs = {"eager": root / "eager", "tied_coda": root / "tied_coda"}
    launch(2, [[*WITH_VALIDATION, f"train.run_dir={dirs['eager']}", "checkpoint.every=4"],
               [*TIED_LLAMA3, "block=coda", "block.backend=reference", f"train.run_dir={dirs['tied_coda']}",
                "checkpoint.every=4"]], root)
    for name, run_dir in dirs.items():
        log = (run_dir / LOG_FILE).read_text()
        assert f"codatrain | block={name.removeprefix('tied_')}" in log, log
        assert " | 2 × cpu (full shard) | " in log and "step 4/8 | val loss" in log, log
    return dirs


@pytest.mark.slow
def test_resume_from_two_processes_onto_one(tmp_path, two_processes):
    two_dir = two_processes["eager"]
    two = read_losses(two_dir)
    step_4 = two_dir / "checkpoints/step_4"
    assert inspect_checkpoint(step_4)["world_size"] == 2
    assert inspect_checkpoint(two_dir / "checkpoints/step_8")["world_size"] == 2
    one = train(load_config([*WITH_VALIDATION, f"train.run_dir={tmp_path / 'one'}",
                             f"checkpoint.resume={step_4}"]))
    assert sorted(one.losses) == list(range(5, STEPS + 1))
    # The same windows per step (the data position is global); only the order of gradient sums
    # differs between 2 ranks and 2 accumulated micro-batches.
    for step, loss in one.losses.items():
        assert loss == pytest.approx(two[step], rel=1e-4), step
    # train.val_batches counts batches over all ranks: 1 and 2 processes validate on the same ones.
    two_val = {r["step"]: r["val_loss"] for r in read_records(two_dir) if "val_loss" in r}
    assert sorted(two_val) == [4, 8] and sorted(one.val_losses) == [8]
    assert one.val_losses[8] == pytest.approx(two_val[8], rel=1e-4)


@pytest.mark.slow
def test_tied_llama3_coda_model_under_fsdp2_resumes_on_one_eager_process(tmp_path, two_processes):
    """A tied head and scaled RoPE under FSDP2 (the shared matrix in the root's group), with
    validation and checkpoints on: the checkpoint holds no head tensor, and one eager process
    resumed from it trains on as the two CODA processes did (a wrong gradient of the shared matrix
    would part them from step 6)."""
    two_dir = two_processes["tied_coda"]
    two = read_losses(two_dir)
    step_4 = two_dir / "checkpoints/step_4"
    export_checkpoint_to_hf(step_4, tmp_path / "hf")
    assert "lm_head.weight" not in HFCheckpoint(tmp_path / "hf").keys()
    one = train(load_config([*TIED_LLAMA3, f"train.run_dir={tmp_path / 'one'}",
                             f"checkpoint.resume={step_4}"]))
    assert sorted(one.losses) == list(range(5, STEPS + 1))
    for step, loss in one.losses.items():
        assert loss == pytest.approx(two[step], rel=1e-4), step


def test_a_run_dir_that_holds_another_experiment_says_so_and_how_to_go_on(tmp_path):
    """Two experiments with the default run dir of their preset: the second is told that the folder
    is another experiment's, why, and how to start its own or resume that one."""
    run(tmp_path, "train.steps=2")
    way_out = ("Start this one in a directory of its own (train.run_dir=<a new directory>), or resume that "
               "one with the settings it was started with")
    step_2 = tmp_path / "checkpoints" / "step_2"
    with pytest.raises(CheckpointMismatch, match=re.escape(
            f"train.run_dir={tmp_path} holds another experiment: {step_2}: the training data state was saved "
            "with seq_len=64, but this run has seq_len=32: the data or its order changed, so it cannot "
            f"continue exactly. {way_out}")):
        run(tmp_path, "data.seq_len=32")
    with pytest.raises(CheckpointMismatch, match=re.escape(
            f"train.run_dir={tmp_path} holds another experiment: checkpoint {step_2} holds a different model "
            f"(n_layers: 4 there, 1 here); to match it, set model.n_layers=4. {way_out}")):
        run(tmp_path, "model.n_layers=1")
    with pytest.raises(CheckpointMismatch, match=re.escape(
            f"checkpoint.resume={step_2} is another experiment's: {step_2}: the training data state")):
        run(tmp_path / "new", f"checkpoint.resume={step_2}", "data.seq_len=32")


def signal_during_step_call(monkeypatch, n: int, signum: signal.Signals) -> None:
    """The process receives `signum` during the n-th optimizer step of the next run."""
    original, calls = Trainer.train_step, itertools.count(1)

    def train_step(self, batches):
        if next(calls) == n:
            os.kill(os.getpid(), signum)
        return original(self, batches)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_sigterm_finishes_the_step_saves_and_the_resume_matches_the_uninterrupted_run(
        tmp_path, monkeypatch, uninterrupted, capsys):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as patch:
        signal_during_step_call(patch, 3, signal.SIGTERM)
        stopped = run(tmp_path)
    assert (stopped.stopped_by, stopped.final_step, sorted(stopped.losses)) == ("SIGTERM", 3, [1, 2, 3])
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    step_3 = tmp_path / "checkpoints" / "step_3"
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopped at step 3 by SIGTERM; checkpoint {step_3}; resume with the same command")
    final = run(tmp_path)
    assert final.stopped_by is None
    assert final.losses == {s: uninterrupted[s] for s in range(4, STEPS + 1)}


def test_ctrl_c_saves_only_when_the_last_checkpoint_is_older_than_the_budget(tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as patch:
        signal_during_step_call(patch, 3, signal.SIGINT)  # step 2 saved: one step old, under 2
        stopped = run(tmp_path, "checkpoint.every=2", "checkpoint.stop_save_after=2")
    assert (stopped.stopped_by, stopped.final_step) == ("SIGINT", 3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopped at step 3 by SIGINT; checkpoint {tmp_path / 'checkpoints' / 'step_2'}; resume with the "
        "same command")
    with monkeypatch.context() as patch:
        signal_during_step_call(patch, 1, signal.SIGINT)
        stopped = run(tmp_path / "never", "checkpoint.stop_save_after=0")
    assert stopped.final_step == 1 and not (tmp_path / "never" / "checkpoints").exists()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "stopped at step 1 by SIGINT; no checkpoint; start again with the same command")


def test_a_stop_before_the_first_step_saves_nothing(tmp_path, monkeypatch):
    original = Trainer.log_header

    def log_header(self):  # the last thing before the loop
        original(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "log_header", log_header)
    stopped = run(tmp_path)
    assert (stopped.stopped_by, stopped.final_step) == ("SIGTERM", 0)
    assert not (tmp_path / "checkpoints").exists()
