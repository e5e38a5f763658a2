"""parallel.fp8_all_gather: FSDP2 gathers the FP8 CODA layer weights in e4m3 (train/fp8_allgather.py).

The gathered operands are bitwise the unsharded path's (the hooks called directly, one process);
2 gloo processes train, validate, checkpoint and resume with it on exactly as with it off while
the layer weights cross the all-gather in one byte per value (counted); checkpoints stay the
canonical fp32 tensors; the key's refusals.
"""

import json
from pathlib import Path

import pytest
import torch
from gather_bytes_runs import BYTES_FILE
from mesh_runs import launch
from safetensors import safe_open

from codatrain.config import load_config, validate
from codatrain.kernels.fp8 import E4M3, Fp8Recipe, Fp8Weight, fp8_max, quantize, scale_from_amax
from codatrain.train.fp8_allgather import Fp8GatherShard
from codatrain.train.logger import read_losses, read_records
from codatrain.train.plan import build_run_plan

GATHER_BYTES_RUNS = str(Path(__file__).parent / "gather_bytes_runs.py")
FP8 = ["block=coda", "block.backend=reference", "block.attention=sdpa", "block.precision=fp8"]


class _Mesh:
    """The one thing the hooks ask of FSDP2's shard mesh."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _gathered(weight: torch.Tensor, ranks: int, compute_dtype: torch.dtype, margin: int) -> Fp8Weight:
    """What FSDP2 makes of `weight` sharded by rows over `ranks` (padded as FSDP2 pads): each
    shard's pre-all-gather, the concatenation the all-gather is, the post-all-gather."""
    shards = [Fp8GatherShard(rows, compute_dtype, margin) for rows in weight.chunk(ranks)]
    amax = torch.stack([shard.local_amax() for shard in shards]).amax()  # refresh_scales' all-reduce
    inputs = []
    for shard in shards:
        shard.scale = scale_from_amax(amax, fp8_max(E4M3), margin)
        (data,), metadata = shard.fsdp_pre_all_gather(_Mesh(ranks), weight.shape, weight.stride(), None, None)
        inputs.append(data)
    gathered, inner = shards[0].fsdp_post_all_gather((torch.cat(inputs),), metadata, compute_dtype)
    assert inner == (gathered.fp8_data,)
    # FSDP2 views the gathered buffer in the weight's shape and makes it the module's parameter.
    param = torch.nn.Parameter(torch.as_strided(gathered, weight.shape, weight.stride()))
    assert isinstance(param, Fp8Weight) and param.dtype == compute_dtype and param.requires_grad
    return param


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ranks, margin", [(2, 0), (3, 1)])  # 3 ranks: 10 rows pad to 4 per rank
def test_the_gathered_operands_are_bitwise_those_of_quantizing_the_gathered_weight(compute_dtype, ranks,
                                                                                   margin):
    torch.manual_seed(0)
    weight = torch.randn(10, 16) * 3
    weight[7, 3] = 900.0  # beyond e4m3's range at scale 1: the amax is one rank's
    param = _gathered(weight, ranks, compute_dtype, margin)
    recipe = Fp8Recipe(margin=margin)
    for for_dgrad in (False, True):
        # The unsharded path: FSDP2 gathers the weight in the compute dtype, the model quantizes it.
        want = quantize(weight.to(compute_dtype), recipe.weight(for_dgrad=for_dgrad))
        got = param.operand(for_dgrad=for_dgrad)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale) and got.dtype == compute_dtype
        if for_dgrad:  # the dgrad's transposed copy, moved from the same bytes
            assert got.data_t.is_contiguous()
            assert torch.equal(got.data_t.view(torch.uint8), want.data.t().view(torch.uint8))


def test_an_fp8_weight_refuses_arithmetic_and_a_gather_needs_its_scale():
    param = _gathered(torch.randn(4, 8), 2, torch.float32, 0)
    with pytest.raises(NotImplementedError, match="an FP8 GEMM operand only"):
        param * 2
    shard = Fp8GatherShard(torch.randn(2, 8), torch.float32, 0)
    with pytest.raises(RuntimeError, match="refresh_scales"):
        shard.fsdp_pre_all_gather(_Mesh(2), torch.Size([4, 8]), (8, 1), None, None)


# ---- 2 gloo processes ---------------------------------------------------------------------------

COMMON = [
    *FP8, "train.log_every=1", "train.progress=false", "data=synthetic", "data.num_workers=0",
    "data.seq_len=64", "train.micro_batch_size=2", "train.tokens_per_step=512", "optim.warmup_steps=2",
    "train.steps=4", "train.val_every=2", "train.val_batches=2", "checkpoint.every=2",
]


def _tensors(checkpoint: Path) -> dict[str, tuple]:
    """Every tensor a checkpoint holds: its key, dtype and shape in the files."""
    found = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                found[f"{file.name.split('-model')[0]}:{key}"] = (piece.get_dtype(), tuple(piece.get_shape()))
    return found


def _numbers(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each step's loss, gradient norm and validation loss (not its timings)."""
    keep = ("loss", "grad_norm", "val_loss")
    return {r["step"]: {k: r[k] for k in keep if k in r} for r in read_records(run_dir)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-process job: FP8 CODA with the FP8 all-gather (the default on 2 shards), without it,
    and with it resuming the run without it from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("fp8_all_gather")
    runs = {"on": [], "off": ["parallel.fp8_all_gather=false"],
            "resumed": [f"checkpoint.resume={root / 'off/checkpoints/step_2'}"]}
    output = launch(2, [[*COMMON, *extra, f"train.run_dir={root / name}"] for name, extra in runs.items()],
                    root, script=GATHER_BYTES_RUNS)
    assert output.count("weights all-gathered in fp8") == 2
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_two_ranks_train_validate_and_resume_bitwise_as_without_it(two_ranks):
    """Bitwise, not to a tolerance: the gathered FP8 operands are the unsharded path's bit for bit
    (the test above), and everything else (the compute-dtype gather of the other parameters, the
    gradients' reduce-scatter) is the same computation in the same order."""
    on, off = (_numbers(two_ranks[name]) for name in ("on", "off"))
    assert on == off and len(on) == 4 and sum("val_loss" in r for r in on.values()) == 2
    uninterrupted = read_losses(two_ranks["on"])
    assert read_losses(two_ranks["resumed"]) == {s: loss for s, loss in uninterrupted.items() if s > 2}


@pytest.mark.slow
def test_the_layer_weights_are_gathered_in_one_byte_and_checkpoints_stay_canonical(two_ranks):
    on, off = (json.loads((two_ranks[name] / BYTES_FILE).read_text()) for name in ("on", "off"))
    assert on["fp8"] > 0 and off["fp8"] == 0
    # The same gathers, the FP8 weights' one byte a value where fp32 (the CPU's compute dtype) took four.
    assert off["total"] - on["total"] == 3 * on["fp8"]
    for step in (2, 4):
        checkpoints = [two_ranks[name] / f"checkpoints/step_{step}" for name in ("on", "off")]
        assert _tensors(checkpoints[0]) == _tensors(checkpoints[1])
    weights = {key: dtype for key, (dtype, _) in _tensors(checkpoints[0]).items() if ":model." in key}
    assert weights and set(weights.values()) == {"F32"}


@pytest.mark.slow
def test_hsdp_2x2_trains_bitwise_as_without_it(tmp_path):
    """4 processes, 2 replicas of 2 shards: the gather and the scales' all-reduce within and across
    the groups (every rank ends with the same scales)."""
    hsdp = [*COMMON, "parallel.dp_replicate=2"]
    runs = [[*hsdp, f"parallel.fp8_all_gather={on}", f"train.run_dir={tmp_path / on}"]
            for on in ("true", "false")]
    output = launch(4, runs, tmp_path, script=GATHER_BYTES_RUNS)
    assert output.count("HSDP 2 replicas × 2 shards") == 2
    assert _numbers(tmp_path / "true") == _numbers(tmp_path / "false")
    gathered = json.loads((tmp_path / "true" / BYTES_FILE).read_text())
    assert gathered["fp8"] > 0


# ---- the key -------------------------------------------------------------------------------------


def _plan(overrides: list[str], world_size: int = 1):
    run = validate(load_config([*overrides, "train.micro_batch_size=2"]))
    return build_run_plan(run, torch.device("cpu"), world_size)


def test_auto_gathers_in_fp8_when_fsdp_shards_an_fp8_model():
    assert _plan(FP8, 2).fp8_all_gather and "weights all-gathered in fp8" in _plan(FP8, 2).header()[0]
    assert not _plan(FP8, 1).fp8_all_gather  # one process: nothing is gathered
    assert not _plan([*FP8, "parallel.dp_replicate=2"], 2).fp8_all_gather  # replication only
    assert _plan([*FP8, "parallel.dp_replicate=2", "parallel.dp_shard=2"], 4).fp8_all_gather  # HSDP
    assert not _plan([*FP8, "parallel.fp8_all_gather=false"], 2).fp8_all_gather
    assert _plan([*FP8, "parallel.fp8_all_gather=true"], 1).fp8_all_gather
    assert not _plan(["block=coda"], 2).fp8_all_gather


@pytest.mark.parametrize("block, named", [(["block=coda"], "block.precision=bf16"), ([], "block=eager")])
def test_fp8_all_gather_true_without_the_fp8_block_is_refused_by_name(block, named):
    with pytest.raises(ValueError, match=rf"^parallel.fp8_all_gather=true gathers the FP8 CODA block's layer "
                                         rf"weights in FP8: it needs block=coda with block.precision=fp8, "
                                         rf"not {named}$"):
        _plan([*block, "parallel.fp8_all_gather=true"])
