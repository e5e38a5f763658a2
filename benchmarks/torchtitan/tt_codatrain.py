"""torchtitan 0.3.0 config registry for an external reference run at codatrain's llama3_1b shape.

Used as `--module tt_codatrain --config codatrain_llama3_1b` (torchtitan's ConfigManager imports a
fully-qualified module and calls the named function). It adds what torchtitan 0.3.0 lacks for an
offline run: a synthetic-token dataloader (the same token rule as codatrain's data=synthetic,
codatrain/data/packing.py SyntheticWindows) and a tokenizer stand-in, so that no tokenizer files,
dataset or network are needed.

Importing this module first applies `tt_compat` (the torch-2.11 shims; see that file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import tt_compat  # before any torchtitan import: its shims must exist when torchtitan imports torch names
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import _build_llama3_layers, model_registry
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

tt_compat.patch_torchtitan()


# ----------------------------------------------------------------------------- data

class SyntheticTokenizer(BaseTokenizer):
    """Stand-in: the synthetic dataloader never tokenizes text."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        self._vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("synthetic run: no text is tokenized")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("synthetic run: no text is decoded")

    def get_vocab_size(self) -> int:
        return self._vocab_size


class SyntheticDataLoader(BaseDataLoader):
    """Windows of random tokens in [0, 256) where every odd position is (3 * previous + 1) % 256:
    window i is numpy default_rng([seed, 0, i]), as codatrain's SyntheticWindows. One document per
    row (positions 0..seq_len-1), so torchtitan's block-causal mask is the plain causal mask."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        synthetic_vocab: int = 256

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = None):
        self.cfg = config
        self.seq_len, self.batch = seq_len, local_batch_size
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.next_window = dp_rank * local_batch_size

    def _window(self, i: int) -> np.ndarray:
        v = self.cfg.synthetic_vocab
        w = np.random.default_rng([self.cfg.seed, 0, i]).integers(0, v, self.seq_len + 1)
        w[1::2] = (w[0:-1:2] * 3 + 1) % v
        return w

    def __iter__(self):
        positions = torch.arange(self.seq_len, dtype=torch.long).expand(self.batch, -1).contiguous()
        while True:
            idx = range(self.next_window, self.next_window + self.batch)
            self.next_window += self.batch * self.dp_world_size
            tokens = torch.from_numpy(np.stack([self._window(i) for i in idx]))
            yield ({"input": tokens[:, :-1].contiguous(), "positions": positions.clone()},
                   tokens[:, 1:].contiguous())

    def state_dict(self):
        return {"next_window": self.next_window}

    def load_state_dict(self, state_dict):
        if state_dict:
            self.next_window = state_dict["next_window"]


# ----------------------------------------------------------------------------- model

_LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}


def _output_linear_init(dim: int):
    s = dim**-0.5
    return {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}


def llama_model(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
                rope_theta: float, max_seq_len: int, attn_backend: str) -> Llama3Model.Config:
    """torchtitan's Llama 3 model at an explicit shape: untied head, unscaled RoPE (scaling="none"),
    RMSNorm eps 1e-5, SwiGLU hidden = ffn_dim exactly (no multiplier arithmetic)."""
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            hidden_dim=ffn_dim,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=rope_theta,
                                    scaling="none"),
            attn_backend=attn_backend,
        ),
    )


def _spec(model: Llama3Model.Config, flavor: str) -> ModelSpec:
    base = model_registry("debugmodel")  # only for parallelize_fn / pipelining_fn / state_dict_adapter
    return ModelSpec(name="llama3", flavor=flavor, model=model, parallelize_fn=base.parallelize_fn,
                     pipelining_fn=base.pipelining_fn, post_optimizer_build_fn=None,
                     state_dict_adapter=base.state_dict_adapter)


def _loss_config(spec: ModelSpec):
    """TT_LOSS=ce (default): plain CrossEntropyLoss over full logits (torchtitan's
    llama3_debugmodel_ce_loss). TT_LOSS=chunked: torchtitan's default ChunkedLossWrapper, which
    under torch 2.11 fails in the first backward: its lm_head.reshard() (components/loss.py:772)
    also frees the final norm's weight, which shares the lm_head's FSDP group
    (distributed/fsdp.py:203), before the norm's backward needs it ("The tensor has a non-zero
    number of elements, but its data is not allocated yet" in MulBackward0 of rms_norm, seen on
    CPU with torch 2.11; torch 2.13 CPU runs the same step)."""
    ce = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    kind = os.environ.get("TT_LOSS", "ce")
    if kind == "ce":
        return ce
    if kind == "chunked":
        return ChunkedLossWrapper.Config(loss_fn=ce)
    raise ValueError(f"TT_LOSS={kind!r}: expected ce or chunked")


def _trainer_config(spec: ModelSpec, *, local_batch_size: int, seq_len: int, steps: int,
                    compile_enable: bool, cuda_graphs: bool) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=os.environ.get("TT_ASSETS", "/tmp/tt-no-assets"),  # absent: only a warning
        dump_folder=os.environ.get("TT_DUMP", "/tmp/tt-out"),
        tokenizer=SyntheticTokenizer.Config(),
        dataloader=SyntheticDataLoader.Config(),
        loss=_loss_config(spec),
        optimizer=default_adamw(lr=3e-4),  # AdamW, betas (0.9, 0.95), wd 0.1, fused
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5),
        training=TrainingConfig(
            local_batch_size=local_batch_size, seq_len=seq_len, steps=steps,
            dtype="float32", mixed_precision_param="bfloat16", mixed_precision_reduce="float32",
            max_norm=1.0, disable_cuda_graphs=not cuda_graphs,
        ),
        parallelism=ParallelismConfig(),  # dp_shard=-1 -> all ranks; FSDP2 is applied even at 1 rank
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,  # activation checkpointing off
        compile=CompileConfig(enable=compile_enable, components=["model", "loss"]),  # per-block compile
        validator=Validator.Config(enable=False),
    )


def _env_flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0") not in ("0", "", "false", "False")


def codatrain_llama3_1b() -> Trainer.Config:
    """codatrain's llama3_1b preset (codatrain/model/config.py): dim 2048, 16 layers, 32 heads,
    8 KV heads, ffn 8192, vocab 128256, rope_theta 5e5, untied; seq 8192 x micro-batch 4 =
    32768 tokens/step, no gradient accumulation."""
    model = llama_model(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                        rope_theta=500000.0, max_seq_len=8192,
                        attn_backend=os.environ.get("TT_ATTN", "flex"))
    return _trainer_config(_spec(model, "codatrain_llama3_1b"),
                           local_batch_size=int(os.environ.get("TT_MB", "4")),
                           seq_len=int(os.environ.get("TT_SEQ", "8192")),
                           steps=int(os.environ.get("TT_STEPS", "30")),
                           compile_enable=_env_flag("TT_COMPILE", True),
                           cuda_graphs=_env_flag("TT_CUDA_GRAPHS", False))

