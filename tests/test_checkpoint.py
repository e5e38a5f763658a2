"""Checkpointer on a bare model + optimizer: exact round trips, canonical layouts, completeness
checks, pruning, and resharding from 2 FSDP2 processes (gloo) onto 1."""

import errno
import json
import os
import pickle
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from codatrain.config import CheckpointConfig
from codatrain.model import Llama, get_preset
from codatrain.model.hf import save_hf
from codatrain.model.layout import Canonical
from codatrain.train import checkpoint_files, checkpointer
from codatrain.train.canonical_state import (
    CanonicalMapping,
    canonical_state,
    full_canonical_tensors,
    init_weights,
    state_entries,
    strip_wrapper_prefixes,
)
from codatrain.train.checkpoint import CheckpointError, inspect_checkpoint, replace_dir
from codatrain.train.checkpointer import Checkpointer
from codatrain.train.hf_io import load_hf_weights
from codatrain.train.parallelize import apply_activation_checkpointing

CFG = get_preset("tiny").replace(n_layers=2, vocab_size=203)  # 203 rows: uneven FSDP2 shards


class PermutedLlama(Llama):
    """The eager model with a non-canonical layout (rows of the fused projections reversed), a
    stand-in for CODA's interleaved layouts."""

    def layout(self):
        reversed_rows = {"qkv_proj.weight": self.cfg.qkv_dim, "gate_up_proj.weight": 2 * self.cfg.ffn_dim}
        table = super().layout()
        for name in table:
            for suffix, rows in reversed_rows.items():
                if name.endswith(suffix):
                    table[name] = Canonical(name, torch.arange(rows).flip(0))
        return table


class Counter:
    """A data loader's state: `offset` is global (the same on every rank), `rank` is not."""

    def __init__(self, rank=0):
        self.offset, self.rank = 0, rank

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, state):
        self.offset = state["offset"]


class PerRank(Counter):
    def state_dict(self):
        return {"offset": self.offset, "rank": self.rank}


class Run:
    """Model, AdamW, LR schedule and loaders, as the trainer holds them."""

    def __init__(self, run_dir, model_cls=Llama, shard=False, rank=0, logs=None, wrap=False, **ckpt):
        torch.manual_seed(0)
        self.model = model_cls(CFG)
        self.model.init_weights(0)
        if wrap:
            apply_activation_checkpointing(self.model)
        if shard:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.layers:
                fully_shard(block)
            fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 / (1 + s))
        self.loaders = {"train": Counter(rank), "val": PerRank(rank)}
        self.logs = [] if logs is None else logs
        self.ckpt = Checkpointer(CheckpointConfig(**ckpt), run_dir, CFG, self.model, self.optimizer,
                                 self.scheduler, self.loaders, log=self.logs.append)

    def step(self):
        loader = self.loaders["train"]
        g = torch.Generator().manual_seed(loader.offset)
        loader.offset += 1
        tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
        loss = self.model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return loss.item()

    def canonical(self):
        """Full canonical model and optimizer tensors (gathered when sharded)."""
        tensors, _ = canonical_state(self.model, self.optimizer, CanonicalMapping(self.model))
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in tensors.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_continues_bit_exactly(tmp_path):
    run = Run(tmp_path)
    assert run.ckpt.restore() == 0
    for _ in range(3):
        run.step()
    run.ckpt.save(3, tokens_seen=3 * 512)
    expected = [run.step() for _ in range(3)]

    resumed = Run(tmp_path)
    assert resumed.ckpt.restore() == 3
    assert resumed.loaders["train"].offset == 3
    assert resumed.scheduler.last_epoch == 3
    assert [resumed.step() for _ in range(3)] == expected
    assert_same(resumed.canonical(), run.canonical())


def test_layouts_share_one_canonical_checkpoint(tmp_path):
    """A checkpoint from one layout loads into another; saving from the permuted layout stores
    canonical tensors."""
    eager = Run(tmp_path / "a")
    eager.step()
    eager.ckpt.save(1, tokens_seen=1 * 512)
    permuted = Run(tmp_path / "b", model_cls=PermutedLlama, resume=str(tmp_path / "a/checkpoints/step_1"))
    assert permuted.ckpt.restore() == 1
    qkv = "layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(permuted.model.get_parameter(qkv), eager.model.get_parameter(qkv).flip(0))
    assert_same(permuted.canonical(), eager.canonical())
    permuted.ckpt.save(1, tokens_seen=1 * 512)
    back = Run(tmp_path / "c", resume=str(tmp_path / "b/checkpoints/step_1"))
    back.ckpt.restore()
    assert_same(back.canonical(), eager.canonical())


def test_wrapper_prefixes_stay_out_of_checkpoints(tmp_path):
    wrapped = Run(tmp_path / "a", wrap=True)
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.model.named_parameters())
    wrapped.step()
    step_dir = wrapped.ckpt.save(1, tokens_seen=1 * 512)
    plain = Run(tmp_path / "b", resume=str(step_dir))
    assert plain.ckpt.restore() == 1
    assert_same(plain.canonical(), wrapped.canonical())
    assert "model.layers.0.self_attn.qkv_proj.weight" in plain.canonical()


@pytest.mark.parametrize("model_cls", [Llama, PermutedLlama])
def test_the_trainers_init_of_a_wrapped_model_equals_the_models_own(model_cls):
    plain, wrapped = model_cls(CFG), model_cls(CFG)
    plain.init_weights(seed=4)
    apply_activation_checkpointing(wrapped)
    init_weights(wrapped, seed=4)
    wrapped_state = {strip_wrapper_prefixes(k): v for k, v in wrapped.state_dict().items()}
    assert_same(wrapped_state, plain.state_dict())
    assert not torch.equal(plain.lm_head.weight, model_cls(CFG).lm_head.weight)  # the seed was used


def test_resuming_and_importing_unpickle_nothing(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    save_hf(tmp_path / "hf", CFG, run.model.state_dict().items())

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    assert Run(tmp_path).ckpt.restore() == 1
    load_hf_weights(Llama(CFG), tmp_path / "hf", CFG, print)


CORRUPTIONS = {
    "truncated shard": lambda d: _truncate(next(d.glob("*.safetensors"))),
    "no manifest (partial save)": lambda d: (d / "checkpoint.json").unlink(),
    "garbage manifest": lambda d: (d / "checkpoint.json").write_text("{not json"),
    "missing rank file": lambda d: (d / "rank_00000.json").unlink(),
    "garbage shard header": lambda d: _overwrite_start(next(d.glob("*.safetensors"))),
    "flipped bits in tensor data": lambda d: flip_bytes(next(d.glob("*.safetensors"))),
}


def flip_bytes(path: Path, n: int = 32):
    """Invert n bytes in the middle of a file: same size, headers intact, tensor data wrong."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        data = f.read(n)
        f.seek(path.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path: Path):
    os.truncate(path, path.stat().st_size // 2)


def _overwrite_start(path: Path):
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupted_checkpoint_is_skipped_by_auto_and_an_error_when_named(tmp_path, corruption):
    run = Run(tmp_path, keep_last=0)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    run.step()
    run.ckpt.save(2, tokens_seen=2 * 512)
    bad = tmp_path / "checkpoints/step_2"
    CORRUPTIONS[corruption](bad)
    with pytest.raises(CheckpointError):
        inspect_checkpoint(bad)

    auto = Run(tmp_path)
    assert auto.ckpt.restore() == 1
    assert any("skipping" in line and "step_2" in line for line in auto.logs)
    with pytest.raises(CheckpointError, match="step_2"):
        Run(tmp_path, resume=str(bad)).ckpt.restore()


def test_interrupted_save_is_ignored_and_cleaned_up(tmp_path):
    run = Run(tmp_path)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    for name in (".tmp-step_2", ".tmp-step_9"):  # what crashes in the middle of saves leave
        stale = tmp_path / "checkpoints" / name
        stale.mkdir()
        (stale / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")
        (stale / "optimizer-partial.bin").write_bytes(b"partial")
    assert Run(tmp_path).ckpt.restore() == 1
    run.step()
    run.ckpt.save(2, tokens_seen=2 * 512)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_2"]
    # The new checkpoint holds what its manifest lists, nothing of the crashed save's files.
    step_2 = tmp_path / "checkpoints/step_2"
    assert sorted(p.name for p in step_2.iterdir()) == sorted([*inspect_checkpoint(step_2)["files"],
                                                               "checkpoint.json"])


def test_an_export_interrupted_before_clears_its_partial_folder(tmp_path):
    run = Run(tmp_path)
    stale = tmp_path / "hf/.tmp-step_1"  # what a crash in the middle of an export leaves
    stale.mkdir(parents=True)
    (stale / "tokenizer.json").write_text("{}")  # another tokenizer's: this run's is bytes (none)
    out = run.ckpt.export_hf(1)
    assert not stale.exists()
    assert not list(out.glob("tokenizer*"))


def test_saving_a_step_again_replaces_its_checkpoint(tmp_path):
    run = Run(tmp_path)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)  # the same step again: the new checkpoint takes the old one's place
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    resumed = Run(tmp_path)
    assert resumed.ckpt.restore() == 1
    assert resumed.loaders["train"].offset == 2  # the second save's state
    assert_same(resumed.canonical(), run.canonical())


@pytest.mark.parametrize("keep_last, kept", [(1, ["step_4"]), (2, ["step_3", "step_4"])])
def test_keep_last_prunes_older_checkpoints(tmp_path, keep_last, kept):
    run = Run(tmp_path, keep_last=keep_last)
    for step in range(1, 5):
        run.step()
        run.ckpt.save(step, tokens_seen=step * 512)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept


def test_the_checkpoint_just_saved_is_never_pruned(tmp_path):
    """A run resumed from an older checkpoint by name (a branch) keeps each checkpoint it saves,
    even when newer steps of the first run fill `keep_last`."""
    run = Run(tmp_path, keep_last=0)
    for step in (1, 2, 3, 4):
        run.step()
        run.ckpt.save(step, tokens_seen=step * 512)
    branch = Run(tmp_path, resume=str(tmp_path / "checkpoints/step_1"), keep_last=1)
    assert branch.ckpt.restore() == 1
    branch.step()
    assert branch.ckpt.save(2, tokens_seen=2 * 512).is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_saving_reads_each_earlier_checkpoint_once(tmp_path, monkeypatch):
    """Pruning checks the checksums of a checkpoint this process has not written or resumed (that
    reads all of it) once; the one resumed and the ones written are known good."""
    run = Run(tmp_path, keep_last=0)
    for step in (1, 2):
        run.step()
        run.ckpt.save(step, tokens_seen=step * 512)
    resumed = Run(tmp_path, keep_last=5)
    assert resumed.ckpt.restore() == 2
    inspected = []

    def recording(path, **kwargs):
        inspected.append(Path(path).name)
        return inspect_checkpoint(path, **kwargs)

    monkeypatch.setattr(checkpointer, "inspect_checkpoint", recording)
    for step in (3, 4):
        resumed.step()
        resumed.ckpt.save(step, tokens_seen=step * 512)
    assert inspected == ["step_1"]


def test_every_step_saves_and_exports_with_an_interval_of_one(tmp_path):
    run = Run(tmp_path, every=1, save_hf_every=1)
    run.ckpt.after_step(1, total_steps=3, tokens_seen=512)
    assert (tmp_path / "checkpoints/step_1").is_dir() and (tmp_path / "hf/step_1").is_dir()


def test_resume_none_refuses_to_mix_with_existing_checkpoints(tmp_path):
    run = Run(tmp_path)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    with pytest.raises(CheckpointError) as error:
        Run(tmp_path, resume="none").ckpt.restore()
    assert str(error.value) == (
        f"checkpoint.resume=none, but {tmp_path / 'checkpoints'} holds checkpoints of an earlier run that "
        "later saves would mix with: resume them (checkpoint.resume=auto), or use another train.run_dir"
    )


def test_a_resume_value_that_is_neither_a_keyword_nor_a_directory_lists_the_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as error:
        Run(tmp_path, resume="never").ckpt.restore()
    assert str(error.value) == ("checkpoint.resume=never: no such checkpoint directory; checkpoint.resume "
                                "takes auto, none or a step_<n> directory")


def test_an_interrupted_finetuning_run_resumes_its_own_checkpoint_not_init_from(tmp_path):
    base = Run(tmp_path / "base")
    base.step()
    init_from = base.ckpt.save(1, tokens_seen=1 * 512)
    finetune = Run(tmp_path / "ft", init_from=str(init_from))
    assert finetune.ckpt.restore() == 0
    for _ in range(2):
        finetune.step()
    own = finetune.ckpt.save(2, tokens_seen=2 * 512)
    again = Run(tmp_path / "ft", init_from=str(init_from))
    assert again.ckpt.restore() == 2
    assert_same(again.canonical(), finetune.canonical())
    assert again.logs[-2:] == [f"checkpoint.init_from={init_from} ignored: resuming from {own}",
                               f"resumed from {own} at step 2"]


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    run = Run(tmp_path)
    run.step()
    run.ckpt.save(1, tokens_seen=1 * 512)
    manifest_path = tmp_path / "checkpoints/step_1/checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_config"]["n_layers"] = 3
    manifest_path.write_text(json.dumps(manifest))
    other = r"checkpoint .*step_1 holds a different model \(n_layers: 3 there, 2 here\).*model\.n_layers=3"
    with pytest.raises(CheckpointError, match=other):
        Run(tmp_path).ckpt.restore()
    step_1 = tmp_path / "checkpoints/step_1"
    with pytest.raises(CheckpointError) as error:
        Run(tmp_path / "b", resume=str(step_1)).ckpt.restore()
    assert str(error.value) == (
        f"checkpoint.resume={step_1} is another experiment's: checkpoint {step_1} holds a different model "
        "(n_layers: 3 there, 2 here); to match it, set model.n_layers=3. Resume it with the settings it was "
        "started with, or leave checkpoint.resume unset")


def test_a_stop_saves_when_the_last_checkpoint_or_the_start_is_stop_save_after_steps_back(tmp_path):
    run = Run(tmp_path, stop_save_after=2)
    assert run.ckpt.on_stop(1, tokens_seen=1 * 512) is None  # one step after the start: nothing saved
    step_2 = run.ckpt.on_stop(2, tokens_seen=2 * 512)
    assert step_2 == tmp_path / "checkpoints/step_2" and step_2.is_dir()
    assert run.ckpt.on_stop(3, tokens_seen=3 * 512) == step_2  # one step after step 2: that one is kept
    resumed = Run(tmp_path, stop_save_after=2)
    assert resumed.ckpt.restore() == 2
    # the checkpoint resumed from counts as the last one
    assert resumed.ckpt.on_stop(3, tokens_seen=3 * 512) == step_2
    assert Run(tmp_path / "off", stop_save_after=0).ckpt.on_stop(5, tokens_seen=5 * 512) is None
    assert not (tmp_path / "off/checkpoints").exists()


def test_init_from_a_checkpoint_of_another_model_names_it(tmp_path):
    step_1 = Run(tmp_path / "a").ckpt.save(1, tokens_seen=1 * 512)
    wider = CFG.replace(ffn_dim=2 * CFG.ffn_dim)
    model = Llama(wider)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(CheckpointConfig(init_from=str(step_1)), tmp_path / "b", wider, model, optimizer,
                        scheduler, {}, print)
    with pytest.raises(CheckpointError) as error:
        ckpt.restore()
    assert str(error.value) == (
        f"checkpoint {step_1} holds a different model (ffn_dim: 384 there, 768 here); to match it, set "
        "model.ffn_dim=384, or model=hf, which takes the architecture from checkpoint.init_from"
    )


def test_a_checkpoint_with_another_number_of_parameter_groups_is_a_clear_error(tmp_path):
    step_1 = Run(tmp_path / "a").ckpt.save(1, tokens_seen=1 * 512)
    model = Llama(CFG)
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim != 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(CheckpointConfig(resume=str(step_1)), tmp_path / "b", CFG, model, optimizer,
                        scheduler, {}, print)
    with pytest.raises(CheckpointError) as error:
        ckpt.restore()
    assert str(error.value) == f"{step_1}: the optimizer has 2 parameter groups, the checkpoint 1"


def test_a_loader_state_that_is_not_json_is_a_one_line_save_error(tmp_path):
    run = Run(tmp_path)
    run.loaders["train"].offset = {1, 2}  # a set: not JSON-serializable
    not_json = r"\(TypeError: the data-loader state must be JSON-serializable: Object of type set is not JSON"
    with pytest.raises(CheckpointError, match=not_json):
        run.ckpt.save(1, tokens_seen=1 * 512)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_resume_restores_the_rng_and_starts_a_loader_without_saved_state_over(tmp_path):
    run = Run(tmp_path)
    run.step()
    torch.rand(1)  # the RNG state saved is not the one a fresh Run starts from
    step_1 = run.ckpt.save(1, tokens_seen=1 * 512)
    state = json.loads((step_1 / "rank_00000.json").read_text())
    del state["loaders"]["val"]  # as if the run had no validation data when it saved
    manifest = json.loads((step_1 / "checkpoint.json").read_text())
    manifest["files"]["rank_00000.json"] = checkpoint_files.write_json(step_1 / "rank_00000.json", state)
    (step_1 / "checkpoint.json").write_text(json.dumps(manifest))
    resumed = Run(tmp_path)
    resumed.loaders["val"].offset = 3
    assert resumed.ckpt.restore() == 1
    assert torch.get_rng_state().tolist() == state["rng"]["torch"]
    assert (resumed.loaders["train"].offset, resumed.loaders["val"].offset) == (1, 3)
    assert resumed.logs[-2:] == [
        f"warning: {step_1} has no state for the val data; it starts from its beginning",
        f"resumed from {step_1} at step 1",
    ]


def _as_if_saved_by_two_ranks(step_dir: Path, val_offsets: tuple[int, int], same_rng: bool) -> dict:
    """Turn a 1-process checkpoint into what 2 ranks write: a rank_00001.json beside rank_00000.json
    (the same training-loader state; the validation loader's `rank` differs), both listed in the
    manifest with their checksums. Returns rank 0's state."""
    states = []
    for rank, offset in enumerate(val_offsets):
        state = json.loads((step_dir / "rank_00000.json").read_text())
        state["loaders"]["val"] = {"offset": offset, "rank": rank}
        if rank == 1 and not same_rng:
            state["rng"]["torch"] = torch.Generator().manual_seed(99).get_state().tolist()
        states.append(state)
    manifest = json.loads((step_dir / "checkpoint.json").read_text())
    for rank, state in enumerate(states):
        manifest["files"][f"rank_{rank:05d}.json"] = checkpoint_files.write_json(
            step_dir / f"rank_{rank:05d}.json", state)
    manifest["world_size"] = 2
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))
    return states[0]


@pytest.mark.parametrize("same_rng", [True, False], ids=["same_rng", "rng_per_rank"])
def test_resuming_two_ranks_state_on_one_keeps_what_was_the_same_on_every_rank(tmp_path, same_rng):
    """The training loader (the same state on both ranks) and an RNG state shared by the ranks
    continue; the validation loader's per-rank state cannot move to 1 process: it starts over."""
    run = Run(tmp_path)
    run.step()
    torch.rand(1)  # the RNG state saved is not the one a fresh Run starts from
    saved = _as_if_saved_by_two_ranks(run.ckpt.save(1, tokens_seen=512), val_offsets=(5, 5),
                                      same_rng=same_rng)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    resumed = Run(tmp_path)  # seeds torch with 0
    rng_of_run = torch.get_rng_state()
    assert resumed.ckpt.restore() == 1
    assert (resumed.loaders["train"].offset, resumed.loaders["val"].offset) == (1, 0)
    assert resumed.logs.count("warning: the val data state differs per rank and cannot move from 2 to 1 "
                              "processes; that loader starts from its beginning") == 1
    restored = torch.get_rng_state()
    if same_rng:
        assert restored.tolist() == saved["rng"]["torch"]
    else:
        assert torch.equal(restored, rng_of_run) and not torch.equal(restored, before)


# ---- 2 processes (FSDP2, gloo) -> 1 ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reshard_on_two(rank: int, tmp: Path) -> None:
    # 1 -> 2: the single-process checkpoint reshards onto 2 ranks of the permuted layout.
    run = Run(tmp / "two", model_cls=PermutedLlama, shard=True, rank=rank,
              resume=str(tmp / "one/checkpoints/step_1"))
    assert run.ckpt.restore() == 1
    loaded = run.canonical()
    if rank == 0:
        save_file(loaded, str(tmp / "loaded_on_two.safetensors"))
    run.step()
    run.ckpt.save(2, tokens_seen=2 * 512)  # 2 -> 1 in the test
    trained = run.canonical()
    if rank == 0:
        save_file(trained, str(tmp / "saved_by_two.safetensors"))


def _disk_full(self, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _export_fails_after_one_tensor(out_dir, cfg, tensors, tokenizer):
    Path(out_dir).mkdir(parents=True)
    next(iter(tensors))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _rank0_decides(rank: int, tmp: Path) -> None:
    for run_dir in ("fresh", "stale"):
        Run(tmp / run_dir, shard=True, rank=rank).ckpt.save(9, tokens_seen=9 * 512)
    outcomes = {}
    for case, run_dir, resume in [
        ("resume=none", "stale", "none"),
        ("missing rank file", "one", str(tmp / "missing_rank_file")),
        ("odd manifest", "one", str(tmp / "odd_manifest")),
    ]:
        try:
            outcomes[case] = f"resumed at {Run(tmp / run_dir, rank=rank, resume=resume).ckpt.restore()}"
        except CheckpointError as error:
            outcomes[case] = str(error)
    # A full disk on rank 1 only: every rank raises (none waits in a collective), nothing is kept.
    full_disk = Run(tmp / "full_disk", shard=True, rank=rank)
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(checkpoint_files.HashingStream, "write", _disk_full)
        try:
            full_disk.ckpt.save(3, tokens_seen=3 * 512)
        except CheckpointError as error:
            outcomes["disk full on rank 1"] = str(error)
    # An HF export that rank 0 gives up part of the way: every rank raises, none waits in a gather.
    with pytest.MonkeyPatch.context() as patch:
        if rank == 0:
            patch.setattr(checkpointer, "save_hf_with_tokenizer", _export_fails_after_one_tensor)
        try:
            full_disk.ckpt.export_hf(3)
        except CheckpointError as error:
            outcomes["hf export fails on rank 0"] = str(error)
    (tmp / f"outcomes_{rank}.json").write_text(json.dumps(outcomes))


def _two_rank_worker(rank: int, world_size: int, port: int, tmp: str) -> None:
    """The work of both 2-rank tests below, one after the other in one process group (a spawn of two
    interpreters costs seconds of CI)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank left waiting for an answer fails the test in a minute instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        _reshard_on_two(rank, Path(tmp) / "reshard")
        _rank0_decides(rank, Path(tmp) / "rank0")
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """The single-process checkpoints both 2-rank tests start from, then their 2 ranks' work; the
    folder of each test and the state that the single process saved."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    one = Run(tmp / "reshard/one")
    one.step()
    one.ckpt.save(1, tokens_seen=1 * 512)
    saved_by_one = one.canonical()

    rank0 = tmp / "rank0"
    decider = Run(rank0 / "one")
    decider.step()
    source = decider.ckpt.save(1, tokens_seen=1 * 512)
    for name in ("missing_rank_file", "odd_manifest"):
        shutil.copytree(source, rank0 / name)
    (rank0 / "missing_rank_file/rank_00000.json").unlink()
    manifest = json.loads((source / "checkpoint.json").read_text())
    (rank0 / "odd_manifest/checkpoint.json").write_text(json.dumps(manifest | {"files": []}))
    stale = rank0 / "stale/checkpoints/.tmp-step_7"
    stale.mkdir(parents=True)
    (stale / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")

    mp.spawn(_two_rank_worker, args=(2, _free_port(), str(tmp)), nprocs=2)
    return {"reshard": tmp / "reshard", "saved_by_one": saved_by_one, "rank0": rank0}


@pytest.mark.slow
def test_two_processes_reshard_to_one_and_back(two_ranks):
    tmp_path = two_ranks["reshard"]
    assert_same(load_file(tmp_path / "loaded_on_two.safetensors"), two_ranks["saved_by_one"])

    ckpt = tmp_path / "two/checkpoints/step_2"
    assert inspect_checkpoint(ckpt)["world_size"] == 2
    assert len(list(ckpt.glob("*.safetensors"))) == 2
    resumed = Run(tmp_path / "two")
    assert resumed.ckpt.restore() == 2
    assert_same(resumed.canonical(), load_file(tmp_path / "saved_by_two.safetensors"))
    assert resumed.scheduler.last_epoch == 2
    # The global data position carries over; the per-rank one cannot and is reported.
    assert resumed.loaders["train"].offset == 2
    assert resumed.loaders["val"].offset == 0
    assert any("val data state differs per rank" in line for line in resumed.logs)
    assert torch.isfinite(torch.tensor(resumed.step()))


# ---- 2 processes: rank 0 decides and tidies up for every rank --------------------------------------
@pytest.mark.slow
def test_rank_zero_decides_for_every_rank_and_tidies_the_checkpoint_root(two_ranks):
    """With 2 ranks: rank 0 creates the checkpoint root and removes the leftovers of any earlier
    interrupted save (a .tmp-step_7 while saving step 9); what rank 0 finds wrong when choosing the
    checkpoint to resume is raised on every rank, with the real reason; so is a save that fails on
    one rank only (a full disk), whose partial directory is removed, and an HF export that rank 0
    gives up part of the way."""
    tmp_path = two_ranks["rank0"]
    for run_dir in ("fresh", "stale"):
        root = tmp_path / run_dir / "checkpoints"
        assert [p.name for p in root.iterdir()] == ["step_9"], run_dir
        assert inspect_checkpoint(root / "step_9")["world_size"] == 2
    outcomes = [json.loads((tmp_path / f"outcomes_{r}.json").read_text()) for r in (0, 1)]
    assert outcomes[0] == outcomes[1]
    assert "checkpoint.resume=none" in outcomes[0]["resume=none"]
    assert outcomes[0]["missing rank file"].endswith("missing_rank_file: rank_00000.json is missing")
    assert outcomes[0]["odd manifest"].startswith("AttributeError: ")
    assert "OSError on rank 1: [Errno 28] No space left on device" in outcomes[0]["disk full on rank 1"]
    assert list((tmp_path / "full_disk/checkpoints").iterdir()) == []
    assert "(OSError: [Errno 28] No space left on device)" in outcomes[0]["hf export fails on rank 0"]
    assert list((tmp_path / "full_disk/hf").iterdir()) == []


def test_activation_checkpointing_wraps_every_block_but_the_last():
    model = Llama(CFG)
    apply_activation_checkpointing(model)
    wrapped = [type(block).__name__ == "CheckpointWrapper" for block in model.layers]
    assert CFG.n_layers >= 2 and wrapped == [True] * (CFG.n_layers - 1) + [False]


def test_republishing_a_step_replaces_it_and_clears_a_stale_old_copy(tmp_path):
    # A crash between replace_dir's two renames leaves `.tmp-old-step_N`; the next publish of
    # step N must not trip over it, and leaves only the new step behind.
    final, stale, staged = tmp_path / "step_5", tmp_path / ".tmp-old-step_5", tmp_path / ".tmp-step_5"
    for folder, text in ((final, "old"), (stale, "stale"), (staged, "new")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    replace_dir(staged, final)
    assert (final / "weights").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_5"]


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone: FSDP2 shards parameters into DTensors (a mesh
    of one) as on many ranks, without starting processes."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_inits_imports_and_exports_the_canonical_tensors_of_a_plain_one(tmp_path,
                                                                                       one_process_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def sharded_model():
        model = PermutedLlama(CFG)
        for block in model.layers:
            fully_shard(block)
        return fully_shard(model)

    plain = PermutedLlama(CFG)
    plain.init_weights(seed=7)
    expected = dict(full_canonical_tensors(plain, CanonicalMapping(plain)))
    sharded = sharded_model()
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    init_weights(sharded, seed=7)
    exported = dict(full_canonical_tensors(sharded, CanonicalMapping(sharded)))
    assert not any(isinstance(t, DTensor) for t in exported.values())
    assert_same(exported, expected)

    # HF import into a sharded model: each rank takes its shard of the full (bf16) canonical tensor.
    save_hf(tmp_path / "hf", CFG, expected.items(), dtype=torch.bfloat16)
    imported = sharded_model()
    load_hf_weights(imported, tmp_path / "hf", CFG, log=lambda line: None)
    for name, tensor in imported.state_dict().items():
        assert tensor.dtype == torch.float32 and isinstance(tensor, DTensor), name
    assert_same(dict(full_canonical_tensors(imported, CanonicalMapping(imported))),
                {k: v.to(torch.bfloat16).float() for k, v in expected.items()})


def test_a_sharded_model_saves_and_resumes_the_canonical_checkpoint_of_a_plain_one(tmp_path,
                                                                                   one_process_group):
    sharded = Run(tmp_path / "a", model_cls=PermutedLlama, shard=True)
    sharded.step()
    step_1 = sharded.ckpt.save(1, tokens_seen=1 * 512)
    plain = Run(tmp_path / "b", resume=str(step_1))
    assert plain.ckpt.restore() == 1
    assert_same(plain.canonical(), sharded.canonical())
    resharded = Run(tmp_path / "c", model_cls=PermutedLlama, shard=True, resume=str(step_1))
    assert resharded.ckpt.restore() == 1
    assert_same(resharded.canonical(), sharded.canonical())
    qkv = "layers.0.self_attn.qkv_proj.weight"  # canonical rows in the checkpoint, permuted in the models
    canonical_qkv = plain.model.get_parameter(qkv)
    for permuted in (sharded, resharded):
        assert torch.equal(permuted.model.get_parameter(qkv).full_tensor(), canonical_qkv.flip(0))
    assert resharded.step() == sharded.step()


def test_the_canonical_state_holds_tensors_and_the_param_groups_without_their_parameters():
    model = Llama(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mapping = CanonicalMapping(model)
    _, groups = canonical_state(model, optimizer, mapping)
    assert groups == [{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}]
    assert groups[0]["lr"] == 3e-3
    optim_state = {"state": {"lm_head.weight": {"step": 3.0}}}
    with pytest.raises(TypeError, match=r"^optimizer state lm_head.weight.step is a float, not a tensor$"):
        state_entries({}, optim_state, mapping)
