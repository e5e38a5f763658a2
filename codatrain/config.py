"""The typed schema of a training run, registered in Hydra's ConfigStore.

`configs/train.yaml` composes these groups. Every node is a dataclass and every string choice an
enum, so a misspelled key, a value of the wrong type or an unknown choice fails at composition with
a message that names the key. What a type cannot say (a count must be positive, an option needs
another) each node checks in `__post_init__`, which runs when `validate` builds the typed
`RunConfig` at the start of `train()`. The `data` node is the data layer's own `DataConfig`
(codatrain/data/config.py), which knows nothing of Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from codatrain.data.config import DataConfig, expand_home, require_not_negative, require_positive
from codatrain.model.config import ARCHITECTURE_FIELDS, LlamaConfig, get_preset

# `model=hf`: no preset, the architecture of the weights checkpoint.init_from names.
FOLDER_PRESET = "hf"


class BlockImpl(StrEnum):
    eager = "eager"
    coda = "coda"
    liger = "liger"  # eager on liger-kernel's Triton kernels (codatrain/model/liger.py)


class StageBackendChoice(StrEnum):
    reference = "reference"
    cute = "cute"
    auto = "auto"  # cute on sm_90 GPUs with the cuda extra, reference elsewhere


class AttentionChoice(StrEnum):
    sdpa = "sdpa"
    fa4 = "fa4"
    auto = "auto"


class Precision(StrEnum):
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8GradFormat(StrEnum):
    e5m2 = "e5m2"
    e4m3 = "e4m3"


class Schedule(StrEnum):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


class DeviceChoice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Float8Recipe(StrEnum):
    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class OnStale(StrEnum):
    rebuild = "rebuild"
    fail = "fail"


class WandbMode(StrEnum):
    disabled = "disabled"
    offline = "offline"
    online = "online"


def model_config(cfg: Any, folder: LlamaConfig | None = None, source: str = "") -> LlamaConfig:
    """The `LlamaConfig` of a `model` node: its preset with the fields that were set. For model=hf
    the base is `folder`, the architecture found at `source` (checkpoint.init_from), and a field
    set to another architecture than the folder's is a ValueError naming the key."""
    overrides = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(LlamaConfig)
        if getattr(cfg, f.name) is not None
    }
    if cfg.preset != FOLDER_PRESET:
        return get_preset(cfg.preset).replace(**overrides)
    if folder is None:
        raise ValueError("model=hf takes the architecture from the weights it starts from: set "
                         "checkpoint.init_from=<Hugging Face folder or codatrain checkpoint>")
    for key in ARCHITECTURE_FIELDS:
        if key in overrides and overrides[key] != getattr(folder, key):
            raise ValueError(f"model.{key}={overrides[key]} contradicts {source}, whose architecture has "
                             f"{key}={getattr(folder, key)}; leave model.{key} unset with model=hf")
    return folder.replace(**overrides)


def _model_schema() -> type:
    """`ModelConfig`: a preset name plus one optional override per `LlamaConfig` field, generated
    from it so that every model field (a new one included) can be set as `model.<field>=...`."""
    hints = typing.get_type_hints(LlamaConfig)
    fields = [("preset", str, "tiny")] + [
        (f.name, hints[f.name] | None, None) for f in dataclasses.fields(LlamaConfig)
    ]

    def __post_init__(self: Any) -> None:  # an unknown preset or a bad field fails with its key named
        if self.preset != FOLDER_PRESET:  # model=hf is checked against its folder when the run starts
            model_config(self)

    namespace = {"__post_init__": __post_init__, "__doc__": _model_schema.__doc__, "__module__": __name__}
    return dataclasses.make_dataclass("ModelConfig", fields, namespace=namespace)


ModelConfig = _model_schema()


@dataclass
class BlockConfig:
    impl: BlockImpl = BlockImpl.eager  # the block implementation (one checkpoint format for all)
    backend: StageBackendChoice = StageBackendChoice.auto  # the CODA stages' backend
    attention: AttentionChoice = AttentionChoice.auto  # the CODA block's attention (auto: FA4 on sm_90)
    # The CODA layer GEMMs' operands (QKV, out, gate-up, down; forward, dgrad, wgrad): bf16 (the
    # compute dtype), or fp8 (e4m3 activations and weights, per-tensor delayed scaling; LM head and
    # attention stay in the compute dtype). block=coda only: train.float8 is block=eager's FP8.
    precision: Precision = Precision.bf16
    fp8_history_len: int = 16  # precision=fp8: steps of amax history a delayed scale looks back over
    fp8_margin: int = 0  # precision=fp8: scales divided by 2**margin, headroom for a growing amax
    fp8_grad_format: Fp8GradFormat = Fp8GradFormat.e5m2  # precision=fp8: the gradients' FP8 format
    # precision=fp8: the weight gradients in FP8 too (token-contiguous FP8 copies of their operands,
    # written by the quantize passes); false: in the compute dtype, from the tensors the backward
    # has anyway (slower on the cute stages: docs/benchmarks.md).
    fp8_wgrad: bool = True
    # precision=fp8: every FP8 GEMM stage's mainloop on fast accumulation (the tensor cores' adder,
    # about 14 bits), faster; false: only the stages whose outputs meet the kernel tests' criterion
    # with it, the others promote to fp32 every k-tile (docs/benchmarks.md, "FP8 fast accumulation").
    fp8_fast_accum: bool = False

    def __post_init__(self) -> None:
        if self.impl != BlockImpl.coda:
            for key in ("backend", "attention"):
                if getattr(self, key) != "auto":
                    raise ValueError(
                        f"block.{key}={str(getattr(self, key))!r} chooses the CODA block's kernels; "
                        "it needs block=coda"
                    )
            if self.precision == Precision.fp8:
                raise ValueError(
                    f"block.precision=fp8 is the FP8 CODA block (block=coda), not block={self.impl}; "
                    "the eager model's FP8 is torchao's: train.float8=tensorwise or rowwise with block=eager"
                )
        require_positive(self, "block", "fp8_history_len")
        require_not_negative(self, "block", "fp8_margin")
        if self.precision != Precision.fp8:
            defaults = {f.name: f.default for f in dataclasses.fields(BlockConfig)}
            for key in ("fp8_history_len", "fp8_margin", "fp8_grad_format", "fp8_wgrad", "fp8_fast_accum"):
                if getattr(self, key) != defaults[key]:
                    raise ValueError(f"block.{key}={getattr(self, key)} sets the FP8 recipe; it needs "
                                     "block.precision=fp8")


@dataclass
class OptimConfig:
    """AdamW and its schedule. Each model config (configs/model/<preset>.yaml) sets these keys to
    its training recipe; the defaults here serve a model config that has none."""

    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the schedule's final learning rate, as a share of lr
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    schedule: Schedule = Schedule.cosine  # after the warmup: cosine decay, warmup-stable-decay or constant
    warmup_steps: int = 20  # linear warmup from 0 to lr, in optimizer steps
    decay_fraction: float = 0.2  # wsd: share of steps in the final decay (which waits for the warmup's end)
    grad_clip: float = 1.0  # the gradient norm is clipped to this; <= 0 disables clipping

    def __post_init__(self) -> None:
        require_positive(self, "optim", "lr", "eps")
        require_not_negative(self, "optim", "weight_decay", "warmup_steps")
        for name, low, high in (("min_lr_ratio", 0, 1), ("decay_fraction", 0, 1)):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"optim.{name} must lie in [{low}, {high}], got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must lie in [0, 1), got {getattr(self, name)}")


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps to train (the schedule's length)
    # Global batch in tokens; gradient accumulation is derived from it. null: one micro-batch per
    # process (micro_batch_size × data.seq_len × processes), no accumulation.
    tokens_per_step: int | None = None
    micro_batch_size: int = 16  # sequences per process per micro-step
    seed: int = 1337  # weight init, data order and every random draw
    device: DeviceChoice = DeviceChoice.auto  # auto: cuda when a GPU is visible, else cpu
    compile: bool = False  # torch.compile each block
    # block=eager: torchao's float8 training of the layer GEMMs (the benchmarks' FP8 peer; LM head in bf16)
    float8: Float8Recipe = Float8Recipe.none
    activation_checkpointing: bool = False  # recompute every block but the last in the backward
    log_every: int = 10  # steps between metrics records (console, train.log, metrics.jsonl, wandb)
    val_every: int = 100  # steps between evaluations (and after the last); <= 0 disables validation
    val_batches: int = 4  # micro-batches per evaluation, counted over all processes
    progress: bool = True  # a live progress bar when the console is a terminal
    run_dir: str = "runs/${model.preset}-${block.impl}"  # log, metrics, checkpoints; one per experiment
    skip_nonfinite_steps: int = 0  # steps with a non-finite loss or grad norm skipped before the run stops
    profile_steps: int = 0  # >0: torch.profiler over this many steps, summary in <run_dir>/profile/
    profile_skip: int = 5  # steps before profiling starts (one more is the profiler's warm-up)

    def __post_init__(self) -> None:
        expand_home(self, "run_dir")
        require_positive(self, "train", "steps", "micro_batch_size", "log_every")
        if self.tokens_per_step is not None:
            require_positive(self, "train", "tokens_per_step")
        if self.val_every > 0:
            require_positive(self, "train", "val_batches")
        require_not_negative(self, "train", "skip_nonfinite_steps", "profile_steps", "profile_skip")
        if self.profile_steps and self.steps <= self.profile_skip + 1:
            raise ValueError(f"train.profile_steps={self.profile_steps}: train.steps={self.steps} ends "
                             f"before the profile starts (after train.profile_skip={self.profile_skip} steps "
                             "and one warm-up step); lower train.profile_skip")


# parallel.dp_replicate=auto: one replica per node (torchrun's LOCAL_WORLD_SIZE processes each).
AUTO_REPLICATE = "auto"


@dataclass
class ParallelConfig:
    """The data-parallel mesh, dp_replicate × dp_shard = the processes (torchtitan's
    data_parallel_replicate_degree × data_parallel_shard_degree). FSDP2 shards each block over the
    dp_shard processes of a group and replicates the groups (HSDP): its all-gathers and
    reduce-scatters stay inside a group, and only one all-reduce of the sharded gradients crosses
    groups. The default shards over every process, as plain FSDP; dp_replicate=auto shards within a
    node and replicates across nodes. The run plan decides the degrees (train/plan.py)."""

    dp_replicate: str = "1"  # a number of replicas, or auto: one per node
    dp_shard: int = -1  # processes per replica; -1: the processes dp_replicate leaves
    # All-gather the FP8 CODA block's layer GEMM weights in e4m3 (each shard quantized before the
    # gather: half the bytes of bf16), as the GEMMs read them anyway. null: on when
    # block.precision=fp8 and FSDP2 shards (dp_shard > 1); true needs block=coda, block.precision=fp8.
    fp8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if self.dp_replicate != AUTO_REPLICATE and not (
            self.dp_replicate.isdigit() and int(self.dp_replicate) > 0
        ):
            raise ValueError(f"parallel.dp_replicate must be a positive number or {AUTO_REPLICATE}, "
                             f"got {self.dp_replicate!r}")
        if self.dp_shard != -1 and self.dp_shard <= 0:
            raise ValueError(f"parallel.dp_shard must be positive or -1 (the processes left), "
                             f"got {self.dp_shard}")


@dataclass
class CheckpointConfig:
    """Training checkpoints in <run_dir>/checkpoints/step_<n>/ (codatrain/train/checkpoint.py)."""

    every: int = 0  # save every N steps (0: only at the end when `at_end`)
    at_end: bool = True  # save after the last step
    keep_last: int = 3  # complete checkpoints kept, newest first; <= 0 keeps all
    # auto: continue from the newest complete checkpoint of the run dir, if any (broken ones are
    # skipped with a warning); none: start fresh (an error if the run dir has checkpoints);
    # <path>: continue from that step_<n> directory, which must be complete.
    resume: str = "auto"
    # An HF Llama directory or .safetensors file, or a codatrain checkpoint (a step_<n> directory),
    # whose weights start a fresh run (finetuning: new optimizer, step 0). A checkpoint to resume
    # takes precedence.
    init_from: str | None = None
    save_hf_every: int = 0  # also write <run_dir>/hf/step_<n>/ every N steps and at the end (0: never)
    # Ctrl-C or SIGTERM stops the run after the step in flight; it saves there when the last checkpoint
    # is at least this many steps old (1: whenever it is not of this step; 0: never).
    stop_save_after: int = 1

    def __post_init__(self) -> None:
        expand_home(self, "resume", "init_from")
        require_not_negative(self, "checkpoint", "every", "save_hf_every", "stop_save_after")


@dataclass
class KernelsConfig:
    """Precompiled CuTeDSL kernels (codatrain/kernels/cache.py, scripts/precompile.py)."""

    # Where scripts/precompile.py built the kernels of this run (QuACK's and FA4's caches and a
    # manifest). null: the kernels compile on first use, into the libraries' default caches.
    cache_dir: str | None = None
    # A cache built for other versions, other kernel sources or another config (or never built):
    # rebuild it before training, or fail with a message that names every difference.
    on_stale: OnStale = OnStale.rebuild

    def __post_init__(self) -> None:
        expand_home(self, "cache_dir")


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.disabled  # wandb records the run's metrics and resolved config
    project: str = "codatrain"  # wandb project
    entity: str | None = None  # wandb team or user; null: wandb's default
    name: str | None = None  # wandb run name; null: one wandb makes up


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    logger: LoggerConfig = MISSING


MAX_NAME_BYTES = 255  # the longest file name ext4, xfs and btrfs take


def job_dirname(overrides: str) -> str:
    """A sweep job's folder under train.run_dir: its overrides (Hydra's override_dirname) as they are,
    but a part of them between slashes (which a path value brings) too long for a file name is cut,
    with a hash of the whole part, so that jobs stay apart and a rerun finds its folder again."""
    parts = []
    for part in overrides.split("/"):
        if len(part.encode()) > MAX_NAME_BYTES:
            digest = hashlib.blake2b(part.encode(), digest_size=8).hexdigest()
            part = part.encode()[:200].decode(errors="ignore") + f"...{digest}"
        parts.append(part)
    return "/".join(parts)


def register_configs() -> None:
    """The schema as the base of configs/train.yaml: RunConfig types every group's node, so the
    group files need no schema of their own (which `--help` would list as a choice). And the
    `expanduser` resolver, for Hydra's own output folder (hydra.run.dir, the run directory), and
    `job_dirname`, for a sweep job's (hydra.sweep.subdir)."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    if not OmegaConf.has_resolver("expanduser"):
        OmegaConf.register_new_resolver("expanduser", os.path.expanduser)
    if not OmegaConf.has_resolver("job_dirname"):
        OmegaConf.register_new_resolver("job_dirname", job_dirname)


def expand_home_in_overrides(overrides: list[str]) -> list[str]:
    """`key=~/path` overrides with the `~` expanded, as a shell does in an assignment: Hydra's
    grammar has no bare `~` (a quoted one reaches the config, whose path fields expand it)."""
    expanded = []
    for override in overrides:
        key, sep, value = override.partition("=")
        expanded.append(f"{key}={os.path.expanduser(value)}" if sep and value.startswith("~") else override)
    return expanded


def schema_keys(node: type | None = None, prefix: str = "") -> set[str]:
    """Every key of the run schema (`train.steps`, `logger.wandb.mode`, ...), the groups' names too."""
    node = node or RunConfig
    hints = typing.get_type_hints(node)
    keys = set()
    for f in dataclasses.fields(node):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= schema_keys(hints[f.name], f"{prefix}{f.name}.")
    return keys


def unknown_override_key(overrides: list[str]) -> str | None:
    """The first `key=value` override whose key the schema lacks, with the nearest key, as a line:
    Hydra's own message offers `+key=value` (which then fails) for what is most often a typo."""
    keys = schema_keys()
    for override in overrides:
        key, sep, _ = override.partition("=")
        if not sep or key.startswith(("+", "~", "-", "hydra.")) or "@" in key or key in keys:
            continue
        near = difflib.get_close_matches(key, keys, n=1)
        return (f"unknown config key {key!r}" + (f"; did you mean {near[0]}?" if near else "")
                + " (docs/config.md lists every key)")
    return None


def validate(cfg: DictConfig) -> RunConfig:
    """The typed run of a composed config, after the checks that composition cannot make: keys
    forced in with `+key=value` (they bypass the schema), and each node's `__post_init__` (counts,
    options that need another). Raises ValueError naming the key."""
    try:
        OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg))
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as error:
        raise ValueError(f"invalid config: {error}") from None


def load_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose configs/train.yaml with command-line style overrides, as scripts/train.py does."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    register_configs()
    config_dir = Path(__file__).resolve().parent.parent / "configs"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="train", overrides=expand_home_in_overrides(overrides or []))
