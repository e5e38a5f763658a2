"""The typed schema of a training run, registered in Hydra's ConfigStore.

`configs/train.yaml` composes these groups; because every node is a dataclass, a misspelled key or
a value of the wrong type fails at composition with a message that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from codatrain.model.config import LlamaConfig, get_preset


@dataclass
class ModelConfig:
    """A named preset (codatrain.model.config.PRESETS) with optional per-field overrides."""

    preset: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    max_seq_len: int | None = None


@dataclass
class BlockConfig:
    impl: str = "eager"  # eager | coda
    backend: str = "auto"  # coda stages: reference | cute | auto (cute on sm_90 with the cuda extra)
    attention: str = "auto"  # sdpa | fa4 | auto


@dataclass
class DataConfig:
    """Where the tokens come from and how they are cut; codatrain.data.build_loaders reads it."""

    source: str = "embedded"  # embedded | synthetic | files | hub
    path: str | None = None  # files: a file, a folder or a glob; hub: the dataset name
    name: str | None = None  # hub: dataset configuration name
    split: str = "train"  # hub: the training split
    streaming: bool = False  # hub: read the split as a stream (once, into the token cache)
    text_column: str = "text"  # json / parquet / hub column holding the document text
    text_sample_by: str = "document"  # plain-text files: a document is a whole file | paragraph | line
    max_documents: int | None = None  # use only the first N documents of the source
    tokenizer: str = "byte"  # byte | a local HF tokenizer.json or tokenizer folder
    seq_len: int = 128
    keep_document_boundaries: bool = False  # batches carry per-token document ids (Batch.doc_ids)
    val_fraction: float = 0.02  # held-out share of documents, when no val_path / val_split is given
    val_path: str | None = None  # a separate validation file, folder or glob (same formats as path)
    val_split: str | None = None  # hub: a separate validation split, e.g. "validation"
    num_workers: int = 1  # background DataLoader processes for training batches (0: main process)
    cache_dir: str | None = None  # token cache (and datasets' cache); default: the HF datasets cache
    shuffle: bool = True  # a new seeded order every epoch


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: share of steps spent in the final decay
    grad_clip: float = 1.0  # <= 0 disables clipping


@dataclass
class TrainConfig:
    steps: int = 300
    # Global batch in tokens; gradient accumulation is derived from it. null: one micro-batch per
    # process (micro_batch_size × data.seq_len × processes), no accumulation.
    tokens_per_step: int | None = None
    micro_batch_size: int = 16  # sequences per process per micro-step
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False
    log_every: int = 10
    val_every: int = 100  # <= 0 disables validation
    val_batches: int = 4
    progress: bool = True
    run_dir: str = "runs/${model.preset}-${block.impl}"
    skip_nonfinite_steps: int = 0
    profile_steps: int = 0  # >0: torch.profiler over this many steps, summary in <run_dir>/profile/
    profile_skip: int = 5  # steps before profiling starts (one more is the profiler's warm-up)


@dataclass
class CheckpointConfig:
    """Training checkpoints in <run_dir>/checkpoints/step_<n>/ (codatrain/train/checkpoint.py)."""

    every: int = 0  # save every N steps (0: only at the end when `at_end`)
    at_end: bool = True
    keep_last: int = 3  # complete checkpoints kept, newest first; <= 0 keeps all
    # auto: continue from the newest complete checkpoint of the run dir, if any (broken ones are
    # skipped with a warning); none: start fresh (an error if the run dir has checkpoints);
    # <path>: continue from that step_<n> directory, which must be complete.
    resume: str = "auto"
    # HF Llama directory or .safetensors file whose weights start a fresh run (finetuning: new
    # optimizer, step 0). A checkpoint to resume takes precedence.
    init_from: str | None = None
    save_hf_every: int = 0  # also write <run_dir>/hf/step_<n>/ every N steps and at the end (0: never)


@dataclass
class KernelsConfig:
    """Precompiled CuTeDSL kernels (codatrain/kernels/precompile.py, scripts/precompile.py)."""

    # Where scripts/precompile.py built the kernels of this run (QuACK's and FA4's caches and a
    # manifest). null: the kernels compile on first use, into the libraries' default caches.
    cache_dir: str | None = None
    # A cache built for other versions, other kernel sources or another config (or never built):
    # rebuild it before training, or fail with a message that names every difference.
    on_stale: str = "rebuild"


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "codatrain"
    entity: str | None = None
    name: str | None = None


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    block: BlockConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    logger: LoggerConfig = MISSING


CHOICES = {
    "block.impl": ("eager", "coda"),
    "block.backend": ("reference", "cute", "auto"),
    "block.attention": ("sdpa", "fa4", "auto"),
    "data.source": ("embedded", "synthetic", "files", "hub"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "kernels.on_stale": ("rebuild", "fail"),
    "logger.wandb.mode": ("disabled", "offline", "online"),
}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, node in [
        ("model", ModelConfig), ("block", BlockConfig), ("data", DataConfig),
        ("optim", OptimConfig), ("logger", LoggerConfig),
    ]:
        store.store(group=group, name=f"{group}_schema", node=node)


def validate(cfg: DictConfig | RunConfig) -> None:
    """Checks that types alone cannot express; raises ValueError naming the key."""
    if isinstance(cfg, DictConfig):
        try:  # keys forced in with `+key=value` bypass the schema at composition
            OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg))
        except OmegaConfBaseException as error:
            raise ValueError(f"invalid config: {error}") from None
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if _get(cfg, "block.impl") == "eager":
        for key in ("block.backend", "block.attention"):
            if _get(cfg, key) != "auto":
                raise ValueError(
                    f"{key}={_get(cfg, key)!r} chooses the CODA block's kernels; it needs block=coda"
                )
    positive = ["train.steps", "train.micro_batch_size", "train.log_every", "data.seq_len"]
    if _get(cfg, "train.tokens_per_step") is not None:
        positive.append("train.tokens_per_step")
    if _get(cfg, "train.val_every") > 0:
        positive.append("train.val_batches")
    for key in positive:
        value = _get(cfg, key)
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")


def _get(cfg: DictConfig | RunConfig, key: str) -> Any:
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key)
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def model_config(cfg: ModelConfig) -> LlamaConfig:
    """Resolve the preset and apply the fields that were set."""
    base = get_preset(cfg.preset)
    overrides = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(ModelConfig)
        if f.name != "preset" and getattr(cfg, f.name) is not None
    }
    return base.replace(**overrides)


def load_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose configs/train.yaml with command-line style overrides, as scripts/train.py does."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    register_configs()
    config_dir = Path(__file__).resolve().parent.parent / "configs"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="train", overrides=overrides or [])
