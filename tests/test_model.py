import pytest
import torch

from codatrain.model import Llama, get_preset
from codatrain.model.config import LlamaConfig
from codatrain.model.llama import IGNORE_INDEX, RMSNorm


def small_model(dtype=torch.float32, **overrides) -> Llama:
    cfg = get_preset("tiny").replace(**overrides)
    model = Llama(cfg).to(dtype)
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_shapes_and_dtypes(dtype):
    model = small_model(dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24))
    logits = model(tokens)
    assert logits.shape == (2, 24, model.cfg.vocab_size)
    assert logits.dtype == dtype
    loss = model(tokens, tokens)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.shape == param.shape and param.grad.dtype == dtype, name
        assert torch.isfinite(param.grad).all(), name


def test_initial_loss_is_near_uniform():
    model = small_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 64))
    loss = model(tokens, tokens).item()
    assert abs(loss - torch.log(torch.tensor(model.cfg.vocab_size)).item()) < 0.1


def test_ignore_index_targets_do_not_count():
    model = small_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    targets = tokens.clone()
    targets[:, 8:] = IGNORE_INDEX
    logits = model(tokens)[:, :8]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, :8].flatten())
    torch.testing.assert_close(model(tokens, targets), expected)


def test_causal():
    model = small_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 20))
    changed = tokens.clone()
    changed[0, 15] = (changed[0, 15] + 1) % model.cfg.vocab_size
    torch.testing.assert_close(model(tokens)[:, :15], model(changed)[:, :15])
    assert not torch.allclose(model(tokens)[:, 15:], model(changed)[:, 15:])


def test_init_is_seeded_and_llama_style():
    a, b, c = small_model(), small_model(), Llama(get_preset("tiny"))
    c.init_weights(seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
    std = a.layers[0].mlp.gate_up_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert a.layers[0].mlp.down_proj.weight.std().item() < 0.5 * std  # scaled by 1/sqrt(2·layers)


def test_sequence_longer_than_model_is_an_error():
    model = small_model(max_seq_len=16)
    with pytest.raises(ValueError, match="sequence length 17 exceeds model.max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rms_norm_of_bf16_takes_its_statistics_in_fp32_and_scales_in_bf16():
    norm = RMSNorm(256, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 256))
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).mul(3).to(torch.bfloat16)
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_a_new_model_is_initialised_with_seed_0_unless_built_on_meta(monkeypatch):
    """On the meta device the trainer initialises after sharding: the constructor must not draw the
    (possibly billions of) initial values on the CPU."""
    seeds = []
    monkeypatch.setattr(Llama, "init_weights", lambda self, seed: seeds.append(seed))
    with torch.device("meta"):
        Llama(get_preset("tiny"))
    assert seeds == []
    Llama(get_preset("tiny"))
    assert seeds == [0]


def test_param_and_flop_counts_by_hand():
    cfg = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100)
    # per layer: qkv 64×(4+2+2)·16 = 8192, out 64·64 = 4096, mlp 3·64·96 = 18432 → 30720
    assert cfg.matmul_params() == 3 * 30720 + 64 * 100
    assert cfg.num_params() == 3 * 30720 + 64 * 100 + 100 * 64 + 7 * 64
    assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.num_params()
    # 6·N_matmul + 12·L·h_q·d_h·T at T = 32
    assert cfg.flops_per_token(32) == 6 * (3 * 30720 + 6400) + 12 * 3 * 4 * 16 * 32
    # Tied: the shared matrix is one parameter, and the head GEMM still counts in the FLOPs.
    tied = cfg.replace(tie_embeddings=True)
    assert tied.num_params() == cfg.num_params() - 100 * 64
    assert sum(p.numel() for p in Llama(tied).parameters()) == tied.num_params()
    assert tied.flops_per_token(32) == cfg.flops_per_token(32)


@pytest.mark.parametrize("preset, published", [
    ("llama3_2_1b", 1_235_814_400), ("llama3_2_3b", 3_212_749_824), ("llama3_1_8b", 8_030_261_248),
])
def test_llama3_x_presets_have_the_published_parameter_counts_and_config(preset, published):
    """The counts of the Hugging Face checkpoints meta-llama/Llama-3.2-1B, -3.2-3B and -3.1-8B, and
    their config.json's architecture keys (as transformers' LlamaConfig holds them)."""
    from transformers import LlamaConfig as HFLlamaConfig

    from codatrain.model.hf import config_to_hf

    cfg = get_preset(preset)
    assert cfg.num_params() == published
    hf = HFLlamaConfig.from_dict(config_to_hf(cfg))
    factor = 8.0 if preset == "llama3_1_8b" else 32.0
    assert hf.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    assert hf.tie_word_embeddings == (preset != "llama3_1_8b")
    assert (hf.max_position_embeddings, hf.rms_norm_eps, hf.vocab_size) == (131072, 1e-5, 128256)


def test_llama3_8b_flops_match_published_shape():
    cfg = get_preset("llama3_8b")
    assert round(cfg.num_params() / 1e9, 2) == 8.03
    # 6·N_matmul ≈ 6 × 7.50e9; attention term 12·32·32·128·8192
    assert cfg.flops_per_token(8192) == 6 * cfg.matmul_params() + 12 * 32 * 32 * 128 * 8192


@pytest.mark.parametrize("field,value,match", [
    ("n_heads", 5, "divisible"), ("n_kv_heads", 3, "divisible"), ("dim", -4, "positive"),
])
def test_bad_model_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        get_preset("tiny").replace(**{field: value})
