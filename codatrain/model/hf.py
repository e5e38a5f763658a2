"""Hugging Face interop for the Llama-style families (Llama, Mistral, Qwen2/2.5, Qwen3): config.json,
tensor names and layouts, sharded safetensors files.

The canonical state (codatrain/model/llama.py) already uses HF's half-rotation RoPE and HF's
tensor names, so the conversion only adds the `model.` prefix and splits the fused projections:
`qkv_proj` = [q_proj; k_proj; v_proj] (weight and, for Qwen2, bias) and `gate_up_proj` =
[gate_proj; up_proj], row-wise. The four families share these names; config.json keeps the
family's `model_type`.

Weights are read and written through safetensors only, never through pickle, so an untrusted
download cannot run code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from codatrain.kernels.stages import RopeType
from codatrain.model.config import FAMILY_ATTENTION, ROPE_SCALING_FIELDS, LlamaConfig, ModelFamily

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default `max_shard_size="5GB"`


@dataclass(frozen=True)
class Delimiters:
    """The token ids that begin (None: no such token) and end a document."""

    bos_id: int | None
    eos_id: int

# Buffers that some HF checkpoints carry; they are recomputed from the config, not weights.
_IGNORED_HF_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# ---- config.json ---------------------------------------------------------------------------------
# Our RoPE scaling fields and their names in HF's rope_parameters.
_HF_ROPE_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_positions": "original_max_position_embeddings",
}


def _rope_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """`cfg`'s RoPE scaling as HF's rope_parameters less rope_theta: the keys its rope_type reads
    (HF warns about any other)."""
    used = [name for name, types in ROPE_SCALING_FIELDS.items() if cfg.rope_type in types]
    return {"rope_type": cfg.rope_type.value, **{_HF_ROPE_KEYS[name]: getattr(cfg, name) for name in used}}


# Each family's causal-LM class in transformers, the one `architectures` names.
HF_ARCHITECTURES = {
    ModelFamily.llama: "LlamaForCausalLM",
    ModelFamily.mistral: "MistralForCausalLM",
    ModelFamily.qwen2: "Qwen2ForCausalLM",
    ModelFamily.qwen3: "Qwen3ForCausalLM",
}

# The keys of each family's config.json beyond the shared ones, as codatrain's models compute
# them: no bias but Qwen2's QKV bias (which its config has no key for), full attention everywhere.
_FAMILY_KEYS: dict[ModelFamily, dict[str, Any]] = {
    ModelFamily.llama: {"attention_bias": False, "mlp_bias": False},
    ModelFamily.mistral: {"sliding_window": None},
    ModelFamily.qwen2: {"use_sliding_window": False, "sliding_window": None},
    ModelFamily.qwen3: {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
}

# transformers' defaults for keys a config.json may leave out, where the families differ.
_DEFAULT_MAX_POSITIONS = {ModelFamily.llama: 2048, ModelFamily.mistral: 131072, ModelFamily.qwen2: 32768,
                          ModelFamily.qwen3: 32768}
_DEFAULT_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when the key is absent
_DEFAULT_QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when the key is absent


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype = torch.float32,
                 delimiters: Delimiters | None = None) -> dict[str, Any]:
    """The config.json of the transformers model of `cfg`'s family (`LlamaForCausalLM`,
    `Qwen2ForCausalLM`, ...) with the same architecture as `cfg`, and the token ids of its
    tokenizer's `delimiters` (without them transformers assumes BOS 1 and EOS 2)."""
    dtype_name = str(dtype).removeprefix("torch.")
    rope = _rope_to_hf(cfg)
    ids = {} if delimiters is None else {"bos_token_id": delimiters.bos_id, "eos_token_id": delimiters.eos_id}
    return {**ids,
        "architectures": [HF_ARCHITECTURES[cfg.family]],
        "model_type": cfg.family.value,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads `rope_theta` and `rope_scaling`; transformers 5 reads `rope_parameters`.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_type == RopeType.default else rope,
        "rope_parameters": rope | {"rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        **_FAMILY_KEYS[cfg.family],
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype_name,
    }


def _rope_from_hf(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Our RoPE fields from either the transformers 5 (`rope_parameters`) or the transformers 4
    spelling (`rope_theta`, `rope_scaling`); what codatrain cannot run goes to `problems`."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers 5's priority
    rope_type = params.get("rope_type", params.get("type", "default"))
    # 10000: HF LlamaConfig's default θ.
    fields: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type not in set(RopeType):
        problems.append(f"RoPE scaling type {rope_type!r} is not supported (codatrain implements "
                        f"{', '.join(RopeType)})")
        return fields
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    fields["rope_type"] = RopeType(rope_type)
    # Without the pretraining context transformers takes max_position_embeddings.
    hf_values = {"original_max_position_embeddings": hf.get("max_position_embeddings", 2048), **params}
    for name, types in ROPE_SCALING_FIELDS.items():
        key = _HF_ROPE_KEYS[name]
        if fields["rope_type"] not in types:
            continue
        if key not in hf_values:
            problems.append(f"rope_parameters of type {rope_type!r} lack {key}")
        else:
            fields[name] = (int if name == "rope_original_max_positions" else float)(hf_values[key])
    return fields


def _family_from_hf(hf: dict[str, Any]) -> ModelFamily:
    """The family a config.json's model_type names (absent: llama); any other is a ValueError."""
    model_type = hf.get("model_type", "llama")
    if model_type not in set(ModelFamily):
        raise ValueError(f"config.json has model_type={model_type!r}; codatrain loads "
                         f"{', '.join(repr(f.value) for f in ModelFamily)} checkpoints")
    return ModelFamily(model_type)


def _attention_problems(hf: dict[str, Any], family: ModelFamily, max_positions: int) -> list[str]:
    """What a family's config.json asks of attention that codatrain's models do not compute."""
    problems = []
    for key in ("attention_bias", "mlp_bias"):  # Qwen2 has no such key: its QKV bias is always on
        if hf.get(key, False):
            problems.append(f"{key}=true is not supported (codatrain's {family} projections have "
                            f"{'only a QKV bias' if family == ModelFamily.qwen2 else 'no bias'})")
    if family == ModelFamily.mistral:
        window = hf.get("sliding_window", _DEFAULT_MISTRAL_WINDOW)
        if window is not None and window < max_positions:
            problems.append(f"sliding_window={window} < max_position_embeddings={max_positions}: "
                            "sliding-window attention is not supported (Mistral v0.1 uses it)")
    if hf.get("use_sliding_window", False):
        problems.append("use_sliding_window=true: sliding-window attention is not supported")
    windowed = sorted({t for t in hf.get("layer_types") or [] if t != "full_attention"})
    if windowed:
        problems.append(f"layer_types {', '.join(windowed)} are not supported (only full_attention)")
    return problems


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Our LlamaConfig for the config.json of a Llama, Mistral, Qwen2/2.5 or Qwen3 checkpoint; a
    ValueError names what codatrain cannot run (another model_type or architecture included)."""
    family = _family_from_hf(hf)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    problems: list[str] = []
    unknown = [name for name in hf.get("architectures") or [] if name != HF_ARCHITECTURES[family]]
    if unknown:
        problems.append(f"architectures {', '.join(unknown)} are not supported (model_type {family.value!r} "
                        f"loads as {HF_ARCHITECTURES[family]})")
    rope = _rope_from_hf(hf, problems)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    max_positions = hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[family])
    problems += _attention_problems(hf, family, max_positions)
    n_heads = hf["num_attention_heads"]
    qwen3 = family == ModelFamily.qwen3
    default_head_dim = _DEFAULT_QWEN3_HEAD_DIM if qwen3 else hf["hidden_size"] // n_heads
    head_dim = hf.get("head_dim") or default_head_dim
    if problems:
        raise ValueError(f"unsupported Hugging Face {family.value} config: " + "; ".join(problems))
    qkv_bias, qk_norm = FAMILY_ATTENTION[family]
    return LlamaConfig(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        family=family,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        **rope,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # the four families' default
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=max_positions,
        init_std=float(hf.get("initializer_range", 0.02)),
    )


# ---- tensor names and layouts --------------------------------------------------------------------
def hf_names(canonical: str) -> list[str]:
    """The HF tensors that make up one canonical tensor, in row order."""
    if canonical == "lm_head.weight":
        return [canonical]
    if ".self_attn.qkv_proj." in canonical:  # weight or bias
        stem, kind = canonical.split("qkv_proj.")
        return [f"model.{stem}{p}_proj.{kind}" for p in ("q", "k", "v")]
    if canonical.endswith("mlp.gate_up_proj.weight"):
        stem = canonical.removesuffix("gate_up_proj.weight")
        return [f"model.{stem}{p}_proj.weight" for p in ("gate", "up")]
    return [f"model.{canonical}"]


def hf_split_rows(canonical: str, cfg: LlamaConfig) -> list[int]:
    """Rows of each HF part of a canonical tensor (see `hf_names`)."""
    if ".self_attn.qkv_proj." in canonical:
        kv = cfg.n_kv_heads * cfg.head_dim
        return [cfg.n_heads * cfg.head_dim, kv, kv]
    if canonical.endswith("mlp.gate_up_proj.weight"):
        return [cfg.ffn_dim, cfg.ffn_dim]
    return []


def canonical_to_hf(canonical: str, tensor: torch.Tensor, cfg: LlamaConfig) -> list[tuple[str, torch.Tensor]]:
    """Split one canonical tensor into its HF tensors (copies, so none shares storage)."""
    rows = hf_split_rows(canonical, cfg)
    parts = tensor.split(rows, dim=0) if rows else [tensor]
    return [(name, part.clone()) for name, part in zip(hf_names(canonical), parts, strict=True)]


# ---- writing -------------------------------------------------------------------------------------
def save_hf(
    out_dir: str | os.PathLike,
    cfg: LlamaConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    delimiters: Delimiters | None = None,
) -> None:
    """Write an HF directory of `cfg`'s family (config.json + safetensors) from canonical (name,
    tensor) pairs; with the tokenizer's `delimiters`, config.json and generation_config.json name them.

    `tensors` is consumed lazily and exactly once, in order, so a caller can gather one tensor at a
    time; at most one shard of HF tensors is held in memory. One shard is written as
    `model.safetensors`; several as `model-0000i-of-0000N.safetensors` with an index json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []  # temporary file, names in it
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0
    seen_dtype = None

    def flush() -> None:
        nonlocal shard, shard_bytes
        path = out / f".shard-{len(written):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})  # transformers checks `format`
        written.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for canonical, tensor in tensors:
        tensor = tensor.detach().to("cpu", dtype or tensor.dtype)
        seen_dtype = tensor.dtype
        for name, part in canonical_to_hf(canonical, tensor, cfg):
            size = part.numel() * part.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[name] = part
            shard_bytes += size
            total_bytes += size
    if shard or not written:
        flush()

    # The shard count is known only now, so files get their final names at the end.
    for stale in [out / WEIGHTS_NAME, out / INDEX_NAME, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    weight_map, finals = {}, []
    for i, (path, names) in enumerate(written, start=1):
        final = WEIGHTS_NAME if len(written) == 1 else f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
        finals.append(out / final)
    if len(written) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = config_to_hf(cfg, seen_dtype or torch.float32, delimiters)
    (out / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    if delimiters is not None:  # what transformers' generate() stops at
        generation = {"bos_token_id": delimiters.bos_id, "eos_token_id": delimiters.eos_id}
        (out / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
    else:  # one left by an earlier export into `out` would name its tokenizer's delimiters
        (out / GENERATION_CONFIG_NAME).unlink(missing_ok=True)
    # safetensors creates its files mode 0600; give them the mode open() gave config.json (the
    # umask's), as every other output has.
    mode = (out / CONFIG_NAME).stat().st_mode & 0o777
    for final in finals:
        os.chmod(final, mode)


def _head(items: list[str], n: int, sep: str) -> str:
    """The first n items joined, and how many more there are: error messages stay readable."""
    more = f"{sep}and {len(items) - n} more" if len(items) > n else ""
    return sep.join(items[:n]) + more


def hub_id_hint(path: str | os.PathLike) -> str:
    """For a missing path shaped like a Hub id (`owner/name`): how to get its folder, as a
    parenthesis to append to the error; else ""."""
    if Path(path).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        return ""
    return (f" (a Hugging Face Hub id? codatrain reads local folders: download it first, `hf download {path} "
            f"--local-dir <folder>`, and pass the folder)")


# ---- reading -------------------------------------------------------------------------------------
def folder_hint(file: Path) -> str:
    """For a file inside an HF folder given where the folder is wanted (its config.json, its
    model.safetensors): how to pass the folder, to append to an error; else ""."""
    if file.is_file() and (file.parent / CONFIG_NAME).is_file():
        return f"; to load the Hugging Face folder that holds it, pass the folder {file.parent}"
    return ""


def _read_json(file: Path) -> Any:
    """A JSON file of an HF folder; ValueError naming the file if it is not JSON (a download cut short)."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file} is not valid JSON ({error}); a download cut short? fetch it again"
        ) from None


def _safe_open(file: Path) -> Any:
    """safe_open, with a ValueError naming the file for one that is not a whole safetensors file (a
    download cut short, an empty file) rather than safetensors' own error, which names none."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as error:
        raise ValueError(
            f"{file} is not a readable safetensors file ({error}); a download cut short? fetch it again"
        ) from None


class HFCheckpoint:
    """An HF checkpoint of one of the Llama-style families on disk, read lazily through safetensors
    (memory-mapped).

    `path` is a directory (config.json with model.safetensors or a sharded index) or a single
    .safetensors file, which then carries no config.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.path = path
        self.config: dict[str, Any] | None = None
        if path.is_file():
            if path.suffix != ".safetensors":
                pickle = path.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")
                raise ValueError(
                    f"{path}: only .safetensors weights can be loaded"
                    + (" (pickle files are unsafe)" if pickle else "")
                    + folder_hint(path)
                )
            files = {path}
            self._file_of = {name: path for name in self._keys(path)}
        elif path.is_dir():
            if (path / CONFIG_NAME).is_file():
                self.config = _read_json(path / CONFIG_NAME)
            if (path / INDEX_NAME).is_file():
                index = _read_json(path / INDEX_NAME)
                self._file_of = {name: path / file for name, file in index["weight_map"].items()}
                files = set(self._file_of.values())
            elif (path / WEIGHTS_NAME).is_file():
                files = {path / WEIGHTS_NAME}
                self._file_of = {name: path / WEIGHTS_NAME for name in self._keys(path / WEIGHTS_NAME)}
            else:
                pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
                hint = f" (found {', '.join(pickled)}: pickle formats are not loaded, convert to safetensors)"
                raise FileNotFoundError(
                    f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}" + (hint if pickled else "")
                )
        else:
            raise FileNotFoundError(f"{path}: no such file or directory{hub_id_hint(path)}")
        missing = sorted(str(f) for f in files if not f.is_file())
        if missing:
            raise FileNotFoundError(f"{path}: the index lists missing files: {', '.join(missing)}")
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _keys(file: Path) -> list[str]:
        with _safe_open(file) as f:
            return list(f.keys())

    def _open(self, name: str) -> Any:
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = _safe_open(file)
        return self._handles[file]

    def keys(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._open(name).get_tensor(name)

    def check(self, expected: dict[str, tuple[int, ...]], cfg: LlamaConfig) -> None:
        """Raise one ValueError listing every missing, unexpected or mis-shaped tensor for a model
        whose canonical tensors are `expected` (name → shape). For a tied model a stored
        lm_head.weight is not read, as transformers ignores it."""
        problems, wanted = [], {"lm_head.weight"} if cfg.tie_embeddings else set()
        for canonical, shape in expected.items():
            rows = hf_split_rows(canonical, cfg) or [shape[0]]
            for name, n_rows in zip(hf_names(canonical), rows, strict=True):
                wanted.add(name)
                want = (n_rows, *shape[1:])
                if name not in self._file_of:
                    problems.append(f"missing {name} (expected shape {list(want)})")
                elif self.shape(name) != want:
                    got = list(self.shape(name))
                    problems.append(f"{name} has shape {got}, the model expects {list(want)}")
        unexpected = sorted(k for k in self.keys() - wanted if not _IGNORED_HF_KEYS.fullmatch(k))
        if unexpected:
            problems.append(f"unexpected tensors {_head(unexpected, 8, ', ')}")
        if problems:
            raise ValueError(f"{self.path} does not fit the model: {_head(problems, 12, '; ')}")

    def canonical(self, canonical: str) -> torch.Tensor:
        """One canonical tensor, assembled from its HF parts (`check` first for clear errors)."""
        names = hf_names(canonical)
        parts = [self.get(name) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
