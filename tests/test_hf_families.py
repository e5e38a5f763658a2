"""The Llama-style families beyond Llama (Qwen2/2.5, Mistral, Qwen3) against transformers: random
tiny models saved by transformers import with the same fp32 logits, export keeps the family's
model_type (AutoModelForCausalLM loads it as that family), and config.json is read or refused by name."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from codatrain.config import load_config, validate
from codatrain.kernels.attention import sdpa_attention
from codatrain.kernels.resolve import QKNORM_HEAD_DIMS, ResolvedBlock
from codatrain.kernels.stages import get_backend
from codatrain.model import Llama
from codatrain.model.coda import CodaLlama
from codatrain.model.config import LlamaConfig, get_preset
from codatrain.model.hf import config_from_hf, config_to_hf, save_hf
from codatrain.train.hf_io import load_hf_weights, saved_architecture
from codatrain.train.plan import build_run_plan

# Tiny transformers configs: GQA, θ, eps and a context that differ from the defaults.
SHARED = {"vocab_size": 211, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}
HF_CONFIGS = {
    "qwen2": {"model_type": "qwen2", **SHARED},
    "qwen2-tied": {"model_type": "qwen2", **SHARED, "tie_word_embeddings": True},
    # A window no shorter than the context never binds: plain causal attention.
    "mistral": {"model_type": "mistral", **SHARED, "sliding_window": 256},
    # Heads wider than hidden_size / heads (as Mistral Nemo's), no window at all.
    "mistral-head-dim": {"model_type": "mistral", **SHARED, "head_dim": 24, "sliding_window": None},
    # QK-norm over heads wider than hidden_size / heads, the head tied (as the small Qwen3s).
    "qwen3-tied": {"model_type": "qwen3", **SHARED, "head_dim": 24, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **SHARED, "head_dim": 16},
}
TOKENS = torch.randint(0, SHARED["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(0))


def transformers_model(name: str) -> torch.nn.Module:
    """A random transformers model of the family, its norms and biases far from their init (1, 0)."""
    hf_cfg = dict(HF_CONFIGS[name])
    config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            elif param_name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model


@torch.no_grad()
def assert_same_logits(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_a_transformers_folder_imports_with_its_logits_and_exports_as_its_family(tmp_path, name):
    theirs = transformers_model(name)
    theirs.save_pretrained(tmp_path / "theirs")
    cfg = saved_architecture(tmp_path / "theirs")
    assert cfg.family == theirs.config.model_type
    ours = Llama(cfg)
    load_hf_weights(ours, tmp_path / "theirs", cfg, print)
    assert_same_logits(ours, theirs)
    # The reference CODA model computes the same function from the same canonical state.
    coda = CodaLlama(cfg)
    load_hf_weights(coda, tmp_path / "theirs", cfg, print)
    with torch.no_grad():
        torch.testing.assert_close(coda(TOKENS), ours(TOKENS), rtol=1e-5, atol=1e-5)

    save_hf(tmp_path / "ours", cfg, ours.state_dict().items())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(exported) is type(theirs)
    assert exported.config.tie_word_embeddings == cfg.tie_embeddings
    assert_same_logits(ours, exported)
    assert saved_architecture(tmp_path / "ours") == cfg


@pytest.mark.parametrize("preset, parameters", [
    # The published parameter counts (tied heads counted once).
    ("qwen2_5_0_5b", 494_032_768), ("qwen2_5_7b", 7_615_616_512), ("mistral_7b", 7_248_023_552),
    ("qwen3_0_6b", 596_049_920), ("qwen3_8b", 8_190_735_360),
])
def test_presets_have_the_published_architectures(preset, parameters):
    cfg = get_preset(preset)
    assert cfg.num_params() == parameters
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_a_family_fixes_its_attention_features():
    with pytest.raises(ValueError, match=r"^model.qkv_bias=False does not fit model.family=qwen2, whose "
                                         r"checkpoints have qkv_bias=True$"):
        LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, family="qwen2")
    unknown = r"^model.family='gemma' is not one of llama, mistral, qwen2, qwen3$"
    with pytest.raises(ValueError, match=unknown):
        LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, family="gemma")


def test_qwen2_sliding_window_is_refused_by_name():
    hf_cfg = config_to_hf(get_preset("qwen2_5_0_5b")) | {"use_sliding_window": True, "sliding_window": 4096}
    with pytest.raises(ValueError, match=r"^unsupported Hugging Face qwen2 config: use_sliding_window=true: "
                                         r"sliding-window attention is not supported$"):
        config_from_hf(hf_cfg)


@pytest.mark.parametrize("window", [4096, "absent"])  # absent: MistralConfig's default, 4096
def test_mistral_sliding_window_is_refused_by_name(window):
    hf_cfg = config_to_hf(get_preset("mistral_7b")) | {"sliding_window": window}
    if window == "absent":
        del hf_cfg["sliding_window"]
    with pytest.raises(ValueError, match=r"^unsupported Hugging Face mistral config: sliding_window=4096 < "
                                         r"max_position_embeddings=32768: sliding-window attention is not "
                                         r"supported \(Mistral v0.1 uses it\)$"):
        config_from_hf(hf_cfg)


def test_cute_stages_take_a_qk_norm_and_a_qkv_bias_and_refuse_a_qk_norm_head_dim_by_name():
    """block.backend=cute runs Qwen3's QK-norm and Qwen2's QKV bias as epilogues of its QKV GEMM;
    a QK-norm over heads its epilogue cannot tile is named when the model is built (on the meta
    device, as the trainer builds it)."""
    cute = ResolvedBlock("coda", "cute", "sdpa", get_backend("reference"), sdpa_attention)
    qwen3 = get_preset("qwen3_0_6b").replace(n_layers=1)
    refusal = (r"^model.head_dim=96 does not run with model.qk_norm=true on block.backend=cute, whose "
               r"QK-norm epilogue takes head dims 32, 64, 128; use block.backend=reference$")
    with torch.device("meta"):
        CodaLlama(qwen3, cute)
        CodaLlama(get_preset("qwen2_5_0_5b").replace(n_layers=1), cute)
        with pytest.raises(ValueError, match=refusal):
            CodaLlama(qwen3.replace(head_dim=96), cute)


def test_a_qwen3_config_without_head_dim_has_transformers_default_of_128():
    exported = config_to_hf(get_preset("qwen3_0_6b").replace(dim=512))  # 512 / 16 heads = 32
    hf_cfg = {k: v for k, v in exported.items() if k != "head_dim"}
    assert config_from_hf(hf_cfg).head_dim == 128


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3-tied", "mistral-head-dim"])
def test_model_hf_plans_a_family_folder_and_the_cute_stages_refuse_a_qk_norm_head_dim_by_name(tmp_path, name):
    """model=hf takes the family's architecture from config.json when the run is planned; the plan
    for the cute stages (scripts/precompile.py's, no device) takes every family's epilogues and
    names a QK-norm head dim they do not run (the tiny folders' 16 and 24)."""
    theirs = transformers_model(name)
    theirs.save_pretrained(tmp_path)
    folder = ["model=hf", f"checkpoint.init_from={tmp_path}", "block=coda", "block.attention=sdpa"]
    planned = build_run_plan(validate(load_config([*folder, "block.backend=reference"])), None)
    assert planned.model_cfg == saved_architecture(tmp_path)
    assert planned.model_cfg.family == theirs.config.model_type
    cute = validate(load_config([*folder, "block.backend=cute"]))
    head_dim = planned.model_cfg.head_dim
    if planned.model_cfg.qk_norm and head_dim not in QKNORM_HEAD_DIMS:
        refusal = rf"^model.head_dim={head_dim} does not run with model.qk_norm=true on block.backend=cute"
        with pytest.raises(ValueError, match=refusal):
            build_run_plan(cute, None)
    else:
        assert build_run_plan(cute, None).block.backend == "cute"


def test_a_head_dim_of_dim_over_heads_follows_a_new_dim_and_an_explicit_one_stays():
    assert get_preset("tiny").replace(dim=256).head_dim == 256 // 4
    assert get_preset("qwen3_0_6b").replace(dim=512).head_dim == 128
    assert get_preset("tiny").replace(dim=256, head_dim=48).head_dim == 48
