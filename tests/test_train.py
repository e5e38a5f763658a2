"""The training loop end to end on CPU: in-process runs and FSDP2 under torchrun (gloo)."""


import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mesh_runs import launch
from torch.distributed.fsdp import FSDPModule

from codatrain.config import load_config, validate
from codatrain.kernels.stages import BackendUnavailableError
from codatrain.train import trainer as trainer_module
from codatrain.train.distributed import init_distributed
from codatrain.train.logger import LOG_FILE, read_losses, read_records
from codatrain.train.optim import lr_factor
from codatrain.train.plan import build_run_plan
from codatrain.train.trainer import Trainer, train

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.log_every=1", "train.val_every=0", "train.progress=false", "checkpoint.at_end=false"]


def run(tmp_path, *overrides):
    return train(load_config([*FAST, f"train.run_dir={tmp_path}", *overrides]))


def test_loss_falls_on_synthetic_data(tmp_path):
    """The synthetic source's rule (every other target is a function of its input) is learnable;
    the embedded-corpus run is tested in test_data_train.py."""
    result = run(tmp_path, "data=synthetic", "train.steps=30", "model.vocab_size=256")
    losses = result.losses
    assert len(losses) == 30
    first, last = sum(losses[s] for s in range(1, 4)) / 3, sum(losses[s] for s in range(28, 31)) / 3
    assert last < first - 1.0, (first, last)
    assert read_losses(tmp_path) == losses  # the metrics file holds what the loop saw


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    whole = run(tmp_path / "a", "train.steps=5", "train.micro_batch_size=16", "train.tokens_per_step=2048")
    split = run(tmp_path / "b", "train.steps=5", "train.micro_batch_size=4", "train.tokens_per_step=2048")
    for step in whole.losses:
        assert split.losses[step] == pytest.approx(whole.losses[step], rel=1e-5)


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    plain = run(tmp_path / "a", "train.steps=4")
    recompute = run(tmp_path / "b", "train.steps=4", "train.activation_checkpointing=true")
    assert recompute.losses == pytest.approx(plain.losses, rel=1e-6)


def test_seed_makes_runs_repeatable(tmp_path):
    a = run(tmp_path / "a", "train.steps=3")
    b = run(tmp_path / "b", "train.steps=3")
    c = run(tmp_path / "c", "train.steps=3", "train.seed=7")
    assert a.losses == b.losses
    assert a.losses != c.losses


def test_batch_that_does_not_divide_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="tokens_per_step"):
        run(tmp_path, "train.tokens_per_step=1000")


@pytest.mark.parametrize("block", [["block=eager"], ["block=coda", "block.backend=reference"]],
                         ids=["eager", "coda"])
def test_one_plain_process_computes_through_fsdp2s_policy_in_the_plans_dtype(tmp_path, monkeypatch, block):
    """One precision path: a plain process (no torchrun) makes a process group of one and shards its
    model with FSDP2 as every torchrun rank does, so FSDP2's policy applies the plan's compute dtype
    (bf16 here, as on a GPU) and nothing else casts: the blocks compute on bf16 parameters, the
    master weights and their gradients stay fp32."""

    def bf16_plan(*args, **kwargs):
        return dataclasses.replace(build_run_plan(*args, **kwargs), compute_dtype=torch.bfloat16)

    monkeypatch.setattr(trainer_module, "build_run_plan", bf16_plan)
    cfg = load_config([*FAST, f"train.run_dir={tmp_path}", *block, "model.n_layers=2", "data.seq_len=32",
                       "train.micro_batch_size=2", "train.tokens_per_step=null"])
    trainer = Trainer(validate(cfg), init_distributed("cpu"))
    assert trainer.dist.world_size == 1 and " | 1 × cpu | " in trainer.plan.header()[0]
    blocks = trainer.model.blocks()
    assert all(isinstance(module, FSDPModule) for module in [trainer.model, *blocks])
    seen = []

    def record_dtypes(module, args):  # runs after FSDP2's own hook has unsharded the parameters
        seen.append({p.dtype for p in module.parameters()})

    for module in blocks:
        module.register_forward_pre_hook(record_dtypes)
    loss, grad_norm = trainer.train_step(iter(trainer.train_data))[:2]
    trainer.close()
    assert seen == [{torch.bfloat16}] * len(blocks)
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    assert 4.0 < loss < 7.0 and grad_norm > 0  # about ln(vocab) = 5.5 at the first step


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_the_update_clips_the_gradients_to_the_norm_clip_grad_norm_would(tmp_path, clip):
    cfg = load_config([*FAST, f"train.run_dir={tmp_path}", "model.n_layers=1", "data.seq_len=32",
                       "train.micro_batch_size=2", "train.tokens_per_step=null", f"optim.grad_clip={clip}"])
    trainer = Trainer(validate(cfg), init_distributed("cpu"))
    grad_norm = trainer.train_step(iter(trainer.train_data)).grad_norm
    # The fused update divides the gradients as it reads them and leaves them divided (on the CPU).
    clipped = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()]).full_tensor()
    trainer.close()
    assert grad_norm > 0.05 * 10
    expected = clip if clip < grad_norm else grad_norm  # a clip above the norm leaves it alone
    assert clipped.item() == pytest.approx(expected, rel=1e-5)


# Same global batch on 1 process with 2 micro-batches and on 2 FSDP2 ranks: the default tiny run
# (4096 tokens a step), and block=coda on a smaller one.
FSDP_EAGER = [*FAST, "train.steps=12", "train.tokens_per_step=4096", "train.micro_batch_size=16"]
FSDP_CODA = [*FAST, "model.n_layers=2", "data.seq_len=64", "train.micro_batch_size=16",
             "block=coda", "block.backend=reference", "block.attention=sdpa", "train.steps=8",
             "train.tokens_per_step=2048"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, Path]:
    """Both runs on 2 FSDP2 processes, one after the other in one torchrun job (tests/mesh_runs.py:
    its start-up paid once); the run dir of each."""
    root = tmp_path_factory.mktemp("two")
    dirs = {"eager": root / "eager", "coda": root / "coda"}
    launch(2, [[*FSDP_EAGER, f"train.run_dir={dirs['eager']}"],
               [*FSDP_CODA, f"train.run_dir={dirs['coda']}"]], root)
    for block, run_dir in dirs.items():
        log = (run_dir / LOG_FILE).read_text()
        assert f"codatrain | block={block}" in log and " | 2 × cpu (full shard) | " in log, log
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("block, overrides", [("eager", FSDP_EAGER), ("coda", FSDP_CODA)])
def test_fsdp_two_processes_follow_one_process(tmp_path, two_processes, block, overrides):
    one = run(tmp_path / "one", *overrides)
    two = read_losses(two_processes[block])
    assert sorted(two) == sorted(one.losses)
    # fp32 on CPU: only the order of the gradient sums differs (reduce-scatter vs accumulation).
    for step, loss in one.losses.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step


@pytest.mark.slow
def test_per_block_compile_gives_the_same_losses(tmp_path):
    plain = run(tmp_path / "a", "train.steps=3")
    compiled = run(tmp_path / "b", "train.steps=3", "train.compile=true")
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5)


def test_unavailable_kernels_fail_before_training(tmp_path):
    """block.backend=cute on a CPU: a clear error when the model is built, before any data loads."""
    with pytest.raises(BackendUnavailableError, match="cute"):
        run(tmp_path, "block=coda", "block.backend=cute")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_offline_run_records_the_resolved_config(tmp_path, monkeypatch):
    import wandb

    seen = {}
    real_init = wandb.init

    def init(**kwargs):
        seen.update(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    run(tmp_path, "train.steps=2", "logger.wandb.mode=offline", "logger.wandb.project=codatrain-test",
        f"train.run_dir={tmp_path}/${{model.preset}}")
    assert seen["mode"] == "offline" and seen["project"] == "codatrain-test"
    config = seen["config"]
    assert config["train"]["run_dir"] == f"{tmp_path}/tiny"  # resolved, not an interpolation
    assert config["model"]["preset"] == "tiny" and config["train"]["steps"] == 2
    runs = list((tmp_path / "tiny" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_wandb_closes_a_run_that_ends_on_an_error_as_failed(tmp_path, monkeypatch):
    # wandb.finish() without an exit code: a diverged or crashed run showed as finished.
    import wandb

    exit_codes = []

    class Run:
        def log(self, record, step):
            pass

        def finish(self, exit_code=None):
            exit_codes.append(exit_code)

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Run())
    run(tmp_path / "ok", "train.steps=1", "logger.wandb.mode=offline")
    assert exit_codes == [None]

    def train_step(self, batches):
        raise RuntimeError("lost the device")

    monkeypatch.setattr(Trainer, "train_step", train_step)
    with pytest.raises(RuntimeError, match="lost the device"):
        run(tmp_path / "failed", "train.steps=1", "logger.wandb.mode=offline")
    assert exit_codes == [None, 1]


def test_wandb_that_cannot_start_is_one_error_before_training(tmp_path, monkeypatch):
    """An online run without an API key (or the network): wandb's error, named by the key that
    asked for it, with the way out; the run directory is free for the next attempt."""
    import wandb

    def init(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(ValueError, match=r"^logger\.wandb\.mode=online: wandb did not start: No API key "
                                         r"configured\. .*logger\.wandb\.mode=offline logs into the run"):
        run(tmp_path, "train.steps=2", "logger.wandb.mode=online")
    assert not (tmp_path / "metrics.jsonl").exists()
    monkeypatch.undo()
    assert len(run(tmp_path, "train.steps=2").losses) == 2


def test_wandb_that_cannot_start_under_torchrun_stops_every_rank_with_its_error(tmp_path):
    """Only rank 0 starts wandb; the other rank must not wait for it in a collective (it used to
    die of gloo's "connection closed by peer" after rank 0's error)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc, so no API key
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "scripts" / "train.py"), "train.steps=2", "logger.wandb.mode=online", "data=synthetic",
         f"train.run_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # Both ranks print it (their lines may interleave, and torchrun may end one of them first).
    assert "error: logger.wandb.mode=online: wandb did not start: " in proc.stderr, proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr, proc.stderr[-3000:]


def test_a_profile_the_run_cannot_complete_is_refused_or_named(tmp_path, capsys):
    """The profiler's window is train.profile_skip steps, one warm-up step, then the profiled ones:
    a run that ends before it starts is refused; one that ends inside it (a short run, or a resumed
    one) trains and says how many steps the profile covers."""
    with pytest.raises(ValueError, match=r"^train\.profile_steps=2: train\.steps=6 ends before the "
                                         r"profile starts \(after train\.profile_skip=5 steps and one "
                                         r"warm-up step\)"):
        validate(load_config(["train.steps=6", "train.profile_steps=2"]))
    run(tmp_path, "train.steps=3", "checkpoint.at_end=true")
    capsys.readouterr()
    run(tmp_path, "train.steps=5", "train.profile_steps=3", "train.profile_skip=0", "checkpoint.at_end=true")
    assert ("warning: 2 steps are left to run, so the profile (after train.profile_skip=0 and one warm-up "
            "step) covers 1 of train.profile_steps=3") in capsys.readouterr().out
    assert (tmp_path / "profile" / "summary_rank0.txt").is_file()
    run(tmp_path, "train.steps=7", "train.profile_steps=3", "train.profile_skip=1")
    assert "covers none: no profile is written" in capsys.readouterr().out


def test_each_job_of_a_sweep_trains_in_a_run_directory_of_its_own(tmp_path):
    """`-m optim.lr=a,b` with one train.run_dir: the second job used to resume the first one's last
    checkpoint and train nothing, reporting it as done."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "-m", "optim.lr=1e-3,3e-3", "train.steps=2",
         "data=synthetic", "train.log_every=1", f"train.run_dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed" not in proc.stdout
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    # Named by the job's overrides (Hydra's override_dirname, train.run_dir left out).
    assert jobs == [f"data=synthetic,optim.lr={lr},train.log_every=1,train.steps=2"
                    for lr in ("0.001", "0.003")]
    for job in jobs:
        assert sorted(read_losses(tmp_path / "sweep" / job)) == [1, 2]
        assert (tmp_path / "sweep" / job / "checkpoints" / "step_2").is_dir()


def test_a_sweep_job_whose_overrides_are_too_long_for_a_file_name_trains_in_a_cut_one(tmp_path):
    """Overrides over 255 bytes together named a folder no file system takes: the sweep stopped with
    Hydra's traceback, `OSError: [Errno 36] File name too long`."""
    overrides = [
        "train.steps=1",
        "data=synthetic",
        "data.seq_len=16",
        "train.micro_batch_size=1",
        "train.val_every=0",
        "train.log_every=1",
        "optim.warmup_steps=1",
        "optim.weight_decay=0.05",
        "optim.beta2=0.99",
        "optim.grad_clip=0.5",
        "model.n_layers=1",
        "checkpoint.keep_last=2",
        "train.tokens_per_step=null",
        "logger.wandb.mode=disabled",
        "optim.lr=0.001",
    ]
    command = [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        "-m",
        *overrides,
        f"train.run_dir={tmp_path / 'sweep'}",
    ]
    for _ in range(2):  # a rerun finds the job's folder again, and resumes its checkpoint
        proc = subprocess.run(
            command,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    from codatrain.config import job_dirname

    (job,) = [p for p in (tmp_path / "sweep").iterdir() if p.is_dir()]
    full = job_dirname(",".join(sorted(overrides)))  # Hydra's override_dirname sorts them
    assert job.name == full and len(full.encode()) <= 255 and full.startswith("checkpoint.keep_last=2,")
    assert "nothing to train" in proc.stdout and (job / "checkpoints" / "step_1").is_dir()
    assert job_dirname("a=/x/" + "b" * 300) == "a=/x/" + "b" * 200 + "..." + job_dirname("b" * 300)[-16:]
    assert job_dirname("optim.lr=0.001,train.steps=2") == "optim.lr=0.001,train.steps=2"  # as before


def test_a_resumed_run_trains_with_its_own_optimizer_values_not_the_checkpoints(tmp_path, capsys):
    """The checkpoint's parameter groups and scheduler state carry the lr and betas it was trained
    with; they silently won over a changed optim.lr while the header printed the new one."""
    run(tmp_path, "train.steps=3", "checkpoint.at_end=true")
    capsys.readouterr()
    run(tmp_path, "train.steps=6", "optim.lr=1e-2", "optim.beta2=0.99")
    out = capsys.readouterr().out
    assert "resumed with optim.lr=0.01 (the checkpoint was trained with 0.003)\n" in out
    assert "resumed with optim.beta2=0.99 (the checkpoint was trained with 0.95)\n" in out
    optim = validate(load_config([*FAST, "train.steps=6", "optim.lr=1e-2"])).optim
    lrs = {r["step"]: r["lr"] for r in read_records(tmp_path) if "lr" in r}
    assert [lrs[step] for step in (4, 5, 6)] == pytest.approx([1e-2 * lr_factor(step - 1, 6, optim)
                                                               for step in (4, 5, 6)], rel=1e-12)


def test_train_log_holds_the_console_and_the_run_ends_with_a_summary(tmp_path, capsys):
    result = run(tmp_path, "data=synthetic", "train.steps=4", "train.val_every=2", "train.log_every=2",
                 "checkpoint.at_end=true")
    shown = capsys.readouterr().out
    assert (tmp_path / "train.log").read_text() == shown
    lines = shown.splitlines()
    assert lines[0].startswith("codatrain | block=eager | tiny: ")
    assert "step 2/4 | loss " in shown and "step 4/4 | val loss " in shown
    summary = lines[-1]
    assert summary.startswith(f"done: step 4/4 | loss {result.losses[4]:.4f} | ")
    assert f"val loss {result.val_losses[4]:.4f} (step 4)" in summary
    assert "8,192 tokens seen" in summary  # 4 steps of 16 × 128 tokens
    assert " elapsed | " in summary and "tok/s, MFU n/a over 4 steps" in summary
    assert summary.endswith(f"checkpoint {tmp_path / 'checkpoints' / 'step_4'}")


def test_coda_header_names_the_kernels(tmp_path, capsys):
    run(tmp_path, "block=coda", "block.backend=reference", "block.attention=sdpa", "train.steps=1",
        "model.n_layers=1")
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("codatrain | block=coda (stages reference, attention sdpa) | tiny: ")


def test_readme_multiprocess_example_has_its_own_run_dir():
    """Run after `python scripts/train.py`, a torchrun line without its own run dir would resume the
    finished tiny run and train nothing."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = "torchrun --nproc_per_node=2 scripts/train.py"
    lines = [line for line in readme.splitlines() if line.startswith(command)]
    assert lines and all("train.run_dir=" in line for line in lines)


def test_tokens_seen_are_counted_across_a_resume_with_another_batch_size(tmp_path, capsys):
    """The summary and the metrics count the tokens each step trained: 3 steps of 16 × 128 tokens,
    then 2 of 32 × 128 after the resume (step × this run's tokens_per_step said 20,480)."""
    run(tmp_path, "data=synthetic", "train.steps=3", "train.micro_batch_size=16", "checkpoint.at_end=true")
    capsys.readouterr()
    run(tmp_path, "data=synthetic", "train.steps=5", "train.micro_batch_size=32")
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "14,336 tokens seen" in summary
    seen = {r["step"]: r["tokens_seen"] for r in read_records(tmp_path) if "tokens_seen" in r}
    assert seen == {1: 2048, 2: 4096, 3: 6144, 4: 10240, 5: 14336}


def test_a_resume_at_or_past_train_steps_says_there_is_nothing_to_train(tmp_path, capsys):
    run(tmp_path, "data=synthetic", "train.steps=3", "checkpoint.at_end=true")
    capsys.readouterr()
    result = run(tmp_path, "data=synthetic", "train.steps=2")
    out = capsys.readouterr().out
    assert "resumed at step 3, which train.steps=2 does not go past: nothing to train" in out
    assert result.losses == {} and out.splitlines()[-1].startswith("done: step 3/2 | ")


def test_a_checkpoint_without_its_token_count_is_counted_at_this_runs_batch_and_says_so(tmp_path, capsys):
    run(tmp_path, "data=synthetic", "train.steps=2", "checkpoint.at_end=true")
    manifest_path = tmp_path / "checkpoints" / "step_2" / "checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["tokens_seen"]  # as an earlier version wrote it
    manifest_path.write_text(json.dumps(manifest))
    capsys.readouterr()
    run(tmp_path, "data=synthetic", "train.steps=3", "train.micro_batch_size=32")
    out = capsys.readouterr().out
    assert "does not record the tokens trained (saved by an earlier version): counting its 2 steps at " \
           "this run's 4096 tokens a step" in out
    assert "12,288 tokens seen" in out.splitlines()[-1]
