"""The run plan: every fact derived from a run's typed config, decided once.

`build_run_plan` reads checkpoint.init_from's architecture once (model=hf), gives the data config
its tokenizer, resolves the block for the device (`resolve_block` loads the CODA kernels and checks
them against it, once), and derives the kernel shapes, the compute dtype, the tokens per optimizer
step and the gradient accumulation. The trainer runs from the plan and scripts/precompile.py builds
the same plan without a device (for its target, an sm_90 GPU); `header` is the run's header.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from codatrain.config import (
    AUTO_REPLICATE,
    BlockConfig,
    BlockImpl,
    ParallelConfig,
    Precision,
    RunConfig,
    load_config,
    unknown_override_key,
    validate,
)
from codatrain.data.config import DataConfig
from codatrain.kernels.cache import KernelShapes
from codatrain.kernels.fp8 import GRAD_FORMATS, Fp8Recipe
from codatrain.kernels.resolve import FP8_ROW_MULTIPLE, ResolvedBlock, resolve_block
from codatrain.model.config import LlamaConfig
from codatrain.train.float8 import float8_problem
from codatrain.train.hf_io import run_model_config, run_tokenizer


@dataclass(frozen=True)
class DataParallelMesh:
    """dp_replicate × dp_shard processes (config.ParallelConfig): FSDP2 shards over dp_shard and
    replicates over dp_replicate. A process's data-parallel rank is replica · dp_shard + shard,
    which is its global rank (the mesh lays the ranks out replica by replica)."""

    replicate: int
    shard: int

    @property
    def size(self) -> int:
        return self.replicate * self.shard

    def describe(self) -> str:
        if self.replicate == 1:
            return "full shard"
        if self.shard == 1:
            return f"replicate {self.replicate}"
        return f"HSDP {self.replicate} replicas × {self.shard} shards"


def data_parallel_mesh(cfg: ParallelConfig, world_size: int, local_world_size: int) -> DataParallelMesh:
    """The degrees of `cfg` on `world_size` processes, `local_world_size` of them per node: auto
    replicates once per node; dp_shard=-1 takes the processes dp_replicate leaves. Degrees whose
    product is not the world size are a ValueError naming the keys and the numbers."""
    if cfg.dp_replicate == AUTO_REPLICATE:
        if world_size % local_world_size:
            raise ValueError(f"parallel.dp_replicate=auto needs the same number of processes on every node: "
                             f"{world_size} processes are not a multiple of {local_world_size} per node")
        replicate = world_size // local_world_size
    else:
        replicate = int(cfg.dp_replicate)
    if cfg.dp_shard == -1 and world_size % replicate:
        raise ValueError(f"parallel.dp_replicate={replicate} replicas do not divide the job's {world_size} "
                         "processes (parallel.dp_shard=-1 gives each replica the processes it leaves)")
    shard = cfg.dp_shard if cfg.dp_shard != -1 else world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(
            f"parallel.dp_replicate × parallel.dp_shard = {replicate} × {shard} = {replicate * shard}, "
            f"but the job has {world_size} processes"
        )
    return DataParallelMesh(replicate, shard)


@dataclass(frozen=True)
class RunPlan:
    run: RunConfig
    model_cfg: LlamaConfig  # the preset with overrides, or for model=hf init_from's architecture
    data: DataConfig  # run.data with its tokenizer decided
    tokenizer_line: str  # the tokenizer in force and where it comes from, for the header
    block: ResolvedBlock  # for a device: with the CODA kernels, checked against it
    kernel_shapes: KernelShapes  # the CuTeDSL kernels a job launches (the kernel cache's key)
    # What the model computes in: bf16 on a GPU (parameters stay fp32), fp32 elsewhere.
    compute_dtype: torch.dtype
    device: str  # the device type, or "sm_90 target" for a plan without a device
    world_size: int
    mesh: DataParallelMesh
    tokens_per_step: int
    grad_accum: int  # micro-batches per optimizer step and process
    fp8: Fp8Recipe | None = None  # the CODA layer GEMMs' FP8 recipe (block.precision=fp8)
    fp8_all_gather: bool = False  # FSDP2 gathers the FP8 layer weights in FP8 (parallel.fp8_all_gather)

    def header(self) -> list[str]:
        """The run header: block, model, processes, batch and compute dtype; then the recipe."""
        run, cfg = self.run, self.model_cfg
        dtype = str(self.compute_dtype).removeprefix("torch.")
        optim = run.optim  # the model config's recipe, with any overrides
        clip = f"{optim.grad_clip:g}" if optim.grad_clip > 0 else "off"
        mesh = f" ({self.mesh.describe()})" if self.world_size > 1 else ""
        if run.train.float8 != "none":
            dtype += f" + float8 {run.train.float8} (torchao)"
        elif self.fp8 is not None:
            dtype += f", layer GEMMs in {self.fp8.describe()}"
            if self.fp8_all_gather:
                dtype += ", weights all-gathered in fp8"
        # What follows the warmup: a constant lr has no floor, and wsd holds the peak until its decay.
        schedule = f"{optim.schedule} to {optim.min_lr_ratio:g}×"
        if optim.schedule == "constant":
            schedule = "constant"
        elif optim.schedule == "wsd":
            schedule += f" over the last {100 * optim.decay_fraction:g}% of steps"
        return [
            f"codatrain | block={self.block.describe()} | {run.model.preset}: "
            f"{cfg.num_params() / 1e6:.1f}M params, {cfg.flops_per_token(self.data.seq_len) / 1e9:.3f} "
            f"GFLOP/token | {self.world_size} × {self.device}{mesh} | seq {self.data.seq_len} × micro-batch "
            f"{run.train.micro_batch_size} × accum {self.grad_accum} = {self.tokens_per_step} tokens/step "
            f"| {dtype}",
            f"recipe: AdamW lr {optim.lr:g}, {optim.warmup_steps} warmup steps, {schedule} | weight decay "
            f"{optim.weight_decay:g} | betas ({optim.beta1:g}, {optim.beta2:g}) | grad clip {clip}",
            self.tokenizer_line,
        ]


def build_run_plan(run: RunConfig, device: torch.device | None, world_size: int = 1,
                   local_world_size: int | None = None) -> RunPlan:
    """The plan of `run` on `world_size` processes of `device`, `local_world_size` per node (default:
    one node). `device` None plans for the precompile target, an sm_90 GPU, without touching one
    (and one process: tokens per step that fit N processes fit one). Raises ValueError naming the
    key for a batch that does not divide or a mesh that does not fit the processes."""
    mesh = data_parallel_mesh(run.parallel, world_size, local_world_size or world_size)
    model_cfg = run_model_config(run)
    tokenizer, tokenizer_line = run_tokenizer(run)
    data = replace(run.data, tokenizer=tokenizer)
    block = resolve_block(run.block.impl, run.block.backend, run.block.attention, device, model_cfg.head_dim)
    fp8 = fp8_recipe(run.block)
    if fp8 is not None and block.stages is not None:
        block = replace(block, stages=block.stages.for_fp8(fp8))
    # Refused here, before anything compiles: a width or an epilogue the kernels cannot take would
    # otherwise stop the kernel build with a compiler error.
    problem = (block.unsupported_model(model_cfg.dim, model_cfg.ffn_dim, model_cfg.head_dim,
                                       qkv_bias=model_cfg.qkv_bias, qk_norm=model_cfg.qk_norm,
                                       fp8=fp8 is not None)
               or float8_problem(run.train.float8, block.impl, device))
    if problem:
        raise ValueError(problem)
    if fp8 is not None and block.cute_stages and (model_cfg.qkv_bias or model_cfg.qk_norm):
        # F4's FP8 QKV-bias and QK-norm epilogues (Qwen2, Qwen3) compile for sm_90a and have GPU
        # tests (tests/gpu/test_cute_fp8_backend.py, test_cute_fp8_model.py) that have not run yet:
        # no job trains on them until those pass.
        key = "qk_norm" if model_cfg.qk_norm else "qkv_bias"
        raise ValueError(f"block.precision=fp8 with model.{key}=true does not run on block.backend=cute yet: "
                         "its FP8 kernels are built but not yet checked against the reference on a GPU; use "
                         "block.precision=bf16, or block.backend=reference")
    tcfg = run.train
    micro_batch_tokens = tcfg.micro_batch_size * data.seq_len
    if fp8 is not None and block.cute_stages and micro_batch_tokens % FP8_ROW_MULTIPLE:
        # The weight gradients read the tokens as FP8 rows too (docs/design.md §3, FP8).
        raise ValueError(f"train.micro_batch_size × data.seq_len = {micro_batch_tokens} tokens does not run "
                         "with block.precision=fp8 on block.backend=cute: it must be a multiple of "
                         f"{FP8_ROW_MULTIPLE}")
    tokens_per_micro_step = tcfg.micro_batch_size * data.seq_len * world_size
    tokens_per_step = tcfg.tokens_per_step or tokens_per_micro_step
    if tokens_per_step % tokens_per_micro_step:
        raise ValueError(
            f"train.tokens_per_step={tokens_per_step} is not a multiple of micro_batch_size × "
            f"data.seq_len × processes = {tcfg.micro_batch_size} × {data.seq_len} × "
            f"{world_size} = {tokens_per_micro_step}"
        )
    shapes = KernelShapes(
        dim=model_cfg.dim, n_heads=model_cfg.n_heads, n_kv_heads=model_cfg.n_kv_heads,
        head_dim=model_cfg.head_dim, ffn_dim=model_cfg.ffn_dim, vocab_size=model_cfg.vocab_size,
        batch=tcfg.micro_batch_size, seq_len=data.seq_len, stages=block.cute_stages, fa4=block.fa4,
        documents=data.keep_document_boundaries, qkv_bias=model_cfg.qkv_bias, qk_norm=model_cfg.qk_norm,
        **fp8_kernel_shapes(run.block, fp8, block.cute_stages),
    )
    gpu = device is None or device.type == "cuda"
    return RunPlan(
        run=run, model_cfg=model_cfg, data=data, tokenizer_line=tokenizer_line, block=block,
        kernel_shapes=shapes,
        compute_dtype=torch.bfloat16 if gpu else torch.float32,
        device="sm_90 target" if device is None else device.type, world_size=world_size,
        mesh=mesh, tokens_per_step=tokens_per_step, grad_accum=tokens_per_step // tokens_per_micro_step,
        fp8=fp8, fp8_all_gather=fp8_all_gather(run, fp8, mesh),
    )


def fp8_all_gather(run: RunConfig, fp8: Fp8Recipe | None, mesh: DataParallelMesh) -> bool:
    """Whether FSDP2 gathers the FP8 layer weights in FP8: `parallel.fp8_all_gather`, by default
    when there is an FP8 recipe and FSDP2 shards; true without the recipe is a ValueError."""
    asked = run.parallel.fp8_all_gather
    if asked is None:
        return fp8 is not None and mesh.shard > 1
    if asked and fp8 is None:
        block = "block.precision=bf16" if run.block.impl == BlockImpl.coda else f"block={run.block.impl}"
        raise ValueError(f"parallel.fp8_all_gather=true gathers the FP8 CODA block's layer weights in FP8: "
                         f"it needs block=coda with block.precision=fp8, not {block}")
    return asked


def fp8_recipe(block: BlockConfig) -> Fp8Recipe | None:
    """The FP8 recipe `block.precision=fp8` and the block.fp8_* keys ask for, or None for bf16."""
    if block.precision != Precision.fp8:
        return None
    return Fp8Recipe(history_len=block.fp8_history_len, margin=block.fp8_margin,
                     grad_dtype=GRAD_FORMATS[str(block.fp8_grad_format)], wgrad_fp8=block.fp8_wgrad,
                     fast_accum=block.fp8_fast_accum)


def fp8_kernel_shapes(block: BlockConfig, fp8: Fp8Recipe | None, cute_stages: bool) -> dict[str, object]:
    """The `KernelShapes` fields of the FP8 recipe: set only where the cute stages run it (the
    reference stages simulate FP8 without kernels of their own)."""
    if fp8 is None or not cute_stages:
        return {}
    return {"precision": str(block.precision), "fp8_grad_format": str(block.fp8_grad_format),
            "fp8_wgrad": fp8.wgrad_fp8, "fp8_fast_accum": fp8.fast_accum}


def target_plan(overrides: list[str]) -> RunPlan:
    """The plan, for the precompile target (an sm_90 GPU, not touched), of the run config that
    scripts/train.py's `overrides` give, with block=coda unless they name a block (the scripts that
    build or inspect the CuTeDSL kernels without a GPU). Raises ValueError or hydra's
    ConfigCompositionException naming a bad key."""
    # A misspelt key as scripts/train.py names it: Hydra's message offers `+key=value`, which fails too.
    if (unknown := unknown_override_key(overrides)) is not None:
        raise ValueError(unknown)
    if not any(o.split("=")[0].lstrip("+~") == "block" for o in overrides):
        overrides = ["block=coda", *overrides]
    return build_run_plan(validate(load_config(overrides)), None)
