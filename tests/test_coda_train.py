"""block=coda through the trainer on CPU (reference stages, SDPA): against block=eager and under
activation checkpointing (under FSDP2 with two processes: tests/test_train.py)."""


import pytest

from codatrain.config import load_config
from codatrain.train.trainer import train

FAST = ["train.log_every=1", "train.val_every=0", "train.progress=false", "checkpoint.at_end=false"]
CODA = ["block=coda", "block.backend=reference", "block.attention=sdpa"]
# The default tiny run (embedded corpus, AdamW, cosine) made cheaper: two layers, 16 × 64 tokens.
SMALL = ["model.n_layers=2", "data.seq_len=64", "train.micro_batch_size=16", "train.tokens_per_step=1024"]


def run(tmp_path, *overrides):
    return train(load_config([*FAST, f"train.run_dir={tmp_path}", *SMALL, *overrides]))


@pytest.mark.slow
def test_coda_and_eager_loss_curves_match_over_200_steps_of_the_default_run(tmp_path):
    """The default tiny run (embedded corpus, 4 layers, 16 × 128 tokens a step), 200 steps each."""
    default = [*FAST, "train.steps=200"]
    eager = train(load_config([*default, f"train.run_dir={tmp_path / 'eager'}"])).losses
    coda = train(load_config([*default, f"train.run_dir={tmp_path / 'coda'}", *CODA])).losses
    assert sorted(coda) == sorted(eager) == list(range(1, 201))
    # fp32: the same math rounded differently, so the curves drift apart only slowly
    # (observed on 2 CPU cores: < 1e-6 over the first 20 steps, 1.1e-3 at most over all 200).
    for step in range(1, 21):
        assert coda[step] == pytest.approx(eager[step], abs=1e-4), step
    for step in eager:
        assert coda[step] == pytest.approx(eager[step], abs=5e-3), step
    assert eager[200] < eager[1] - 3.0  # and they did train


def test_coda_with_activation_checkpointing_gives_the_same_losses(tmp_path):
    plain = run(tmp_path / "a", "train.steps=3", *CODA)
    recompute = run(tmp_path / "b", "train.steps=3", "train.activation_checkpointing=true", *CODA)
    assert recompute.losses == pytest.approx(plain.losses, rel=1e-6)
