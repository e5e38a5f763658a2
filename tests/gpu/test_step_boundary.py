"""The host side of a training step on a GPU: the host reads the step's loss and gradient norm
without waiting for the optimizer's update, so its bookkeeping and the next step's launches run
while the device updates (trainer.py, `train_step`; design.md §5)."""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from codatrain.config import load_config, validate  # noqa: E402
from codatrain.kernels.cute import head  # noqa: E402
from codatrain.kernels.cute.head import SCALED_EXP_MAX_LOSS  # noqa: E402
from codatrain.kernels.stages import get_backend  # noqa: E402
from codatrain.train import trainer as trainer_module  # noqa: E402
from codatrain.train.distributed import init_distributed  # noqa: E402
from codatrain.train.logger import LOG_FILE  # noqa: E402
from codatrain.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.gpu

RUN = ["model=tiny", "block=eager", "train.device=cuda", "data=synthetic", "data.num_workers=0",
       "data.seq_len=64", "train.micro_batch_size=2", "train.tokens_per_step=null", "train.log_every=1",
       "train.val_every=0", "train.progress=false", "checkpoint.at_end=false"]
SLEEP_CYCLES = 2_000_000_000  # about a second of device time at Hopper's clocks


def test_the_step_returns_while_the_update_is_still_queued(tmp_path, monkeypatch):
    trainer = Trainer(validate(load_config([*RUN, f"train.run_dir={tmp_path}"])), init_distributed("cuda"))
    batches = iter(trainer.train_data)
    # A first step before the timed one: the first launch of a kernel may synchronize the context
    # (CUDA's lazy module loading), and the optimizer makes its state.
    trainer.train_step(batches)
    torch.cuda.synchronize()
    original = trainer_module.update_unless

    def slow_update(*args, **kwargs):  # the update queued behind a long device-side sleep
        torch.cuda._sleep(SLEEP_CYCLES)
        original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "update_unless", slow_update)
    shards = [p.to_local() for p in trainer.model.parameters()]  # FSDP2's DTensors, one process
    before = [shard.detach().clone() for shard in shards]
    outcome = trainer.train_step(batches)
    update_pending = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    moved = any(not torch.equal(a, b) for a, b in zip(before, shards, strict=True))
    trainer.close()
    assert update_pending, "train_step waited for the optimizer's update"
    assert math.isfinite(outcome.loss) and outcome.grad_norm > 0 and outcome.stopped_by is None
    assert moved  # the update did run, after train_step returned


# Document masking on (the loader's host-made layouts) and two micro-batches a step; the cute run at
# widths its kernels and FA4 take (head dim 64), its LM head on the scaled-exp pipeline (512 rows a
# micro-batch, not d = 256: the pipeline whose range check the step defers).
CUTE = ["block=coda", "block.backend=cute", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=64", "model.ffn_dim=704"]
SYNC_FREE_RUNS = {"eager": ["block=eager"], "coda-cute": CUTE,
                  "coda-cute-fp8": [*CUTE, "block.precision=fp8"]}
SEQ_LEN = 256


def sync_free_trainer(run: str, run_dir) -> Trainer:
    overrides = [*RUN, *SYNC_FREE_RUNS[run], "data.keep_document_boundaries=true", f"data.seq_len={SEQ_LEN}",
                 f"train.tokens_per_step={4 * SEQ_LEN}", f"train.run_dir={run_dir}"]
    trainer = Trainer(validate(load_config(overrides)), init_distributed("cuda"))
    assert trainer.grad_accum == 2
    if run.startswith("coda-cute"):
        cfg, rows = trainer.model_cfg, 2 * SEQ_LEN
        chunk_rows = get_backend("cute", "cuda").head_chunk_rows(cfg.vocab_size)
        assert head.scaled_exp_applies(rows, cfg.dim, cfg.vocab_size, chunk_rows)
    return trainer


@pytest.mark.parametrize("run", list(SYNC_FREE_RUNS))
def test_a_training_step_never_synchronizes_implicitly(tmp_path, run):
    """No operation of a step waits for the device behind the host's back (an `.item()`, a
    `nonzero`, a copy from pageable memory, the LM head's range check): CUDA's sync debug mode makes
    each one an error. The step's one deliberate wait, on the event after its loss and norm, is not
    such an operation. The host's part of the step (schedule, FP8 amax history) is in the window."""
    if run.startswith("coda-cute") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cute kernels need an sm_90 GPU")
    trainer = sync_free_trainer(run, tmp_path)
    batches = iter(trainer.train_data)
    trainer.train_step(batches)  # first launches, compilation and the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outcome = trainer.train_step(batches)
        trainer.complete_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    assert math.isfinite(outcome.loss) and outcome.grad_norm > 0


def test_a_step_past_the_heads_fast_range_is_computed_again_on_the_exact_path(tmp_path):
    """Logits in the hundreds (the LM head's weight scaled up): the scaled-exp pipeline's gradients
    would be NaN. The step's deferred range check fails, the update is skipped, and the step is
    computed again with the check read at once (the base pipeline): finite, and logged."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cute kernels need an sm_90 GPU")
    trainer = sync_free_trainer("coda-cute", tmp_path)
    head_weight = next(p for name, p in trainer.model.named_parameters() if name.endswith(".w_lm_head"))
    with torch.no_grad():
        head_weight.to_local().mul_(400.0)
    outcome = trainer.train_step(iter(trainer.train_data))
    trainer.close()
    log = (tmp_path / LOG_FILE).read_text()
    assert outcome.loss > SCALED_EXP_MAX_LOSS and math.isfinite(outcome.loss)
    assert math.isfinite(outcome.grad_norm) and outcome.grad_norm > 0
    assert "step 1: a kernel's fast path was not exact" in log, log
