"""Weights in and out of training: `init_from` imports HF Llama weights or a codatrain checkpoint's
weights into a (possibly FSDP2-sharded) model (and, for `model=hf`, gives the run its architecture
and tokenizer), and exports of a training checkpoint as HF Llama. The conversion itself (names,
fused rows, config.json, safetensors files) is codatrain/model/hf.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from codatrain.config import FOLDER_PRESET, RunConfig, model_config
from codatrain.data.tokenizer import TOKENIZER_FILES, folder_tokenizer, load_tokenizer, save_hf_tokenizer
from codatrain.model.config import ArchitectureMismatch, LlamaConfig
from codatrain.model.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    Delimiters,
    HFCheckpoint,
    config_from_hf,
    folder_hint,
    save_hf,
)
from codatrain.model.layout import CanonicalModel
from codatrain.train.canonical_state import CanonicalMapping
from codatrain.train.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    CheckpointMismatch,
    checkpoint_tokenizer,
    inspect_checkpoint,
    load_model_weights,
    not_a_checkpoint_hint,
)
from codatrain.train.checkpoint_files import checkpoint_reader, dcp_load


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a codatrain training checkpoint (rather than HF weights)."""
    return (Path(path) / MANIFEST).is_file()


def hf_checkpoint(path: str | os.PathLike) -> HFCheckpoint:
    """HF weights at `path`; a run directory given instead is named as one, with its checkpoints."""
    if (hint := not_a_checkpoint_hint(path)) is not None:
        raise FileNotFoundError(hint)
    return HFCheckpoint(path)


def saved_architecture(path: str | os.PathLike) -> LlamaConfig:
    """The model config saved with weights: a codatrain checkpoint's manifest, or an HF folder's
    config.json (a bare .safetensors file has none: ValueError)."""
    if is_checkpoint(path):
        return LlamaConfig(**inspect_checkpoint(path, verify=False)["model_config"])
    config = hf_checkpoint(path).config
    if config is None:
        raise ValueError(f"{path} has no config.json to take the architecture from{folder_hint(Path(path))}")
    return config_from_hf(config)


def run_model_config(run: RunConfig) -> LlamaConfig:
    """The model of a run: its preset and overrides, or for model=hf the architecture of
    checkpoint.init_from (an override contradicting it is a ValueError naming the key)."""
    init_from = run.checkpoint.init_from
    folder = saved_architecture(init_from) if init_from and run.model.preset == FOLDER_PRESET else None
    return model_config(run.model, folder, f"checkpoint.init_from={init_from}")


def saved_tokenizer(path: str | os.PathLike) -> str | None:
    """The tokenizer weights were trained with, as a data.tokenizer spec: the one a codatrain
    checkpoint records, or an HF folder's own; None where that is not known."""
    if is_checkpoint(path):
        return checkpoint_tokenizer(path, inspect_checkpoint(path, verify=False))
    return folder_tokenizer(path)


def run_tokenizer(run: RunConfig) -> tuple[str, str]:
    """The tokenizer of a run and a line for its header that says where it comes from:
    data.tokenizer where set, else the one checkpoint.init_from was trained with, else byte."""
    init_from = run.checkpoint.init_from
    trained_with = saved_tokenizer(init_from) if init_from else None
    source = f"checkpoint.init_from={init_from}"
    chosen = run.data.tokenizer
    if chosen is None and trained_with is None:
        return "byte", "tokenizer: byte" + (f" ({source} names none)" if init_from else "")
    if chosen is None:
        load_tokenizer(trained_with, source)  # a broken one is named by the option that brought it
        return trained_with, f"tokenizer: {trained_with} (the one {source} was trained with)"
    if trained_with is None or load_tokenizer(chosen).fingerprint == load_tokenizer(trained_with).fingerprint:
        return chosen, f"tokenizer: {chosen} (data.tokenizer)"
    return chosen, (f"tokenizer: {chosen} (data.tokenizer), not {trained_with}, which {source} was "
                    "trained with")


@torch.no_grad()
def load_init_weights(model: nn.Module, path: str | os.PathLike, model_cfg: LlamaConfig,
                      log: Callable[[str], None], manifest: dict[str, Any] | None = None) -> None:
    """`checkpoint.init_from`: the weights of a codatrain checkpoint (its `manifest`, from
    inspect_checkpoint, which has checked it) or of HF Llama weights, into `model`."""
    try:
        if manifest is None:
            load_hf_weights(model, path, model_cfg, log)
            return
        load_model_weights(Path(path), manifest, model_cfg, model)
    except (ArchitectureMismatch, CheckpointMismatch) as error:
        raise type(error)(f"{error}, or model=hf, which takes the architecture from checkpoint.init_from"
                          ) from None
    log(f"initialised weights from checkpoint {path}")


@torch.no_grad()
def load_hf_weights(model: CanonicalModel, path: str | os.PathLike, model_cfg: LlamaConfig,
                    log: Callable[[str], None]) -> None:
    """Load HF Llama weights (a directory or a .safetensors file) into `model`, which may be
    wrapped and FSDP2-sharded; ValueError on a config or shape mismatch (nothing is loaded then)."""
    ckpt = hf_checkpoint(path)
    if ckpt.config is not None:
        model_cfg.check_architecture(config_from_hf(ckpt.config), f"init_from={path}")
    mapping = CanonicalMapping(model)
    shapes = {mapping.canonical[native]: tuple(shape) for native, shape in mapping.shapes.items()}
    ckpt.check(shapes, model_cfg)
    mapping.assign(model, lambda name, shape: ckpt.canonical(name))
    log(f"initialised weights from {path}")


def _checkpoint_model_tensors(path: Path, manifest: dict[str, Any],
                              group_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The canonical model tensors of a checkpoint, read in groups of about `group_bytes`."""
    metadata = checkpoint_reader(path, manifest).read_metadata()
    group: dict[str, torch.Tensor] = {}
    size = 0
    names = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    for i, fqn in enumerate(names):
        meta = metadata.state_dict_metadata[fqn]
        group[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        size += group[fqn].numel() * group[fqn].element_size()
        if size >= group_bytes or i == len(names) - 1:
            dcp_load(group, path, manifest)
            for key, tensor in group.items():
                yield key.removeprefix("model."), tensor
            group, size = {}, 0


def export_checkpoint_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                            dtype: torch.dtype | None = None,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> LlamaConfig:
    """Write a training checkpoint's weights as an HF Llama directory (single process), after
    checking the checkpoint's checksums and that `out_dir` is a place for it; with its tokenizer
    (`save_hf_with_tokenizer`) where the checkpoint records one."""
    check_export_path(checkpoint, out_dir)
    manifest = inspect_checkpoint(checkpoint)
    cfg = LlamaConfig(**manifest["model_config"])
    tensors = _checkpoint_model_tensors(Path(checkpoint), manifest, group_bytes=1 << 30)
    save_hf_with_tokenizer(out_dir, cfg, tensors, checkpoint_tokenizer(checkpoint, manifest), dtype=dtype,
                           max_shard_bytes=max_shard_bytes)
    return cfg


def save_hf_with_tokenizer(out_dir: str | os.PathLike, cfg: LlamaConfig,
                           tensors: Iterable[tuple[str, torch.Tensor]], tokenizer: str | None,
                           **options: Any) -> None:
    """`save_hf`, with config.json and generation_config.json naming the delimiters of `tokenizer`
    (a data.tokenizer spec; None: unknown) and, for a Hugging Face tokenizer, its files beside the
    weights, so that `AutoTokenizer` and `pipeline` load the folder as it is."""
    delimiters = None
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        delimiters = Delimiters(loaded.bos_id, loaded.eos_id)
    save_hf(out_dir, cfg, tensors, delimiters=delimiters, **options)
    # A folder exported into before keeps no tokenizer file of its old weights: AutoTokenizer and
    # generate.py would load it with these.
    for name in TOKENIZER_FILES:
        (Path(out_dir) / name).unlink(missing_ok=True)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out_dir)


def check_export_path(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """ValueError for an export directory that is a file, or inside (or equal to) a checkpoint or a
    run's checkpoints folder: its weights would sit among a checkpoint's files."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out_dir} is a file; the export needs a directory")
    source = Path(checkpoint).resolve()
    for folder in (out, *out.parents):
        if folder == source or (folder / MANIFEST).is_file() or (
            folder == source.parent and folder.name == CHECKPOINTS_DIR
        ):
            raise ValueError(f"{out_dir} is inside the checkpoint folder {folder}; export to a directory "
                             "outside the run's checkpoints")
