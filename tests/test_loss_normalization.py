"""The loss of an optimizer step is the sum of its token losses over every micro-batch and rank divided
by the number of its targets: accumulation and process count do not change the gradient when
micro-batches hold different numbers of targets, and a micro-batch without targets adds zero."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_coda import CONFIGS, assert_close_to, batch, canonical_grads, model_pair

from codatrain.config import load_config, validate
from codatrain.data import Batch
from codatrain.data.packing import collate
from codatrain.model.llama import IGNORE_INDEX
from codatrain.train.distributed import init_distributed
from codatrain.train.logger import read_losses
from codatrain.train.trainer import Trainer, train

SEQ = 16
BLOCKS = {"eager": ["block=eager"], "coda": ["block=coda", "block.backend=reference"]}


# ---- the models: reduction="sum" ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gqa2-L3", "mha-L1"])
def test_fp64_summed_loss_and_gradients_of_coda_match_eager(name):
    cfg = CONFIGS[name]
    eager, coda = model_pair(cfg, torch.float64, head_chunk_rows=5)
    tokens, targets = batch(cfg, 2, 13, ignore=True)
    expected = F.cross_entropy(eager(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    loss = coda(tokens, targets, reduction="sum")
    assert_close_to(loss, expected, 1e-10, "loss")
    # A scale applied outside (the trainer's 1 / step targets) reaches the LM head's backward.
    (expected * 0.37).backward()
    (loss * 0.37).backward()
    grads = canonical_grads(coda)
    for n, p in eager.named_parameters():
        assert_close_to(grads[n], p.grad, 1e-10, n)


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_a_batch_without_targets_sums_to_zero_with_zero_gradients(impl):
    cfg = CONFIGS["gqa2-L3"]
    model = model_pair(cfg, torch.float64)[impl == "coda"]
    tokens, targets = batch(cfg, 2, 9, ignore=False)
    loss = model(tokens, torch.full_like(targets, IGNORE_INDEX), reduction="sum")
    assert loss.item() == 0.0
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, n


# ---- the trainer: one optimizer step ----------------------------------------------------------------
def trainer(tmp_path, impl, micro_batch_size, accumulation, *overrides):
    cfg = load_config([
        *BLOCKS[impl], "data=synthetic", f"data.seq_len={SEQ}", "data.num_workers=0", "train.progress=false",
        "optim.grad_clip=0",  # the gradients compared are the raw ones
        f"train.micro_batch_size={micro_batch_size}",
        f"train.tokens_per_step={micro_batch_size * accumulation * SEQ}",
        f"train.run_dir={tmp_path / f'{impl}-{micro_batch_size}x{accumulation}'}", *overrides,
    ])
    return Trainer(validate(cfg), init_distributed("cpu"))


def uneven_rows():
    """4 rows of SEQ tokens holding 16, 3, 0 and 9 targets."""
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 256, (4, SEQ), generator=g)
    targets = torch.randint(0, 256, (4, SEQ), generator=g)
    for row, kept in enumerate([SEQ, 3, 0, 9]):
        targets[row, torch.randperm(SEQ, generator=g)[kept:]] = IGNORE_INDEX
    return inputs, targets


def step_gradients(t: Trainer, batches: list[Batch]) -> tuple[float, dict[str, torch.Tensor]]:
    loss, grad_norm = t.train_step(iter(batches))[:2]
    assert math.isfinite(loss) and math.isfinite(grad_norm)
    grads = {n: p.grad.full_tensor() for n, p in t.model.named_parameters()}  # FSDP2's DTensors
    t.close()
    return loss, grads


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_four_accumulated_micro_batches_equal_one_batch_of_four(tmp_path, impl):
    inputs, targets = uneven_rows()
    one_big = trainer(tmp_path, impl, 4, 1)
    # The expectation: the model's own mean over all targets of the four rows, in one backward.
    reference = trainer(tmp_path, impl, 4, 1, "train.run_dir=" + str(tmp_path / "ref"))
    expected_loss = reference.model(inputs, targets)
    expected_loss.backward()
    expected = {n: p.grad.full_tensor() for n, p in reference.model.named_parameters()}
    reference.close()

    big_loss, big = step_gradients(one_big, [Batch(inputs, targets)])
    # Row 2 is a micro-batch without targets: it adds zero, never NaN.
    small_loss, small = step_gradients(trainer(tmp_path, impl, 1, 4),
                                       [Batch(inputs[i:i + 1], targets[i:i + 1]) for i in range(4)])
    assert big_loss == pytest.approx(expected_loss.item(), rel=1e-6)
    assert small_loss == pytest.approx(expected_loss.item(), rel=1e-6)
    for n, g in expected.items():
        assert_close_to(big[n], g, 1e-5, n)
        assert_close_to(small[n], g, 1e-5, n)


def test_a_step_without_any_target_has_zero_loss_and_gradients(tmp_path):
    inputs, targets = uneven_rows()
    loss, grads = step_gradients(trainer(tmp_path, "eager", 2, 2),
                                 [Batch(inputs[:2], torch.full_like(targets[:2], IGNORE_INDEX))] * 2)
    assert loss == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_pretraining_gradients_are_those_of_the_mean_of_micro_batch_means(tmp_path, impl):
    """Where every token is a target the step is what it was: the mean over micro-batches of each
    micro-batch's mean loss."""
    inputs, targets = uneven_rows()
    full = Batch(inputs, inputs.roll(-1, 1))
    micro = [Batch(full.inputs[i:i + 2], full.targets[i:i + 2]) for i in (0, 2)]
    reference = trainer(tmp_path, impl, 2, 2, "train.run_dir=" + str(tmp_path / "ref"))
    expected_loss = 0.0
    for b in micro:
        loss = reference.model(b.inputs, b.targets)
        (loss / 2).backward()
        expected_loss += loss.item() / 2
    expected = {n: p.grad.full_tensor() for n, p in reference.model.named_parameters()}
    reference.close()
    loss, grads = step_gradients(trainer(tmp_path, impl, 2, 2), micro)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for n, g in expected.items():
        assert_close_to(grads[n], g, 1e-5, n)


# ---- whole runs: 1 × 4, 4 × 1 and 2 processes × 2 on packed fine-tuning data -----------------------
def write_uneven_examples(path, n=48):
    """Conversations of varied lengths, so packed windows hold different numbers of targets."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(n):
        prompt_len, response_len = (int(x) for x in torch.randint(1, 40, (2,), generator=g))
        lines.append(json.dumps({"prompt": f"q{i} " + "x" * prompt_len, "response": "y" * response_len}))
    path.write_text("\n".join(lines) + "\n")
    return path


def sft_run(data, run_dir, micro_batch_size):
    """4 windows per step, validation and checkpoints every 2 steps."""
    return [
        "data=sft", f"data.path={data}", "data.seq_len=64", "data.val_fraction=0.25",
        f"train.micro_batch_size={micro_batch_size}", f"train.tokens_per_step={4 * 64}",
        "train.steps=4", "train.log_every=1", "train.val_every=2", "train.val_batches=1",
        "train.progress=false", "checkpoint.every=2", "optim.warmup_steps=1", f"train.run_dir={run_dir}",
    ]


@pytest.mark.slow
def test_accumulation_and_processes_do_not_change_the_losses(tmp_path, run_torchrun):
    data = write_uneven_examples(tmp_path / "examples.jsonl")
    one_big = train(load_config(sft_run(data, tmp_path / "1x4", 4))).losses
    accumulated = train(load_config(sft_run(data, tmp_path / "4x1", 1))).losses
    run_torchrun(2, sft_run(data, tmp_path / "2procs", 1))  # 2 processes × 2 micro-batches of 1
    two_processes = read_losses(tmp_path / "2procs")
    assert sorted(one_big) == sorted(two_processes) == [1, 2, 3, 4]
    for step, loss in one_big.items():
        assert accumulated[step] == pytest.approx(loss, rel=1e-5), step
        assert two_processes[step] == pytest.approx(loss, rel=1e-5), step


def test_validation_smaller_than_one_batch_is_evaluated_per_target_token(tmp_path):
    """A held-out set of fewer windows than a micro-batch is read whole: the loss per target token of
    the windows there are, the filler of the partial batch adding nothing."""
    data = write_uneven_examples(tmp_path / "examples.jsonl")
    run = validate(load_config([
        "data=sft", f"data.path={data}", "data.seq_len=64", "data.val_fraction=0.1",
        "data.num_workers=0", "train.micro_batch_size=8", "train.progress=false",
        f"train.run_dir={tmp_path / 'run'}",
    ]))
    t = Trainer(run, init_distributed("cpu"))
    windows = t.val_data.dataset
    assert 0 < len(windows) < 8
    whole = collate([windows[i] for i in range(len(windows))])
    with torch.no_grad():
        expected = t.model(whole.inputs, whole.targets, documents=whole.documents, reduction="sum").item()
    expected /= (whole.targets != IGNORE_INDEX).sum().item()
    assert t.evaluate() == pytest.approx(expected, rel=1e-5)
    t.close()
