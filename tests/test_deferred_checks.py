"""Kernel checks deferred to the step's end (codatrain/kernels/checks.py): read at once outside a
training step, recorded inside one; a step in which one failed skips its update and is computed
again, on one process and when only one of two ranks failed."""

import itertools
from pathlib import Path

import pytest
import torch
from deferred_check_runs import FAILING_STEP
from mesh_runs import launch
from torch.distributed.tensor import DTensor

from codatrain.config import load_config
from codatrain.kernels import checks
from codatrain.model import Llama
from codatrain.train.logger import LOG_FILE, read_losses
from codatrain.train.trainer import train

FAST = ["train.log_every=1", "train.val_every=0", "train.progress=false", "data=synthetic",
        "data.num_workers=0", "data.seq_len=64", "train.micro_batch_size=4", "optim.warmup_steps=2",
        "train.steps=4", "checkpoint.at_end=false"]
RECOMPUTED = "a kernel's fast path was not exact on this step's data"


def test_a_check_is_read_at_once_outside_a_step_and_recorded_inside_one():
    assert checks.holds(torch.tensor(True)) and not checks.holds(torch.tensor(False))
    like = torch.zeros(())
    with checks.deferred_checks() as deferred:
        assert deferred.failed(like).item() == 0.0  # nothing recorded yet
        assert checks.holds(torch.tensor(True)) and checks.holds(torch.tensor(False))
        assert checks.holds(torch.tensor(True))  # a later check that holds keeps the failure
        failed = deferred.failed(like)
        with pytest.raises(RuntimeError, match="do not nest"), checks.deferred_checks():
            pass
    assert failed.dtype == torch.float32 and failed.item() == 1.0
    assert not checks.holds(torch.tensor(False))  # read at once again after the context


def run(run_dir: Path, *overrides: str):
    return train(load_config([*FAST, f"train.run_dir={run_dir}", "train.tokens_per_step=512", *overrides]))


def test_a_step_whose_check_failed_is_computed_again_as_if_read_at_once(tmp_path, monkeypatch):
    clean = run(tmp_path / "clean")
    original, calls, weights, deferred = Llama.forward, itertools.count(), {}, []

    def forward(self, tokens, targets=None, **options):  # two micro-batches a step
        n = next(calls)
        deferred.append(checks._active is not None)
        if n in (2, 4, 6):  # step 2's two attempts and step 3 begin
            weights[n] = [p.full_tensor().clone() if isinstance(p, DTensor) else p.detach().clone()
                          for p in self.parameters()]
        if n == 3:  # step 2's second micro-batch: its head's fast path out of range
            assert checks.holds(torch.tensor(False))  # recorded, taken to hold
        return original(self, tokens, targets, **options)

    monkeypatch.setattr(Llama, "forward", forward)
    failed = run(tmp_path / "failed")
    assert next(calls) == 10  # 4 steps of 2 micro-batches, and step 2 once more
    # Deferred until the failure; read at once in step 2's second attempt and every step after.
    assert deferred == [True] * 4 + [False] * 6
    assert failed.losses == clean.losses  # the recomputed step is the step read at once
    assert all(torch.equal(a, b) for a, b in zip(weights[2], weights[4], strict=True))  # no update
    assert not all(torch.equal(a, b) for a, b in zip(weights[4], weights[6], strict=True))
    log = (tmp_path / "failed" / LOG_FILE).read_text()
    assert log.count(RECOMPUTED) == 1 and f"step {2}: {RECOMPUTED}" in log
    assert "skipped" not in log  # not a non-finite step: nothing counts against skip_nonfinite_steps


@pytest.mark.slow
def test_a_check_failed_on_one_rank_recomputes_the_step_on_every_rank(tmp_path):
    """tests/deferred_check_runs.py fails a check on rank 1 alone: both ranks must compute the step
    again (their collectives stay paired) and train on as the run without the failure."""
    two = ["train.tokens_per_step=1024"]  # 2 micro-batches of 4 × 64 tokens on each of 2 ranks
    out = launch(2, [[*FAST, *two, f"train.run_dir={tmp_path / 'clean'}"],
                     [*FAST, *two, f"train.run_dir={tmp_path / 'failing'}"]], tmp_path,
                 script=str(Path(__file__).with_name("deferred_check_runs.py")))
    clean, failing = read_losses(tmp_path / "clean"), read_losses(tmp_path / "failing")
    assert sorted(failing) == [1, 2, 3, 4] and failing == clean, out[-2000:]
    log = (tmp_path / "failing" / LOG_FILE).read_text()
    assert log.count(RECOMPUTED) == 1 and f"step {FAILING_STEP}: {RECOMPUTED}" in log
    assert RECOMPUTED not in (tmp_path / "clean" / LOG_FILE).read_text()
