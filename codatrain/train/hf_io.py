"""Hugging Face Llama weights in and out of training: `init_from` imports into a (possibly
FSDP2-sharded) model, and exports of a training checkpoint. The conversion itself (names, fused
rows, config.json, safetensors files) is codatrain/model/hf.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from codatrain.model.config import LlamaConfig
from codatrain.model.hf import DEFAULT_MAX_SHARD_BYTES, HFCheckpoint, config_from_hf, save_hf
from codatrain.train.checkpoint import dcp_load, inspect_checkpoint
from codatrain.train.parallelize import set_full_tensor, strip_wrapper_prefixes


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike, model_cfg: LlamaConfig,
                    log: Callable[[str], None]) -> None:
    """Load HF Llama weights (a directory or a .safetensors file) into `model`, which may be
    wrapped and FSDP2-sharded; ValueError on a config or shape mismatch (nothing is loaded then)."""
    ckpt = HFCheckpoint(path)
    if ckpt.config is not None:
        model_cfg.check_architecture(config_from_hf(ckpt.config), f"init_from={path}")
    layout = model.layout()  # type: ignore[operator]
    params = {strip_wrapper_prefixes(name): param for name, param in model.named_parameters()}
    ckpt.check({layout[native].name: tuple(p.shape) for native, p in params.items()}, model_cfg)
    for native, param in params.items():
        canonical = layout[native]
        set_full_tensor(param, canonical.to_native(ckpt.canonical(canonical.name).to(param.dtype)))
    tied = " (tied embeddings: lm_head starts as a copy of embed_tokens)" if ckpt.tied_embeddings else ""
    log(f"initialised weights from {path}{tied}")


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
            dcp_load(group, path)
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
