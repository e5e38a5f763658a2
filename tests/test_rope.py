"""RoPE scaling (default, linear, llama3): the rates of `rope_inv_freq` and the eager model's cos/sin
against transformers' rotary embedding in fp64, at positions past the pretraining context; the
config checks; config.json in and out."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from codatrain.kernels.stages import RopeType, rope_inv_freq
from codatrain.model.config import LlamaConfig
from codatrain.model.hf import config_from_hf, config_to_hf
from codatrain.model.llama import rope_cos_sin

BASE = LlamaConfig(dim=512, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=32, max_seq_len=65536)
CONTEXT = 8192
ROPES = {
    "default": BASE,
    "linear": BASE.replace(rope_type="linear", rope_factor=4.0),
    # Llama 3.2's scaling; head dim 128 and θ = 500000 put rates in all three bands (checked below).
    "llama3": BASE.replace(rope_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                           rope_high_freq_factor=4.0, rope_original_max_positions=CONTEXT),
}
POSITIONS = torch.tensor([0, 1, 77, 2047, CONTEXT - 1, CONTEXT, 3 * CONTEXT + 5, 65535])


def transformers_rope_fp64(cfg: LlamaConfig, monkeypatch) -> LlamaRotaryEmbedding:
    """transformers' rotary embedding for our exported config.json, built and run in fp64: its
    rate functions and forward cast with `torch.float`, which is made fp64 here."""
    hf_cfg = HFLlamaConfig.from_dict(config_to_hf(cfg))
    monkeypatch.setattr(torch, "float", torch.float64)
    return LlamaRotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("name", list(ROPES))
def test_rates_and_cos_sin_equal_transformers_in_fp64(name, monkeypatch):
    cfg = ROPES[name]
    hf = transformers_rope_fp64(cfg, monkeypatch)
    assert hf.rope_type == name and hf.attention_scaling == 1.0
    ours = rope_inv_freq(cfg.head_dim, cfg.rope)
    assert hf.inv_freq.dtype == torch.float64
    torch.testing.assert_close(ours, hf.inv_freq, rtol=1e-14, atol=0)
    x = torch.zeros(1, dtype=torch.float64)
    hf_cos, hf_sin = hf(x, POSITIONS[None])
    cos, sin = rope_cos_sin(POSITIONS, cfg.head_dim, cfg.rope, torch.float64)
    # Angles reach 6.6e4 rad: fp64 rounding of the angle itself is ~1e-11.
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-10)
    default = rope_inv_freq(cfg.head_dim, BASE.rope)
    if name == "llama3":  # kept, slowed by the factor, and blended: each band is tested
        ratio = default / ours
        kept, slowed = ratio == 1, (ratio - 32).abs() < 1e-9
        assert kept.any() and slowed.any() and (~kept & ~slowed).any()
    else:
        torch.testing.assert_close(default / ours, torch.full_like(ours, cfg.rope_factor))


@pytest.mark.parametrize("override, message", [
    ({"rope_type": "yarn"}, r"model\.rope_type='yarn' is not one of default, linear, llama3"),
    ({"rope_factor": 8.0}, r"model\.rope_factor=8\.0 has no effect with model\.rope_type=default"),
    ({"rope_type": "linear", "rope_original_max_positions": 4096},
     r"model\.rope_original_max_positions=4096 has no effect with model\.rope_type=linear"),
    ({"rope_type": "linear", "rope_factor": 0.5}, r"model\.rope_factor must be at least 1"),
    ({"rope_type": "llama3", "rope_low_freq_factor": 4.0},
     r"0 < model\.rope_low_freq_factor < model\.rope_high_freq_factor"),
    ({"rope_theta": 0.0}, r"model\.rope_theta must be positive"),
])
def test_bad_rope_settings_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        BASE.replace(**override)


@pytest.mark.parametrize("name", list(ROPES))
def test_config_json_round_trip_in_both_spellings(name):
    cfg = ROPES[name]
    hf_cfg = config_to_hf(cfg)
    assert config_from_hf(hf_cfg) == cfg
    for spelling in ("rope_scaling", "rope_parameters"):  # transformers 5's, then transformers 4's
        assert config_from_hf({k: v for k, v in hf_cfg.items() if k != spelling}) == cfg
    assert HFLlamaConfig.from_dict(hf_cfg).rope_parameters == hf_cfg["rope_parameters"]


def test_transformers_4_llama3_config_reads_and_unsupported_types_are_named():
    legacy = config_to_hf(BASE) | {"rope_parameters": None, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    cfg = config_from_hf(legacy)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == (RopeType.llama3, 8.0, 8192)
    without_context = legacy | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0}}
    assert config_from_hf(without_context).rope_original_max_positions == BASE.max_seq_len  # as transformers
    for rope, message in [
        ({"rope_type": "yarn", "factor": 4.0}, "RoPE scaling type 'yarn' is not supported"),
        ({"rope_type": "linear"}, "rope_parameters of type 'linear' lack factor"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5},
         "partial_rotary_factor=0.5 is not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            config_from_hf(config_to_hf(BASE) | {"rope_scaling": None, "rope_parameters": rope})
