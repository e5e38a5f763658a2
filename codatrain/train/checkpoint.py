"""The training checkpoint format (torch.distributed.checkpoint): writing, reading, checking.

A checkpoint is a directory `<run_dir>/checkpoints/step_<n>/`:

    shard-<r+1:05d>-model-00001-of-00001.safetensors   tensors, one file per writing rank (DCP):
        model.<canonical name>                     the parameters
        optim.<canonical name>.<state>             the optimizer state (exp_avg, exp_avg_sq, step)
        fp8.amax_history, fp8.steps                block.precision=fp8: the delayed-scaling state
                                                   (codatrain/kernels/fp8.py: Fp8Scaling)
    rank_<r:05d>.json                              per-rank state: data loaders, RNG
    tokenizer/                                     a copy of the files of the run's tokenizer
                                                   (none for the byte tokenizer)
    checkpoint.json                                the manifest, written last: step, world size,
                                                   model config, tokenizer (its source and
                                                   fingerprint), LR schedule, optimizer
                                                   hyperparameters, the size and blake2b
                                                   checksum of every file

Tensors are stored under canonical names and in canonical layouts (those of the eager model)
whichever block implementation trained them, so block=eager and block=coda resume each other's
checkpoints. DCP's Hugging Face storage layer writes them as safetensors with each shard's offsets
in the file header: loading reshards onto any number of processes, and nothing is unpickled (the
rest of the state is JSON; DCP's default format would pickle its index and non-tensor values).

The tokenizer travels with the weights: readers of a checkpoint (`init_from`, generation, export)
take `tokenizer/` (or the byte tokenizer) unless told otherwise. Checkpoints written before it was
recorded have no `tokenizer` key; their tokenizer is unknown.

The FP8 state is training state and optional both ways: a run with block.precision=fp8 that
resumes a checkpoint without it (bf16 CODA, eager) starts a fresh amax history, and other runs
ignore it; the weights are the same canonical tensors either way.

Resuming restores the optimizer's hyperparameters and the LR schedule from the checkpoint (as
torch's own optimizer state dicts do), so changed `optim.*` values take effect only in a fresh run.

A save is atomic (codatrain/train/checkpointer.py): every rank writes into `.tmp-step_<n>/`, then,
once every rank has reported its files, rank 0 writes the manifest and renames the directory. A
crash mid-save leaves only the temporary directory, which `resume=auto` ignores and the next save
removes; a failed save (a full disk) removes it at once.

Checksums: every rank hashes the bytes of its own files as it writes them (no second read), and
rank 0 records them in the manifest. Resuming, exporting and `init_from` read every file once more
to check them, so flipped bits are found before they are trained on. Readers take only the files
the manifest lists (DCP's own reader would take every *.safetensors in the directory). Version 1
manifests, which hold sizes only, are still read, with a warning that they cannot be verified.

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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from codatrain.data.tokenizer import load_tokenizer, tokenizer_files
from codatrain.kernels.fp8 import Fp8Scaling
from codatrain.model.config import ArchitectureMismatch, LlamaConfig
from codatrain.train.canonical_state import (
    CanonicalMapping,
    Entry,
    canonical_state,
    model_state_dict,
    state_entries,
)
from codatrain.train.checkpoint_files import (
    CHECKSUM,
    copy_file,
    dcp_load,
    dcp_save,
    file_checksum,
    write_json,
)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "checkpoint.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "codatrain-checkpoint"
FORMAT_VERSION = 2  # 2 added a checksum per file; version 1 checkpoints are still read
READABLE_VERSIONS = (1, 2)
TMP_PREFIX = ".tmp-"
_MANIFEST_KEYS = ("step", "world_size", "model_config", "scheduler", "optimizer_param_groups", "files")
_STEP_DIR = re.compile(r"step_(\d+)")
FP8_PREFIX = "fp8."  # the checkpoint keys of the FP8 scaling state

Log = Callable[[str], None]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or corrupted, or does not fit this run."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that another experiment saved: its model or data differ from this run's."""


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _save_error_message(error: BaseException) -> str:
    """One line for an error raised while saving: DCP wraps each rank's error in a
    CheckpointException whose text is a set of tracebacks."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items())))
        return f"{type(cause).__name__} on rank {rank}: {cause}"
    return f"{type(error).__name__}: {error}"


# ---- reading canonical state ------------------------------------------------------------------
def _load_entries(path: Path, manifest: Mapping[str, Any], entries: list[Entry],
                  mapping: CanonicalMapping) -> None:
    """Read the checkpoint's tensors into the state dicts that `entries` point into."""
    # DCP loads in place: straight into the live tensor where layouts agree, else into a buffer.
    template = {
        fqn: container[key] if not shaped or mapping.is_identity(native) else torch.empty_like(container[key])
        for fqn, container, key, native, shaped in entries
    }
    dcp_load(template, path, manifest)
    for fqn, container, key, native, shaped in entries:
        container[key] = mapping.from_canonical(native, template[fqn]) if shaped else template[fqn]


def load_canonical_state(path: Path, manifest: Mapping[str, Any], model: nn.Module,
                         optimizer: torch.optim.Optimizer, mapping: CanonicalMapping) -> None:
    """Load model and optimizer from a checkpoint directory, resharding to this run's layout."""
    param_groups = manifest["optimizer_param_groups"]
    model_state = model_state_dict(model)
    # For an optimizer that has not stepped yet this creates its state, as a template to load into.
    optim_state = get_optimizer_state_dict(model, optimizer)
    if len(param_groups) != len(optim_state["param_groups"]):
        raise CheckpointError(
            f"{path}: the optimizer has {len(optim_state['param_groups'])} parameter groups, the checkpoint "
            f"{len(param_groups)}"
        )
    _load_entries(path, manifest, state_entries(model_state, optim_state, mapping), mapping)
    set_model_state_dict(model, model_state)
    optim_state["param_groups"] = [
        {**saved, "params": current["params"]}
        for saved, current in zip(param_groups, optim_state["param_groups"], strict=True)
    ]
    set_optimizer_state_dict(model, optimizer, optim_state)


def load_model_weights(path: Path, manifest: Mapping[str, Any], model_cfg: LlamaConfig,
                       model: nn.Module) -> None:
    """Only the model's tensors of a checkpoint (`init_from`), resharded to this run's layout."""
    _check_model_config(path, manifest, model_cfg)
    mapping = CanonicalMapping(model)
    model_state = model_state_dict(model)
    _load_entries(path, manifest, state_entries(model_state, {"state": {}}, mapping), mapping)
    set_model_state_dict(model, model_state)


def _check_model_config(path: Path, manifest: Mapping[str, Any], model_cfg: LlamaConfig) -> None:
    try:
        model_cfg.check_architecture(LlamaConfig(**manifest["model_config"]), f"checkpoint {path}")
    except ArchitectureMismatch as error:
        raise CheckpointMismatch(str(error)) from None


# ---- files ---------------------------------------------------------------------------------------
def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish `tmp` as `final` by renaming; an existing `final` is replaced, never half-written."""
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def inspect_checkpoint(path: str | os.PathLike, verify: bool = True,
                       log: Log | None = None) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a CheckpointError says what is wrong otherwise.

    Complete means: the manifest parses; every file it lists exists with the recorded size; the
    safetensors headers and per-rank JSON files parse; and, with `verify`, every file's bytes match
    the checksum recorded when it was written (this reads the whole checkpoint). A version 1
    checkpoint has no checksums: `log` (default: a Python warning) says it cannot be verified.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(not_a_checkpoint_hint(path) or
                              f"{path}: no {MANIFEST} (an interrupted save, or not a checkpoint)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as error:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or (
        manifest.get("version") not in READABLE_VERSIONS
    ):
        readable = " or ".join(map(str, READABLE_VERSIONS))
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} version {readable} manifest")
    missing = [key for key in _MANIFEST_KEYS if key not in manifest]
    if missing:
        raise CheckpointError(f"{path}: {MANIFEST} lacks {', '.join(missing)}")
    files, world_size = manifest["files"], manifest["world_size"]
    expected = {_rank_file(r) for r in range(world_size)}
    if not expected <= files.keys() or not any(name.endswith(".safetensors") for name in files):
        raise CheckpointError(f"{path}: {MANIFEST} does not list every rank's files")
    # Version 1 recorded each file's size only.
    records = {name: {"bytes": r} if manifest["version"] == 1 else r for name, r in files.items()}
    for name, record in records.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if file.stat().st_size != record["bytes"]:
            raise CheckpointError(
                f"{path}: {name} has {file.stat().st_size} bytes, {record['bytes']} were written"
            )
        try:
            if name.endswith(".safetensors"):
                with safe_open(str(file), framework="pt"):
                    pass
            elif name.endswith(".json"):
                json.loads(file.read_text())
        except (SafetensorError, ValueError) as error:
            raise CheckpointError(f"{path}: {name} is corrupted ({error})") from None
    if verify and manifest["version"] == 1:
        message = f"{path} was written without checksums (a version 1 checkpoint): it cannot be verified"
        log(f"warning: {message}") if log else warnings.warn(message, stacklevel=2)
    elif verify:
        names = sorted(records)
        # hashlib releases the GIL: the files of a multi-rank checkpoint are hashed in parallel.
        with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
            checksums = list(pool.map(lambda name: file_checksum(path / name), names))
        for name, checksum in zip(names, checksums, strict=True):
            if checksum != records[name][CHECKSUM]:
                raise CheckpointError(f"{path}: {name} is corrupted (its {CHECKSUM} checksum differs from "
                                      "the one recorded when it was written)")
    return manifest


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<n>` directory under `root`, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    matches = [(_STEP_DIR.fullmatch(p.name), p) for p in root.iterdir() if p.is_dir()]
    found = [(int(m.group(1)), p) for m, p in matches if m]
    return sorted(found, reverse=True)


def not_a_checkpoint_hint(path: str | os.PathLike) -> str | None:
    """For a run directory or its checkpoints folder given where one checkpoint is wanted
    (`init_from`, export, generation): a message naming the newest saved checkpoint inside it."""
    path = Path(path)
    for root in (path, path / CHECKPOINTS_DIR):
        saved = [p for _, p in checkpoint_dirs(root) if (p / MANIFEST).is_file()]
        if saved:
            return f"{path} is not a checkpoint but holds checkpoints: pass one, e.g. the newest, {saved[0]}"
    return None


def latest_checkpoint(root: str | os.PathLike, log: Log) -> Path | None:
    """The newest complete and verified checkpoint under `root`; incomplete or corrupted ones are
    skipped with a warning. A CheckpointError naming them when there are checkpoints but none is
    usable: starting again from step 0 would overwrite them and mix two runs in one directory."""
    broken = []
    for _, path in checkpoint_dirs(root):
        try:
            inspect_checkpoint(path, log=log)
        except CheckpointError as error:
            log(f"warning: skipping checkpoint: {error}")
            broken.append(str(error))
            continue
        return path
    if broken:
        raise CheckpointError(
            f"checkpoint.resume=auto found no usable checkpoint in {root}: {'; '.join(broken)}. Resume "
            "one by name with checkpoint.resume=<path>, or start a new run with another train.run_dir"
        )
    return None


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


# ---- a whole training state ----------------------------------------------------------------------
def write_checkpoint(directory: Path, step: int, model_cfg: LlamaConfig, model: nn.Module,
                     optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                     loaders: Mapping[str, Stateful], mapping: CanonicalMapping, tokens_seen: int,
                     tokenizer: str = "byte", fp8_scaling: Fp8Scaling | None = None) -> None:
    """Every rank writes its tensors and state into the existing `directory`; then rank 0 copies
    the files of `tokenizer` (a data.tokenizer spec) and writes the manifest, last, with
    `tokens_seen` (the tokens of the steps trained up to `step`, over every rank) and every
    file's size and checksum. An error on any rank is raised on every rank (as a
    CheckpointError), so none waits for the others forever."""
    rank = process_rank()
    tensors, param_groups = canonical_state(model, optimizer, mapping)
    if fp8_scaling is not None:  # the same on every rank: DCP writes it once
        tensors |= {f"{FP8_PREFIX}{key}": value for key, value in fp8_scaling.state_dict().items()}
    written: dict[str, dict[str, Any]] = {}
    error: BaseException | None = None
    try:
        written = dcp_save(tensors, directory)  # collective: an error on one rank is raised on all
        loader_states = {name: loader.state_dict() for name, loader in loaders.items()}
        try:
            written[_rank_file(rank)] = write_json(directory / _rank_file(rank),
                                                    {"loaders": loader_states, "rng": _rng_state()})
        except TypeError as type_error:
            raise TypeError(f"the data-loader state must be JSON-serializable: {type_error}") from None
    except (Exception, CheckpointException) as save_error:
        error = save_error
    outcome = (written, None if error is None else _save_error_message(error))
    outcomes: list[Any] = [outcome]
    if dist.is_initialized():  # also the barrier before the manifest
        outcomes = [None] * _world_size()
        dist.all_gather_object(outcomes, outcome)
    errors = [message for _, message in outcomes if message is not None]
    if errors:
        raise CheckpointError(errors[0]) from error
    if rank == 0:
        files = {name: record for rank_written, _ in outcomes for name, record in rank_written.items()}
        tokenizer_record, files_of_tokenizer = _save_tokenizer(directory, tokenizer)
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "step": step, "tokens_seen": tokens_seen,
            "world_size": _world_size(),
            "model_config": dataclasses.asdict(model_cfg), "tokenizer": tokenizer_record,
            "scheduler": scheduler.state_dict(),
            "optimizer_param_groups": param_groups,
            "files": dict(sorted((files | files_of_tokenizer).items())),
        }
        write_json(directory / MANIFEST, manifest)


def _save_tokenizer(directory: Path, spec: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Copy the files of tokenizer `spec` into `directory/tokenizer/`: the manifest's record of the
    tokenizer, and the files written with their sizes and checksums."""
    files = tokenizer_files(spec)
    written = {}
    if files:
        (directory / TOKENIZER_DIR).mkdir()
        for name, source in files.items():
            written[f"{TOKENIZER_DIR}/{name}"] = copy_file(source, directory / TOKENIZER_DIR / name)
    record = {"source": spec if spec == "byte" else str(Path(spec).resolve()),
              "fingerprint": load_tokenizer(spec).fingerprint, "folder": TOKENIZER_DIR if files else None}
    return record, written


def checkpoint_tokenizer(path: str | os.PathLike, manifest: Mapping[str, Any]) -> str | None:
    """The tokenizer a checkpoint was trained with, as a data.tokenizer spec (its `tokenizer/`
    copy, or `byte`); None for a checkpoint written before tokenizers were recorded."""
    record = manifest.get("tokenizer")
    if record is None:
        return None
    return "byte" if record["folder"] is None else str(Path(path) / record["folder"])


def load_checkpoint(path: Path, model_cfg: LlamaConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, loaders: Mapping[str, Stateful],
                    mapping: CanonicalMapping, log: Log, fp8_scaling: Fp8Scaling | None = None) -> int:
    """Load everything from a checkpoint directory; returns its step."""
    manifest = inspect_checkpoint(path, verify=False)  # verified when it was chosen
    _check_model_config(path, manifest, model_cfg)
    load_canonical_state(path, manifest, model, optimizer, mapping)
    if fp8_scaling is not None:
        _load_fp8_scaling(path, manifest, fp8_scaling, log)
    scheduler.load_state_dict(manifest["scheduler"])
    _load_rank_state(path, manifest["world_size"], loaders, log)
    log(f"resumed from {path} at step {manifest['step']}")
    return int(manifest["step"])


def _saved_shapes(path: Path, manifest: Mapping[str, Any]) -> dict[str, list[int]]:
    """The name and shape of every tensor in a checkpoint's safetensors files."""
    shapes = {}
    for name in manifest["files"]:
        if name.endswith(".safetensors"):
            with safe_open(str(path / name), framework="pt") as file:
                shapes |= {key: file.get_slice(key).get_shape() for key in file.keys()}  # noqa: SIM118
    return shapes


def _load_fp8_scaling(path: Path, manifest: Mapping[str, Any], scaling: Fp8Scaling, log: Log) -> None:
    """The checkpoint's FP8 scaling state into `scaling`; without one (a bf16 or eager run's), or
    with another history length, the run starts a fresh amax history and says so."""
    template = {f"{FP8_PREFIX}{key}": value.clone() for key, value in scaling.state_dict().items()}
    saved = _saved_shapes(path, manifest)
    history = f"{FP8_PREFIX}amax_history"
    if not template.keys() <= saved.keys():
        log(f"{path} holds no FP8 amax history (a bf16 or eager run's): starting a fresh one")
        return
    if list(saved[history]) != list(template[history].shape):
        log(f"{path} holds an FP8 amax history of shape {list(saved[history])}, this run's is "
            f"{list(template[history].shape)} (another block.fp8_history_len): starting a fresh one")
        return
    dcp_load(template, path, manifest)
    scaling.load_state_dict({key.removeprefix(FP8_PREFIX): value for key, value in template.items()})


def _load_rank_state(path: Path, saved_world_size: int, loaders: Mapping[str, Stateful], log: Log) -> None:
    if saved_world_size == _world_size():
        mine = json.loads((path / _rank_file(process_rank())).read_text())
    else:
        states = [json.loads((path / _rank_file(r)).read_text()) for r in range(saved_world_size)]
        mine = {"loaders": {}, "rng": None}
        for name in loaders:
            values = [s["loaders"].get(name) for s in states]
            # A state that names the world it was split for (a stream's: each rank reads its own part
            # of it) is per rank even when one process saved it.
            split_for = values[0].get("world_size") if isinstance(values[0], dict) else None
            if split_for is not None and split_for != _world_size():
                log(
                    f"warning: the {name} data state is where each of {saved_world_size} processes stood in "
                    f"its own part of the stream and cannot move to {_world_size()} processes; that loader "
                    "starts from its beginning"
                )
            elif all(v == values[0] for v in values):
                mine["loaders"][name] = values[0]
            else:
                log(
                    f"warning: the {name} data state differs per rank and cannot move from "
                    f"{saved_world_size} to {_world_size()} processes; that loader starts from its "
                    "beginning"
                )
        if all(s["rng"] == states[0]["rng"] for s in states):
            mine["rng"] = states[0]["rng"]
    for name, loader in loaders.items():
        if mine["loaders"].get(name) is not None:
            try:
                loader.load_state_dict(mine["loaders"][name])
            except ValueError as error:  # another corpus, seq_len, seed or order
                raise CheckpointMismatch(f"{path}: {error}") from None
        elif saved_world_size == _world_size():
            log(f"warning: {path} has no state for the {name} data; it starts from its beginning")
    if mine["rng"] is not None:
        _set_rng_state(mine["rng"])
