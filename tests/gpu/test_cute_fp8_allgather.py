"""parallel.fp8_all_gather on the cute FP8 stages (sm_90): the layer weights all-gathered in e4m3
train bitwise as the bf16 all-gather followed by the cute stages' own weight quantization
(`CuteStages.quantize`, a CuTeDSL kernel), which the pre-all-gather's rule (kernels/fp8.py
`quantize` on the weight rounded to bf16, with the whole weight's current-amax scale) must match.

One GPU: a single-rank FSDP2 run (the hooks run; the all-gather is a copy). Two GPUs (nccl): two
sharded ranks, the all-gather real. Both through the trainer, validation and checkpoints on.
"""

from __future__ import annotations

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")

from mesh_runs import launch  # noqa: E402

from codatrain.config import load_config  # noqa: E402
from codatrain.train.logger import read_records  # noqa: E402
from codatrain.train.trainer import train  # noqa: E402

pytestmark = pytest.mark.gpu

# Widths of whole FP8 rows (multiples of 16), 2 × 256 tokens per micro-batch.
COMMON = [
    "block=coda", "block.backend=cute", "block.attention=sdpa", "block.precision=fp8", "train.device=cuda",
    "model=tiny", "train.log_every=1", "train.progress=false", "data=synthetic", "data.num_workers=0",
    "data.seq_len=256", "train.micro_batch_size=2", "optim.warmup_steps=1", "train.steps=3",
    "train.val_every=3", "train.val_batches=2", "checkpoint.every=3",
]


def _numbers(run_dir) -> dict[int, dict[str, float]]:
    keep = ("loss", "grad_norm", "val_loss")
    return {r["step"]: {k: r[k] for k in keep if k in r} for r in read_records(run_dir)}


def test_one_gpu_trains_bitwise_as_the_bf16_gather(tmp_path):
    for on in (True, False):
        train(load_config([*COMMON, f"parallel.fp8_all_gather={str(on).lower()}",
                           f"train.run_dir={tmp_path / str(on)}"]))
    on, off = _numbers(tmp_path / "True"), _numbers(tmp_path / "False")
    assert on == off and len(on) == 3 and "val_loss" in on[3]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_train_bitwise_as_the_bf16_gather(tmp_path):
    runs = [[*COMMON, f"parallel.fp8_all_gather={on}", f"train.run_dir={tmp_path / on}"]
            for on in ("true", "false")]
    output = launch(2, runs, tmp_path)
    assert output.count("weights all-gathered in fp8") == 1
    on, off = _numbers(tmp_path / "true"), _numbers(tmp_path / "false")
    assert on == off and len(on) == 3 and "val_loss" in on[3]
