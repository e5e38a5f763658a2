"""block.precision=fp8 through the trainer (reference stages on the CPU): the loss tracks the fp32
run's, the amax histories are checkpointed training state that resumes exactly, checkpoints move
between FP8, bf16 CODA and eager runs, a non-finite amax skips the step, and the refusals."""

import itertools
import math

import pytest
import torch

from codatrain.config import load_config, validate
from codatrain.kernels.fp8 import Operand
from codatrain.model.hf import HFCheckpoint
from codatrain.train.distributed import init_distributed
from codatrain.train.hf_io import export_checkpoint_to_hf
from codatrain.train.logger import LOG_FILE, read_losses
from codatrain.train.plan import build_run_plan
from codatrain.train.trainer import Trainer, train

STEPS = 8
FAST = [
    "train.log_every=1", "train.val_every=0", "train.progress=false", "data=synthetic",
    "data.num_workers=0", "data.seq_len=64", "train.micro_batch_size=4", "train.tokens_per_step=512",
    "optim.warmup_steps=2", f"train.steps={STEPS}", "checkpoint.at_end=false",
]
CODA = ["block=coda", "block.backend=reference", "block.attention=sdpa"]
FP8 = [*CODA, "block.precision=fp8"]


def run(run_dir, *overrides):
    return train(load_config([*FAST, f"train.run_dir={run_dir}", *overrides]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp32 CODA and FP8 CODA runs of the tiny preset, both saving a checkpoint at step 4."""
    root = tmp_path_factory.mktemp("fp8")
    return {name: (root / name, run(root / name, "checkpoint.every=4", *block).losses)
            for name, block in (("fp32", CODA), ("fp8", FP8))}


def test_fp8_training_tracks_the_fp32_run(runs):
    (_, fp32), (_, fp8) = runs["fp32"], runs["fp8"]
    # Measured: within 0.31% at every step (0.01% at steps 1-2); they differ, and they train.
    assert all(fp8[s] == pytest.approx(fp32[s], rel=1e-2) for s in fp32)
    assert fp8 != fp32 and fp8[STEPS] < fp8[1] - 0.5


def test_fp8_with_torch_compile_trains_as_the_eager_run(tmp_path, runs):
    """train.compile=true with block.precision=fp8 (it stopped in the first backward: the layer
    Functions' amax recording mutates a tensor the compiled graph saved); the CODA Functions then
    run outside the compiled graphs, so the losses are the eager run's (validation on, as users run)."""
    _, fp8 = runs["fp8"]
    compiled = run(tmp_path, "train.steps=3", "train.compile=true", "train.val_every=3", *FP8)
    assert compiled.losses == pytest.approx({s: fp8[s] for s in range(1, 4)}, rel=1e-5)


def test_fp8_resume_continues_the_uninterrupted_run_exactly(tmp_path, runs):
    fp8_dir, fp8 = runs["fp8"]
    resumed = run(tmp_path, f"checkpoint.resume={fp8_dir / 'checkpoints/step_4'}", *FP8).losses
    assert resumed == {s: fp8[s] for s in range(5, STEPS + 1)}


def test_checkpoints_move_between_fp8_bf16_and_eager_runs(tmp_path, runs):
    (fp32_dir, fp32), (fp8_dir, fp8) = runs["fp32"], runs["fp8"]
    one_step = "train.steps=5"
    fresh = run(tmp_path / "a", one_step, f"checkpoint.resume={fp32_dir / 'checkpoints/step_4'}", *FP8)
    assert fresh.losses[5] == pytest.approx(fp32[5], rel=1e-2)
    log = (tmp_path / "a" / LOG_FILE).read_text()
    assert "holds no FP8 amax history (a bf16 or eager run's): starting a fresh one" in log
    for block in (CODA, []):  # bf16 CODA and eager continue an FP8 run
        resume = f"checkpoint.resume={fp8_dir / 'checkpoints/step_4'}"
        other = run(tmp_path / f"b{len(block)}", one_step, resume, *block)
        assert other.losses[5] == pytest.approx(fp8[5], rel=1e-2)
    export_checkpoint_to_hf(fp8_dir / "checkpoints/step_4", tmp_path / "hf")
    export_checkpoint_to_hf(fp32_dir / "checkpoints/step_4", tmp_path / "hf32")
    assert HFCheckpoint(tmp_path / "hf").keys() == HFCheckpoint(tmp_path / "hf32").keys()


@pytest.mark.slow
def test_two_fsdp_processes_share_one_history_that_resumes_on_one(tmp_path, run_torchrun):
    """Two FSDP2 ranks max their amaxes into one history (gloo), saved once in the checkpoint; one
    process resumes it (2 micro-batches a step instead of 2 ranks)."""
    # Validation right before each save, as the README's torchrun command runs: evaluation records no amax.
    common = [*FAST, *FP8, "train.steps=4", "train.val_every=2"]
    proc = run_torchrun(2, [*common, "checkpoint.every=2", f"train.run_dir={tmp_path / 'two'}"])
    assert "step 2/4 | val loss" in proc.stdout and "saved checkpoint" in proc.stdout
    assert "2 × cpu" in proc.stdout and "layer GEMMs in fp8" in proc.stdout
    two = read_losses(tmp_path / "two")
    resume = f"checkpoint.resume={tmp_path / 'two/checkpoints/step_2'}"
    one = run(tmp_path / "one", *FP8, "train.steps=4", "train.val_every=2", resume)
    assert "starting a fresh one" not in (tmp_path / "one" / LOG_FILE).read_text()
    # Measured: step 3 equal, step 4 within 6e-4 (the gradient sums' order differs; a scale that
    # moves with it puts every value on another FP8 grid).
    assert one.losses == pytest.approx({s: two[s] for s in (3, 4)}, rel=1e-2)


def test_a_nonfinite_amax_skips_the_update_and_keeps_the_history(tmp_path, monkeypatch):
    complete_step, updates = Trainer.complete_step, []

    def counted_complete_step(self):
        updates.append(self.step + 1)
        return complete_step(self)

    monkeypatch.setattr(Trainer, "complete_step", counted_complete_step)
    cfg = load_config([*FAST, f"train.run_dir={tmp_path}", "train.steps=4", *FP8])
    trainer = Trainer(validate(cfg), init_distributed("cpu"))
    forward, calls, weights = trainer.model.forward, itertools.count(), {}

    def overflowing_forward(*args, **kwargs):  # two micro-batches a step
        n = next(calls)
        if n in (4, 6):  # the start of step 3 and of its second attempt
            weights[n] = [p.full_tensor().clone() for p in trainer.model.parameters()]
        out = forward(*args, **kwargs)
        if n == 4:  # an activation of step 3 overflowed: its FP8 copy saturated, its amax is inf
            trainer.fp8_scaling.step_amax[1, Operand.down_in] = math.inf
        return out

    trainer.model.forward = overflowing_forward
    result = trainer.fit()
    trainer.close()
    assert result.final_step == 4 and updates == [1, 2, 3, 4] and next(calls) == 10  # 5 steps computed
    # The update of the skipped step was launched and did nothing on the device.
    assert all(torch.equal(a, b) for a, b in zip(weights[4], weights[6], strict=True))
    # Four steps entered the history, newest first; the skipped one left no value.
    history = trainer.fp8_scaling.history
    used = trainer.fp8_scaling.recipe.operands()
    assert trainer.fp8_scaling.steps == 4
    assert (history[:, used, :4] > 0).all() and (history[..., 4:] == 0).all()
    lines = [line for line in (tmp_path / LOG_FILE).read_text().splitlines() if "FP8 amax" in line]
    assert lines == ["step 3: FP8 amax not finite (layer 1 down_in); update skipped, the amax history kept"]


@pytest.mark.parametrize("overrides, refusal", [
    (["block=eager", "block.precision=fp8"],
     r"^block.precision=fp8 is the FP8 CODA block \(block=coda\), not block=eager; the eager model's FP8 is "
     r"torchao's: train.float8=tensorwise or rowwise with block=eager$"),
    (["block=liger", "block.precision=fp8"], r"not block=liger"),
    ([*CODA, "block.fp8_wgrad=false"],
     r"^block.fp8_wgrad=False sets the FP8 recipe; it needs block.precision=fp8$"),
    ([*CODA, "block.fp8_margin=1"],
     r"^block.fp8_margin=1 sets the FP8 recipe; it needs block.precision=fp8$"),
    ([*CODA, "block.fp8_fast_accum=true"],
     r"^block.fp8_fast_accum=True sets the FP8 recipe; it needs block.precision=fp8$"),
    ([*FP8, "block.fp8_history_len=0"], r"^block.fp8_history_len must be positive, got 0$"),
])
def test_fp8_keys_that_do_not_apply_are_refused_by_name(overrides, refusal):
    with pytest.raises(ValueError, match=refusal):
        validate(load_config(overrides))


def test_the_plan_takes_fp8_on_the_cute_stages_at_widths_of_whole_fp8_rows_and_names_the_recipe():
    cute = ["block=coda", "block.backend=cute", "block.precision=fp8"]
    # The sm_90 target, as scripts/precompile.py plans it.
    assert build_run_plan(validate(load_config([*cute, "model=llama3_125m"])), None).fp8 is not None
    with pytest.raises(ValueError, match=r"^model.ffn_dim=2056 does not run with block.precision=fp8 on "
                                         r"block.backend=cute: FP8 operands move in 16-byte rows, so it must "
                                         r"be a multiple of 16 \(nearest: 2048 or 2064\)$"):
        build_run_plan(validate(load_config([*cute, "model=llama3_125m", "model.ffn_dim=2056"])), None)
    with pytest.raises(ValueError, match=r"^train.micro_batch_size × data.seq_len = 1000 tokens does not run "
                                         r"with block.precision=fp8 on block.backend=cute: it must be a "
                                         r"multiple of 16$"):
        build_run_plan(validate(load_config([*cute, "model=llama3_125m", "train.micro_batch_size=2",
                                             "data.seq_len=500"])), None)
    plan = build_run_plan(validate(load_config([*FP8, "block.fp8_grad_format=e4m3", "block.fp8_margin=1",
                                                "block.fp8_wgrad=false"])), torch.device("cpu"))
    assert plan.fp8.margin == 1 and plan.fp8.grad_dtype == torch.float8_e4m3fn
    assert ("float32, layer GEMMs in fp8 (e4m3, gradients e4m3, weight gradients in the compute dtype; "
            "delayed scaling over 16 steps, margin 1)" in plan.header()[0])
    plan = build_run_plan(validate(load_config(FP8)), torch.device("cpu"))
    assert plan.fp8.wgrad_fp8 and "weight gradients in FP8" in plan.header()[0]
    assert not plan.fp8.fast_accum and "fast accumulation" not in plan.header()[0]


@pytest.mark.parametrize("family, key", [(["model.family=qwen2", "model.qkv_bias=true"], "qkv_bias"),
                                         (["model.family=qwen3", "model.qk_norm=true"], "qk_norm")])
def test_fp8_qwen_models_train_on_the_reference_stages_and_wait_for_a_gpu_check_on_the_cute_ones(family, key):
    """Qwen2's QKV bias and Qwen3's QK-norm with FP8 layer GEMMs: the reference stages run them; the
    cute stages' FP8 kernels for them are built (test_precompile.py) but refused by the plan until
    their GPU tests have run."""
    plan = build_run_plan(validate(load_config([*FP8, *family])), torch.device("cpu"))
    assert plan.fp8 is not None and not plan.block.cute_stages
    with pytest.raises(ValueError, match=rf"^block.precision=fp8 with model.{key}=true does not run on "
                                         r"block.backend=cute yet: its FP8 kernels are built but not yet "
                                         r"checked against the reference on a GPU"):
        build_run_plan(validate(load_config(["block=coda", "block.backend=cute", "block.precision=fp8",
                                             *family])), None)


def test_fp8_fast_accumulation_reaches_the_cute_stages_and_the_kernel_cache_key():
    """block.fp8_fast_accum=true: the recipe says so in the run header, the plan's cute stages run
    every FP8 stage on fast accumulation (their kernels differ: the cache key names it), and the
    reference stages, which compute FP8 products exactly, are themselves."""
    from codatrain.kernels.stages import get_backend

    fast = ["block.fp8_fast_accum=true"]
    plan = build_run_plan(validate(load_config([*FP8, *fast])), torch.device("cpu"))
    assert plan.fp8.fast_accum and "margin 0; fast accumulation)" in plan.header()[0]
    assert plan.block.stages is get_backend("reference")
    cute = ["block=coda", "block.backend=cute", "block.precision=fp8", "model=llama3_125m"]
    keys = [build_run_plan(validate(load_config([*cute, *extra])), None).kernel_shapes.key
            for extra in ([], fast)]
    assert keys[1] == keys[0] + " fp8_fast_accum"
    pytest.importorskip("quack")
    from codatrain.kernels.cute import CuteStages
    from codatrain.kernels.fp8 import Fp8Recipe

    assert CuteStages().for_fp8(Fp8Recipe(fast_accum=True)).fp8_fast_accum
    assert not CuteStages().for_fp8(Fp8Recipe()).fp8_fast_accum


def test_fsdp2_mixed_precision_leaves_the_fp8_state_as_it_is():
    """FSDP2's policy casts the floating tensors among a block's forward arguments to the compute
    dtype: the FP8 scaling the blocks receive must reach them uncast, or the amaxes are recorded
    into bf16 copies and lost (the history stays zero) and the scales reach the kernels in bf16."""
    from codatrain.kernels.fp8 import Fp8Recipe
    from codatrain.kernels.resolve import portable_block
    from codatrain.model.coda import CodaLlama
    from codatrain.model.config import get_preset
    from codatrain.train.canonical_state import init_weights
    from codatrain.train.parallelize import apply_fsdp, device_mesh
    from codatrain.train.plan import DataParallelMesh

    init_distributed("cpu")
    cfg = get_preset("tiny")
    with torch.device("meta"):
        model = CodaLlama(cfg, portable_block(), fp8=Fp8Recipe())
    apply_fsdp(model, device_mesh(torch.device("cpu"), DataParallelMesh(1, 1)), torch.bfloat16)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    for _ in range(2):  # current scaling, then delayed scales from the first step's amaxes
        model(tokens, tokens).backward()
        used = model.fp8_scaling.recipe.operands()
        assert (model.fp8_scaling.step_amax[:, used] > 0).all(), "amaxes recorded into copies"
        model.fp8_scaling.commit_step()
        assert model.fp8_scaling.scales.dtype == torch.float32
    assert (model.fp8_scaling.history[:, used, :2] > 0).all()
