"""Model shapes: `LlamaConfig`, its named presets, parameter counts and model FLOPs (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from codatrain.kernels.stages import Rope, RopeType

# The scaling fields of RoPE (beyond rope_theta), with the types they apply to. A field that does
# not apply to model.rope_type must keep its default, so that equal configs compute equal models.
ROPE_SCALING_FIELDS = {
    "rope_factor": (RopeType.linear, RopeType.llama3),
    "rope_low_freq_factor": (RopeType.llama3,),
    "rope_high_freq_factor": (RopeType.llama3,),
    "rope_original_max_positions": (RopeType.llama3,),
}

# Fields that decide tensor shapes or the function the model computes; max_seq_len and init_std
# may change between a checkpoint and the run that loads it.
ARCHITECTURE_FIELDS = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                       "vocab_size", "rope_theta", "rope_type", *ROPE_SCALING_FIELDS, "norm_eps",
                       "tie_embeddings", "qkv_bias", "qk_norm")


class ArchitectureMismatch(ValueError):
    """Weights (a checkpoint, an HF folder) of another architecture than the run's model config."""


class ModelFamily(StrEnum):
    """The Llama-style decoder families, named as Hugging Face's `model_type`: the name an export
    keeps, so that transformers loads it as that family."""

    llama = "llama"
    mistral = "mistral"  # the Llama architecture (without sliding-window attention)
    qwen2 = "qwen2"  # Qwen2 and Qwen2.5: a bias on the q, k and v projections
    qwen3 = "qwen3"  # Qwen3 (dense): RMSNorm over each q and k head before RoPE


# What each family's attention has: (qkv_bias, qk_norm). A family's checkpoints have exactly
# these (transformers' classes have no switch for them), so a config matches its family.
FAMILY_ATTENTION = {
    ModelFamily.llama: (False, False),
    ModelFamily.mistral: (False, False),
    ModelFamily.qwen2: (True, False),
    ModelFamily.qwen3: (False, True),
}


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder. `head_dim` None is dim / n_heads (Qwen3 gives its own); `qkv_bias`
    adds a bias to the q, k and v projections (Qwen2), `qk_norm` an RMSNorm (weights of size
    head_dim) over each q and k head before RoPE (Qwen3)."""

    dim: int  # model width (hidden size)
    n_layers: int  # transformer blocks
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when fewer than n_heads)
    ffn_dim: int  # SwiGLU hidden width
    vocab_size: int  # rows of the embedding and the LM head; at least the tokenizer's ids
    head_dim: int | None = None  # width of one head; null: dim / n_heads (Qwen3 gives its own)
    family: ModelFamily = ModelFamily.llama  # the HF model_type the architecture is exported as
    qkv_bias: bool = False  # a bias on the q, k and v projections (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    rope_theta: float = 500000.0  # RoPE base
    # RoPE scaling, as Hugging Face's rope_parameters (codatrain.kernels.stages.Rope).
    rope_type: RopeType = RopeType.default
    rope_factor: float = 1.0  # linear, llama3: how much longer the context is than in pretraining
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / this are scaled in full
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / this are kept
    rope_original_max_positions: int = 8192  # llama3: the context length of pretraining
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # the LM head is the embedding matrix (one parameter)
    max_seq_len: int = 8192  # longest sequence the model takes (data.seq_len, generation)
    init_std: float = 0.02  # std of the normal weight init (output projections: / sqrt(2 n_layers))

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                     "norm_eps", "init_std"):  # a negative eps or std trains on NaN or noise
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                                 "set model.head_dim to give the head width")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        elif self.head_dim <= 0:
            raise ValueError(f"model.head_dim must be positive, got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        self._check_family()
        self._check_rope()

    def _check_family(self) -> None:
        try:  # a checkpoint manifest gives the family as a string
            object.__setattr__(self, "family", ModelFamily(self.family))
        except ValueError:
            raise ValueError(f"model.family={self.family!r} is not one of {', '.join(ModelFamily)}") from None
        qkv_bias, qk_norm = FAMILY_ATTENTION[self.family]
        for key, wanted in (("qkv_bias", qkv_bias), ("qk_norm", qk_norm)):
            if getattr(self, key) != wanted:
                raise ValueError(f"model.{key}={getattr(self, key)} does not fit model.family={self.family}, "
                                 f"whose checkpoints have {key}={wanted}")

    def _check_rope(self) -> None:
        try:  # a checkpoint manifest or config.json gives the type as a string
            object.__setattr__(self, "rope_type", RopeType(self.rope_type))
        except ValueError:
            known = ", ".join(RopeType)
            raise ValueError(f"model.rope_type={self.rope_type!r} is not one of {known}") from None
        defaults = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
        for name, types in ROPE_SCALING_FIELDS.items():
            if self.rope_type not in types and getattr(self, name) != defaults[name]:
                raise ValueError(f"model.{name}={getattr(self, name)} has no effect with model.rope_type="
                                 f"{self.rope_type}; it applies to rope_type {' or '.join(types)}")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.rope_factor < 1:
            raise ValueError(f"model.rope_factor must be at least 1, got {self.rope_factor}")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"need 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got "
                f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
            )
        if self.rope_original_max_positions <= 0:
            raise ValueError(
                f"model.rope_original_max_positions must be positive, got {self.rope_original_max_positions}"
            )

    @property
    def rope(self) -> Rope:
        """θ and the scaling that give RoPE its rates (`codatrain.kernels.stages.rope_inv_freq`)."""
        return Rope(self.rope_theta, self.rope_type, self.rope_factor, self.rope_low_freq_factor,
                    self.rope_high_freq_factor, self.rope_original_max_positions)

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused QKV weight: (h_q + 2·h_kv)·d_h."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def replace(self, **overrides: object) -> LlamaConfig:
        """This config with `overrides`. A head dim that was dim / n_heads follows a new dim or
        head count unless it is overridden too."""
        derived = self.head_dim == self.dim // self.n_heads and not self.dim % self.n_heads
        if derived and "head_dim" not in overrides and {"dim", "n_heads"} & set(overrides):
            overrides["head_dim"] = None
        return dataclasses.replace(self, **overrides)

    def check_architecture(self, found: LlamaConfig, source: str) -> None:
        """An ArchitectureMismatch listing every architecture field where `found` (from `source`, a
        checkpoint say) differs from this config, with the overrides that would match it."""
        diffs = [f for f in ARCHITECTURE_FIELDS if getattr(found, f) != getattr(self, f)]
        if diffs:
            detail = ", ".join(f"{f}: {getattr(found, f)} there, {getattr(self, f)} here" for f in diffs)
            fix = " ".join(f"model.{f}={getattr(found, f)}" for f in diffs)
            raise ArchitectureMismatch(f"{source} holds a different model ({detail}); to match it, set {fix}")

    # ---- parameter counts -------------------------------------------------------------------
    def layer_matmul_params(self) -> int:
        d, hd = self.dim, self.head_dim
        qkv = d * self.qkv_dim
        out = self.n_heads * hd * d
        mlp = 3 * d * self.ffn_dim
        return qkv + out + mlp

    def layer_vector_params(self) -> int:
        """A layer's parameters outside its matmuls: its two norms, the QKV bias and the QK-norms."""
        bias = self.qkv_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return 2 * self.dim + bias + qk_norm

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul: every linear layer and the LM head (not the embedding
        lookup). A tied head is a GEMM all the same."""
        return self.n_layers * self.layer_matmul_params() + self.dim * self.vocab_size

    def num_params(self) -> int:
        """Every parameter once: a tied embedding and head are one matrix."""
        vectors = self.n_layers * self.layer_vector_params() + self.dim
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.matmul_params() + embedding + vectors

    # ---- FLOPs ------------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (forward + backward), docs/design.md §6.

        6·N_matmul for the weight matmuls, plus 12·L·h_q·d_h·T for the attention score and value
        matmuls. No causal discount; activation recompute is not counted.
        """
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.matmul_params() + attention


# Llama 3.1 and 3.2's RoPE scaling, less the factor (θ = 500000 is the field's default).
_LLAMA3_ROPE = {"rope_type": RopeType.llama3, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                "rope_original_max_positions": 8192}

PRESETS: dict[str, LlamaConfig] = {
    # Trains a few hundred steps in about a minute on two CPU cores; vocab fits the byte tokenizer.
    "tiny": LlamaConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=512,
        rope_theta=10000.0, max_seq_len=1024,
    ),
    "llama3_125m": LlamaConfig(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=32768,
    ),
    "llama3_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
    ),
    "llama3_8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
    ),
    # The published Llama 3.x checkpoints (their config.json): llama3_1b and llama3_8b above keep
    # their unscaled RoPE and untied head, so that benchmarks stay comparable.
    "llama3_2_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        tie_embeddings=True, max_seq_len=131072, **_LLAMA3_ROPE, rope_factor=32.0,
    ),
    "llama3_2_3b": LlamaConfig(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        tie_embeddings=True, max_seq_len=131072, **_LLAMA3_ROPE, rope_factor=32.0,
    ),
    "llama3_1_8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
        max_seq_len=131072, **_LLAMA3_ROPE, rope_factor=8.0,
    ),
    # Mistral 7B v0.3 (v0.1's sliding window is not built: docs/design.md §7, model/hf.py).
    "mistral_7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
        family=ModelFamily.mistral, rope_theta=1000000.0, max_seq_len=32768,
    ),
    # Qwen2.5's published architectures (the base models' config.json).
    "qwen2_5_0_5b": LlamaConfig(
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
        family=ModelFamily.qwen2, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
        max_seq_len=32768,
    ),
    "qwen2_5_7b": LlamaConfig(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
        family=ModelFamily.qwen2, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=131072,
    ),
    # Qwen3's published dense architectures: heads of 128 whatever dim / n_heads is.
    "qwen3_0_6b": LlamaConfig(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072, vocab_size=151936,
        family=ModelFamily.qwen3, qk_norm=True, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
        max_seq_len=40960,
    ),
    "qwen3_8b": LlamaConfig(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, vocab_size=151936,
        family=ModelFamily.qwen3, qk_norm=True, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=40960,
    ),
}


def get_preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
