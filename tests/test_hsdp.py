"""HSDP: the data-parallel mesh (parallel.dp_replicate × parallel.dp_shard) on 4 gloo processes.

Full sharding (1×4), HSDP (2×2) and pure replication (4×1) train the same losses as one process at
the same global batch, with validation and checkpoints on; a checkpoint saved on 2×2 resumes on
other meshes and on one process with the next losses of the uninterrupted run.
"""

import pytest
from mesh_runs import launch

from codatrain.config import load_config, validate
from codatrain.train.checkpoint import inspect_checkpoint
from codatrain.train.logger import read_losses, read_records
from codatrain.train.plan import DataParallelMesh, data_parallel_mesh
from codatrain.train.trainer import train

STEPS = 10
# 4 processes × 1 micro-batch of 2 windows, or 1 process × 4: the same 8 windows per step.
COMMON = [
    "train.log_every=1", "train.progress=false", "data=synthetic", "data.num_workers=0",
    "data.seq_len=32", "train.micro_batch_size=2", "train.tokens_per_step=256", "model.n_layers=2",
    "optim.warmup_steps=2", f"train.steps={STEPS}", "train.val_every=5", "train.val_batches=3",
    "checkpoint.every=5",
]
MESHES = {"1x4": ["parallel.dp_replicate=1"], "2x2": ["parallel.dp_replicate=2"],
          "4x1": ["parallel.dp_replicate=4", "parallel.dp_shard=1"]}
# fp32 on CPU: only the order of the gradient sums differs between meshes and accumulation.
REL = 1e-5


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_records(run_dir) if "val_loss" in r}


def assert_close(losses: dict[int, float], reference: dict[int, float], what: str) -> None:
    assert sorted(losses) == sorted(reference), what
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=REL), f"{what}, step {step}"


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """The three meshes trained from scratch, then the 2×2 checkpoint of step 5 resumed on 4×1, in
    one 4-process job; the run dir of each."""
    root = tmp_path_factory.mktemp("meshes")
    dirs = {name: root / name for name in [*MESHES, "2x2_on_4x1"]}
    runs = [[*COMMON, *overrides, f"train.run_dir={dirs[name]}"] for name, overrides in MESHES.items()]
    runs.append([*COMMON, *MESHES["4x1"], f"train.run_dir={dirs['2x2_on_4x1']}",
                 f"checkpoint.resume={dirs['2x2'] / 'checkpoints/step_5'}"])
    output = launch(4, runs, root)
    assert "4 × cpu (HSDP 2 replicas × 2 shards)" in output and "4 × cpu (replicate 4)" in output
    return dirs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run on one process: 4 accumulated micro-batches per step."""
    run_dir = tmp_path_factory.mktemp("one")
    result = train(load_config([*COMMON, f"train.run_dir={run_dir}"]))
    assert len(result.losses) == STEPS and sorted(result.val_losses) == [5, 10]
    return run_dir


@pytest.mark.slow
def test_full_shard_hsdp_and_replicate_train_as_one_process(meshes, one_process):
    reference, reference_val = read_losses(one_process), val_losses(one_process)
    for name in MESHES:
        assert_close(read_losses(meshes[name]), reference, name)
        assert_close(val_losses(meshes[name]), reference_val, f"{name} validation")
        manifest = inspect_checkpoint(meshes[name] / "checkpoints/step_10")
        assert manifest["world_size"] == 4 and manifest["step"] == STEPS


@pytest.mark.slow
def test_a_2x2_checkpoint_resumes_on_other_meshes_and_one_process(meshes, one_process, tmp_path):
    step_5 = meshes["2x2"] / "checkpoints/step_5"
    uninterrupted = read_losses(meshes["2x2"])
    after_5 = {step: loss for step, loss in uninterrupted.items() if step > 5}
    launch(2, [[*COMMON, "parallel.dp_replicate=1", f"train.run_dir={tmp_path / 'on_1x2'}",
                f"checkpoint.resume={step_5}"]], tmp_path)
    one = train(load_config([*COMMON, f"train.run_dir={tmp_path / 'on_1'}", f"checkpoint.resume={step_5}"]))
    resumed = {"4x1": read_losses(meshes["2x2_on_4x1"]), "1x2": read_losses(tmp_path / "on_1x2"),
               "1 process": one.losses}
    for name, losses in resumed.items():
        # The loader continues from the global window offset of step 5: the same windows per step.
        assert_close(losses, after_5, f"2x2 step 5 resumed on {name}")


def test_mesh_degrees():
    def mesh(*overrides, world_size=4, local_world_size=4):
        parallel = validate(load_config(list(overrides))).parallel
        return data_parallel_mesh(parallel, world_size, local_world_size)

    assert mesh() == DataParallelMesh(1, 4)
    assert mesh("parallel.dp_replicate=2") == DataParallelMesh(2, 2)
    assert mesh("parallel.dp_replicate=4", "parallel.dp_shard=1") == DataParallelMesh(4, 1)
    # auto: one replica per node, sharded over its processes.
    assert mesh("parallel.dp_replicate=auto", world_size=16, local_world_size=8) == DataParallelMesh(2, 8)
    assert mesh("parallel.dp_replicate=auto", local_world_size=4) == DataParallelMesh(1, 4)
    with pytest.raises(ValueError, match=r"parallel.dp_replicate × parallel.dp_shard = 2 × 3 = 6, but the "
                                         r"job has 4 processes"):
        mesh("parallel.dp_replicate=2", "parallel.dp_shard=3")
    with pytest.raises(ValueError, match=r"= 3 × 1 = 3, but the job has 4 processes"):
        mesh("parallel.dp_replicate=3", "parallel.dp_shard=1")
    # dp_shard=-1 with replicas that do not divide the processes (it said "2 × 0 = 0" on one process).
    for replicas, world_size in ((3, 4), (2, 1)):
        with pytest.raises(ValueError, match=rf"parallel.dp_replicate={replicas} replicas do not divide the "
                                             rf"job's {world_size} processes \(parallel.dp_shard=-1"):
            mesh(f"parallel.dp_replicate={replicas}", world_size=world_size)
    with pytest.raises(ValueError, match="6 processes are not a multiple of 4 per node"):
        mesh("parallel.dp_replicate=auto", world_size=6)


@pytest.mark.parametrize("override, message", [
    ("parallel.dp_replicate=0", "parallel.dp_replicate must be a positive number or auto, got '0'"),
    ("parallel.dp_replicate=nodes", "parallel.dp_replicate must be a positive number or auto"),
    ("parallel.dp_shard=0", "parallel.dp_shard must be positive or -1"),
])
def test_bad_mesh_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        validate(load_config([override]))
