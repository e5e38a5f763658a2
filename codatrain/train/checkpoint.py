"""Training checkpoints (torch.distributed.checkpoint), Hugging Face export, and init_from imports.

A checkpoint is a directory `<run_dir>/checkpoints/step_<n>/`:

    shard-<r+1:05d>-model-00001-of-00001.safetensors   tensors, one file per writing rank (DCP):
        model.<canonical name>                     the parameters
        optim.<canonical name>.<state>             the optimizer state (exp_avg, exp_avg_sq, step)
    rank_<r:05d>.json                              per-rank state: data loaders, RNG
    checkpoint.json                                the manifest, written last: step, world size,
                                                   model config, LR schedule, optimizer
                                                   hyperparameters, the size of every file

Tensors are stored under canonical names and in canonical layouts (those of the eager model)
whichever block implementation trained them, so block=eager and block=coda resume each other's
checkpoints. DCP's Hugging Face storage layer writes them as safetensors with each shard's offsets
in the file header: loading reshards onto any number of processes, and nothing is unpickled (the
rest of the state is JSON; DCP's default format would pickle its index and non-tensor values).

Resuming restores the optimizer's hyperparameters and the LR schedule from the checkpoint (as
torch's own optimizer state dicts do), so changed `optim.*` values take effect only in a fresh run.

A save is atomic: every rank writes into `.tmp-step_<n>/`, then, after a barrier, rank 0 writes
the manifest and renames the directory. A crash mid-save leaves only the temporary directory,
which `resume=auto` ignores and the next save removes.

Resuming on another number of processes: tensors reshard. Per-rank state (data loaders, RNG)
is restored rank by rank when the world size is unchanged. Otherwise a state that was the same on
every saving rank is given to every new rank: codatrain's data loaders count the windows consumed
by all ranks together, so they continue the same sequence, split differently. A state that
differed per rank cannot be mapped onto other ranks; it is dropped with a warning, so that loader
starts from its beginning (data may repeat) or that RNG keeps its seeded state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from codatrain.config import CheckpointConfig
from codatrain.model.config import LlamaConfig
from codatrain.model.hf import DEFAULT_MAX_SHARD_BYTES, HFCheckpoint, config_from_hf, save_hf
from codatrain.model.init import set_full_tensor
from codatrain.model.llama import strip_wrapper_prefixes
from codatrain.train.distributed import barrier

CHECKPOINTS_DIR = "checkpoints"
HF_EXPORTS_DIR = "hf"
MANIFEST = "checkpoint.json"
FORMAT = "codatrain-checkpoint"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
_MANIFEST_KEYS = ("step", "world_size", "model_config", "scheduler", "optimizer_param_groups", "files")
_STEP_DIR = re.compile(r"step_(\d+)")
# Fields that decide tensor shapes or the function the model computes; max_seq_len and init_std
# may change between a checkpoint and the run that loads it.
ARCHITECTURE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
                       "norm_eps")

Log = Callable[[str], None]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or corrupted, or does not fit this run."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _dcp_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Each rank writes its own safetensors file, with its shards' offsets in the header.
    writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True)
    with warnings.catch_warnings():
        # DCP warns on every call without a process group, the intended single-process case.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())


def _dcp_load(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Fill `tensors` in place (each rank its shards) from the checkpoint at `path`."""
    reader = dcp.HuggingFaceStorageReader(str(path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=not dist.is_initialized())


# ---- native ↔ canonical --------------------------------------------------------------------------
def _row_permutation(adapter: Callable[[str, torch.Tensor], torch.Tensor], name: str,
                     shape: torch.Size) -> torch.Tensor | None:
    """The row permutation an adapter applies to tensor `name`, or None for the identity.

    Adapters are per-tensor row permutations (CanonicalLayout), so applying one to a column of
    row indices yields the permutation itself, without touching the (possibly sharded) data.
    """
    if len(shape) == 0:
        return None
    rows = torch.arange(shape[0])
    perm = adapter(name, rows.view(-1, *[1] * (len(shape) - 1))).reshape(-1)
    if not torch.equal(perm.sort().values, rows):
        raise ValueError(f"the layout adapter of {name} is not a row permutation")
    return None if torch.equal(perm, rows) else perm


def _permute_rows(tensor: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    if perm is None:
        return tensor
    if isinstance(tensor, DTensor):
        # Rows move across shards: gather, permute, and let each rank take its shard back.
        full = tensor.full_tensor()[perm.to(tensor.device)]
        return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
    return tensor[perm.to(tensor.device)]


class CanonicalMapping:
    """A model's native parameter names → canonical names, and the row permutations between their
    layouts, which apply equally to parameters and to same-shaped optimizer state.

    Names are used without wrapper prefixes (as DCP's state-dict helpers report them); the model's
    adapters are called with those names.
    """

    def __init__(self, model: nn.Module) -> None:
        self.canonical = {
            strip_wrapper_prefixes(native): strip_wrapper_prefixes(canonical)
            for native, canonical in model.canonical_names().items()  # type: ignore[operator]
        }
        self.shapes: dict[str, torch.Size] = {}
        self._to: dict[str, torch.Tensor | None] = {}
        self._from: dict[str, torch.Tensor | None] = {}
        for name, param in model.named_parameters():
            native = strip_wrapper_prefixes(name)
            self.shapes[native] = param.shape  # the global shape, also for a sharded DTensor
            self._to[native] = _row_permutation(model.to_canonical, native, param.shape)  # type: ignore[arg-type]
            self._from[native] = _row_permutation(model.from_canonical, native, param.shape)  # type: ignore[arg-type]

    def is_identity(self, native: str) -> bool:
        return self._to[native] is None

    def to_canonical(self, native: str, tensor: torch.Tensor) -> torch.Tensor:
        return _permute_rows(tensor, self._to[native])

    def from_canonical(self, native: str, tensor: torch.Tensor) -> torch.Tensor:
        return _permute_rows(tensor, self._from[native])


# (checkpoint key, dict holding the tensor, its key there, native parameter, whether the tensor has
# the parameter's shape and so its layout)
_Entry = tuple[str, dict[str, Any], str, str, bool]


def _entries(model_state: dict[str, Any], optim_state: dict[str, Any],
             mapping: CanonicalMapping) -> list[_Entry]:
    """Every tensor of a model and optimizer state dict (from DCP's helpers) and its checkpoint key."""
    entries = [
        (f"model.{mapping.canonical[native]}", model_state, native, native, True)
        for native in model_state
        if native in mapping.canonical  # buffers are recomputed from the config, not state
    ]
    for native, state in optim_state["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {native}.{key} is a {type(value).__name__}, not a tensor")
            fqn = f"optim.{mapping.canonical[native]}.{key}"
            entries.append((fqn, state, key, native, value.shape == mapping.shapes[native]))
    return entries


def canonical_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    mapping: CanonicalMapping) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The model and optimizer tensors as a flat canonical dict for DCP (sharded tensors stay
    sharded), and the optimizer's param-group hyperparameters."""
    optim_state = get_optimizer_state_dict(model, optimizer)
    tensors = {
        fqn: mapping.to_canonical(native, container[key]) if shaped else container[key]
        for fqn, container, key, native, shaped in _entries(get_model_state_dict(model), optim_state, mapping)
    }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optim_state["param_groups"]]
    return tensors, groups


def load_canonical_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                         mapping: CanonicalMapping, param_groups: list[dict[str, Any]]) -> None:
    """Load model and optimizer from a checkpoint directory, resharding to this run's layout."""
    model_state = get_model_state_dict(model)
    # For an optimizer that has not stepped yet this creates its state, as a template to load into.
    optim_state = get_optimizer_state_dict(model, optimizer)
    if len(param_groups) != len(optim_state["param_groups"]):
        raise CheckpointError(
            f"{path}: the optimizer has {len(optim_state['param_groups'])} parameter groups, the checkpoint "
            f"{len(param_groups)}"
        )
    entries = _entries(model_state, optim_state, mapping)
    # DCP loads in place: straight into the live tensor where layouts agree, else into a buffer.
    template = {
        fqn: container[key] if not shaped or mapping.is_identity(native) else torch.empty_like(container[key])
        for fqn, container, key, native, shaped in entries
    }
    _dcp_load(template, path)
    for fqn, container, key, native, shaped in entries:
        container[key] = mapping.from_canonical(native, template[fqn]) if shaped else template[fqn]
    set_model_state_dict(model, model_state)
    optim_state["param_groups"] = [
        {**saved, "params": current["params"]}
        for saved, current in zip(param_groups, optim_state["param_groups"], strict=True)
    ]
    set_optimizer_state_dict(model, optimizer, optim_state)


def full_canonical_tensors(model: nn.Module, mapping: CanonicalMapping) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as a full canonical tensor, one at a time. With FSDP2 each is gathered, so
    every rank must consume the iterator in step."""
    for native, tensor in get_model_state_dict(model).items():
        if native in mapping.canonical:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield mapping.canonical[native], mapping.to_canonical(native, full)


# ---- files ---------------------------------------------------------------------------------------
def _write_json(path: Path, obj: Any) -> None:
    # fsync: the rename that publishes a checkpoint must not overtake its contents on a crash.
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Publish `tmp` as `final` by renaming; an existing `final` is replaced, never half-written."""
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a CheckpointError says what is wrong otherwise.

    Complete means: the manifest parses; every file it lists exists with the recorded size; the
    safetensors headers and per-rank JSON files parse. Flipped bits inside tensor data are not
    detected (that would mean reading the whole checkpoint).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (an interrupted save, or not a checkpoint)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as error:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (
        FORMAT, FORMAT_VERSION
    ):
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} version {FORMAT_VERSION} manifest")
    missing = [key for key in _MANIFEST_KEYS if key not in manifest]
    if missing:
        raise CheckpointError(f"{path}: {MANIFEST} lacks {', '.join(missing)}")
    files, world_size = manifest["files"], manifest["world_size"]
    expected = {_rank_file(r) for r in range(world_size)}
    if not expected <= files.keys() or not any(name.endswith(".safetensors") for name in files):
        raise CheckpointError(f"{path}: {MANIFEST} does not list every rank's files")
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} has {file.stat().st_size} bytes, {size} were written")
        try:
            if name.endswith(".safetensors"):
                with safe_open(str(file), framework="pt"):
                    pass
            elif name.endswith(".json"):
                json.loads(file.read_text())
        except (SafetensorError, ValueError) as error:
            raise CheckpointError(f"{path}: {name} is corrupted ({error})") from None
    return manifest


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<n>` directory under `root`, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    matches = [(_STEP_DIR.fullmatch(p.name), p) for p in root.iterdir() if p.is_dir()]
    found = [(int(m.group(1)), p) for m, p in matches if m]
    return sorted(found, reverse=True)


def latest_checkpoint(root: str | os.PathLike, log: Log) -> Path | None:
    """The newest complete checkpoint under `root`; incomplete or corrupted ones are skipped with a
    warning."""
    for _, path in checkpoint_dirs(root):
        try:
            inspect_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: skipping checkpoint: {error}")
            continue
        return path
    return None


def check_architecture(found: LlamaConfig, expected: LlamaConfig, source: str) -> None:
    """A ValueError listing every architecture field where `found` (from `source`) differs from
    this run's model config, with the overrides that would match it."""
    diffs = [f for f in ARCHITECTURE_FIELDS if getattr(found, f) != getattr(expected, f)]
    if diffs:
        detail = ", ".join(f"{f}: {getattr(found, f)} there, {getattr(expected, f)} here" for f in diffs)
        fix = " ".join(f"model.{f}={getattr(found, f)}" for f in diffs)
        raise ValueError(f"{source} holds a different model ({detail}); to match it, set {fix}")


# ---- RNG -----------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# ---- imports from Hugging Face -------------------------------------------------------------------
@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike, model_cfg: LlamaConfig, log: Log) -> None:
    """Load HF Llama weights (a directory or a .safetensors file) into `model`, which may be
    FSDP2-sharded; ValueError on a config or shape mismatch (nothing is loaded then)."""
    ckpt = HFCheckpoint(path)
    if ckpt.config is not None:
        check_architecture(config_from_hf(ckpt.config), model_cfg, f"init_from={path}")
    mapping = CanonicalMapping(model)
    ckpt.check({mapping.canonical[n]: tuple(s) for n, s in mapping.shapes.items()}, model_cfg)
    for name, param in model.named_parameters():
        native = strip_wrapper_prefixes(name)
        full = ckpt.canonical(mapping.canonical[native]).to(param.dtype)
        set_full_tensor(param, mapping.from_canonical(native, full))
    tied = " (tied embeddings: lm_head starts as a copy of embed_tokens)" if ckpt.tied_embeddings else ""
    log(f"initialised weights from {path}{tied}")


# ---- exports to Hugging Face ---------------------------------------------------------------------
def _checkpoint_model_tensors(path: Path, group_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The canonical model tensors of a checkpoint, read in groups of about `group_bytes`."""
    metadata = dcp.HuggingFaceStorageReader(str(path)).read_metadata()
    group: dict[str, torch.Tensor] = {}
    size = 0
    names = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    for i, fqn in enumerate(names):
        meta = metadata.state_dict_metadata[fqn]
        group[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        size += group[fqn].numel() * group[fqn].element_size()
        if size >= group_bytes or i == len(names) - 1:
            _dcp_load(group, path)
            for key, tensor in group.items():
                yield key.removeprefix("model."), tensor
            group, size = {}, 0


def export_checkpoint_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                            dtype: torch.dtype | None = None,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> LlamaConfig:
    """Write a training checkpoint's weights as an HF Llama directory (single process)."""
    manifest = inspect_checkpoint(checkpoint)
    cfg = LlamaConfig(**manifest["model_config"])
    tensors = _checkpoint_model_tensors(Path(checkpoint), group_bytes=1 << 30)
    save_hf(out_dir, cfg, tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return cfg


# ---- the trainer's interface ---------------------------------------------------------------------
class Checkpointer:
    """Saves and restores a training run: `restore()` once before training, `after_step()` after
    every optimizer step. Every rank calls both (they contain collectives)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike, model_cfg: LlamaConfig,
                 model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loaders: Mapping[str, Stateful],
                 log: Log) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.model, self.optimizer, self.scheduler, self.loaders = model, optimizer, scheduler, loaders
        self.log = log
        self.mapping = CanonicalMapping(model)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self) -> int:
        """Resume per `checkpoint.resume`, else start from `init_from` weights if set; returns the
        step training continues from. A resumable checkpoint takes precedence over `init_from`
        (an interrupted finetuning run continues from its own checkpoint)."""
        path = self._rank0_decides(self._resume_path)
        if path is not None:
            if self.cfg.init_from:
                self.log(f"checkpoint.init_from={self.cfg.init_from} ignored: resuming from {path}")
            return self.load(Path(path))
        if self.cfg.init_from:
            load_hf_weights(self.model, self.cfg.init_from, self.model_cfg, self.log)
        return 0

    def _resume_path(self) -> str | None:
        resume = self.cfg.resume
        if resume == "none":
            if checkpoint_dirs(self.root):
                raise CheckpointError(
                    f"checkpoint.resume=none, but {self.root} holds checkpoints of an earlier run that "
                    "later saves would mix with: resume them (checkpoint.resume=auto), or use another "
                    "train.run_dir"
                )
            return None
        if resume == "auto":
            path = latest_checkpoint(self.root, self.log)
            return None if path is None else str(path)
        inspect_checkpoint(resume)  # a checkpoint named explicitly must be complete
        return resume

    @staticmethod
    def _rank0_decides(decide: Callable[[], str | None]) -> str | None:
        """Run `decide` on rank 0 only (one scan of the file system, one set of warnings) and give
        its answer, or its error, to every rank (so no rank waits for an answer that never comes)."""
        answer: list[str | None] = [None, None]  # result, error
        if _rank() == 0:
            try:
                answer[0] = decide()
            except CheckpointError as error:
                answer[1] = str(error)
            except Exception as error:  # an OSError, say: the other ranks must not hang
                answer[1] = f"{type(error).__name__}: {error}"
        if dist.is_initialized():
            dist.broadcast_object_list(answer, src=0)
        if answer[1] is not None:
            raise CheckpointError(answer[1])
        return answer[0]

    def load(self, path: Path) -> int:
        """Load everything from a checkpoint directory; returns its step."""
        manifest = inspect_checkpoint(path)
        try:
            check_architecture(LlamaConfig(**manifest["model_config"]), self.model_cfg, f"checkpoint {path}")
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        groups = manifest["optimizer_param_groups"]
        load_canonical_state(path, self.model, self.optimizer, self.mapping, groups)
        self.scheduler.load_state_dict(manifest["scheduler"])
        self._load_rank_state(path, manifest["world_size"])
        self.log(f"resumed from {path} at step {manifest['step']}")
        return int(manifest["step"])

    def _load_rank_state(self, path: Path, saved_world_size: int) -> None:
        if saved_world_size == _world_size():
            mine = json.loads((path / _rank_file(_rank())).read_text())
        else:
            states = [json.loads((path / _rank_file(r)).read_text()) for r in range(saved_world_size)]
            mine = {"loaders": {}, "rng": None}
            for name in self.loaders:
                values = [s["loaders"].get(name) for s in states]
                if all(v == values[0] for v in values):
                    mine["loaders"][name] = values[0]
                else:
                    self.log(
                        f"warning: the {name} data state differs per rank and cannot move from "
                        f"{saved_world_size} to {_world_size()} processes; that loader starts from its "
                        "beginning"
                    )
            if all(s["rng"] == states[0]["rng"] for s in states):
                mine["rng"] = states[0]["rng"]
        for name, loader in self.loaders.items():
            if mine["loaders"].get(name) is not None:
                loader.load_state_dict(mine["loaders"][name])
            elif saved_world_size == _world_size():
                self.log(f"warning: {path} has no state for the {name} data; it starts from its beginning")
        if mine["rng"] is not None:
            _set_rng_state(mine["rng"])

    # ---- save ---------------------------------------------------------------------------------
    def after_step(self, step: int, total_steps: int) -> None:
        """Save a checkpoint and/or an HF export when one is due after optimizer step `step`."""
        final = step == total_steps
        if (self.cfg.every > 0 and step % self.cfg.every == 0) or (final and self.cfg.at_end):
            self.save(step)
        if self.cfg.save_hf_every > 0 and (step % self.cfg.save_hf_every == 0 or final):
            self.export_hf(step)

    def save(self, step: int) -> Path:
        """Write `<run_dir>/checkpoints/step_<step>` atomically; keep the newest `keep_last`."""
        final = self.root / f"step_{step}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        rank = _rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{TMP_PREFIX}*"):  # left by a crash during an earlier save
                shutil.rmtree(stale)
            tmp.mkdir()
        barrier()
        tensors, param_groups = canonical_state(self.model, self.optimizer, self.mapping)
        _dcp_save(tensors, tmp)
        loaders = {name: loader.state_dict() for name, loader in self.loaders.items()}
        try:
            _write_json(tmp / _rank_file(rank), {"loaders": loaders, "rng": _rng_state()})
        except TypeError as error:
            raise TypeError(f"the data-loader state must be JSON-serializable: {error}") from None
        barrier()
        if rank == 0:
            manifest = {
                "format": FORMAT, "version": FORMAT_VERSION, "step": step, "world_size": _world_size(),
                "model_config": dataclasses.asdict(self.model_cfg),
                "scheduler": self.scheduler.state_dict(),
                "optimizer_param_groups": param_groups,
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
            }
            _write_json(tmp / MANIFEST, manifest)
            _replace_dir(tmp, final)
            self._prune(keep=final)
            self.log(f"saved checkpoint {final}")
        barrier()
        return final

    def _prune(self, keep: Path) -> None:
        """Delete complete checkpoints beyond the newest `keep_last` (never `keep`, the one just
        written). Incomplete ones are left for inspection; they never count as resumable."""
        if self.cfg.keep_last <= 0:
            return
        complete = []
        for _, path in checkpoint_dirs(self.root):
            try:
                inspect_checkpoint(path)
            except CheckpointError:
                continue
            complete.append(path)
        for path in complete[self.cfg.keep_last:]:
            if path != keep:
                shutil.rmtree(path)

    def export_hf(self, step: int) -> Path:
        """Write the current weights as an HF Llama directory `<run_dir>/hf/step_<step>`."""
        out = self.run_dir / HF_EXPORTS_DIR / f"step_{step}"
        tensors = full_canonical_tensors(self.model, self.mapping)
        if _rank() == 0:
            tmp = out.with_name(f"{TMP_PREFIX}{out.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            save_hf(tmp, self.model_cfg, tensors)
            _replace_dir(tmp, out)
            self.log(f"exported Hugging Face weights to {out}")
        else:
            for _ in tensors:  # take part in the gathers
                pass
        barrier()
        return out
