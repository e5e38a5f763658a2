"""The run plan: a job decides each derived fact once (the model config, the block's kernels and
their device check), and scripts/precompile.py plans the same kernels without a device."""

import sys
from collections import Counter

import pytest
import torch

from codatrain.config import load_config, validate
from codatrain.kernels import attention, stages
from codatrain.kernels.reference import ReferenceStages
from codatrain.train import hf_io
from codatrain.train.plan import build_run_plan
from codatrain.train.trainer import train

JOB = ["block=coda", "model.n_layers=1", "data=synthetic", "data.num_workers=0", "data.seq_len=32",
       "train.micro_batch_size=2", "train.steps=1", "train.val_every=0", "train.progress=false",
       "checkpoint.at_end=false"]


def patch_everywhere(monkeypatch, module, name: str, replacement) -> None:
    """Replace `module.name` in every codatrain module that imported it."""
    original = getattr(module, name)
    for module_name, loaded in list(sys.modules.items()):
        if module_name.startswith("codatrain") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, replacement)


def count_calls(monkeypatch, calls: Counter, module, name: str) -> None:
    """Count the calls of `module.name` by the name they ask for and whether a device is given."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name, *map(str, args)] += 1
        return original(*args, **kwargs)

    patch_everywhere(monkeypatch, module, name, counted)


def test_a_job_reads_the_model_config_and_checks_the_kernels_on_its_device_once(tmp_path, monkeypatch):
    # A stand-in Hopper on the CPU: `auto` takes "cute" (the reference stages) and "fa4" (PyTorch's
    # attention), so the path that loads and checks the CuTeDSL kernels runs here.
    patch_everywhere(monkeypatch, stages, "is_sm90", lambda device: True)
    monkeypatch.setitem(stages._BACKENDS, "cute", ReferenceStages())
    monkeypatch.setitem(attention._IMPLS, "fa4", attention.sdpa_attention)
    calls = Counter()
    count_calls(monkeypatch, calls, hf_io, "run_model_config")
    count_calls(monkeypatch, calls, stages, "get_backend")
    count_calls(monkeypatch, calls, attention, "get_attention")
    train(load_config([*JOB, f"train.run_dir={tmp_path}"]))
    once = ["get_attention", "get_backend", "run_model_config"]
    assert sorted(name for name, *_ in calls.elements()) == once
    assert ("get_backend", "cute", "cpu") in calls and ("get_attention", "fa4", "cpu") in calls


def test_precompile_plans_the_kernels_of_the_job_on_the_target():
    run = validate(load_config(["block=coda", "train.tokens_per_step=8192"]))
    target = build_run_plan(run, None)
    assert target.block.describe() == "coda (stages cute, attention fa4)" and target.block.stages is None
    assert target.compute_dtype == torch.bfloat16 and target.grad_accum == 4
    cpu = build_run_plan(run, torch.device("cpu"), world_size=2)
    assert (cpu.block.backend, cpu.compute_dtype, cpu.grad_accum) == ("reference", torch.float32, 2)
    assert cpu.model_cfg == target.model_cfg and cpu.data == target.data
    with pytest.raises(ValueError, match=r"train.tokens_per_step=8192 is not a multiple of .* = 6144"):
        build_run_plan(run, torch.device("cpu"), world_size=3)


@pytest.mark.parametrize("overrides, schedule", [
    (["optim=wsd", "optim.decay_fraction=0.125"], "wsd to 0.1× over the last 12.5% of steps"),
    # It was "constant to 0.1×": a floor the constant schedule never goes to.
    (["optim.schedule=constant"], "constant"),
])
def test_run_header_names_the_schedule_as_it_runs(overrides, schedule):
    header = build_run_plan(validate(load_config(overrides)), torch.device("cpu")).header()[1]
    assert header.startswith(f"recipe: AdamW lr 0.003, 20 warmup steps, {schedule} | weight decay 0.1 | ")
