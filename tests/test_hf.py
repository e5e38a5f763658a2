"""Hugging Face interop against transformers.LlamaForCausalLM: export, import, config, errors."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from codatrain.config import CheckpointConfig
from codatrain.model import Llama, get_preset
from codatrain.model.hf import INDEX_NAME, config_from_hf, config_to_hf, save_hf
from codatrain.train.checkpoint import Checkpointer, load_hf_weights

# GQA (4 query heads over 2 KV heads), odd vocab, rope θ and eps that differ from HF defaults.
CFG = get_preset("tiny").replace(n_layers=2, vocab_size=301, rope_theta=5000.0, norm_eps=1e-5)
TOKENS = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def ours(cfg=CFG, seed=0) -> Llama:
    model = Llama(cfg)
    model.init_weights(seed)
    return model


@torch.no_grad()
def assert_same_logits(model: Llama, hf: LlamaForCausalLM) -> None:
    expected = model(TOKENS)
    torch.testing.assert_close(hf(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def random_hf_model(tie: bool = False) -> LlamaForCausalLM:
    hf_cfg = config_to_hf(CFG)
    hf_cfg["tie_word_embeddings"] = tie
    torch.manual_seed(1)
    hf = LlamaForCausalLM(HFLlamaConfig.from_dict(hf_cfg)).eval()
    with torch.no_grad():  # HF zero-initialises nothing we need, but make the norms non-trivial
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return hf


def test_config_round_trip():
    hf_cfg = config_to_hf(CFG)
    assert config_from_hf(hf_cfg) == CFG
    loaded = HFLlamaConfig.from_dict(hf_cfg)
    assert loaded.rope_parameters["rope_theta"] == CFG.rope_theta
    assert (loaded.num_key_value_heads, loaded.rms_norm_eps, loaded.tie_word_embeddings) == (2, 1e-5, False)
    # The transformers 4 spelling reads the same.
    legacy = {k: v for k, v in hf_cfg.items() if k != "rope_parameters"} | {"rope_scaling": None}
    assert config_from_hf(legacy) == CFG


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0},
    {"type": "linear", "factor": 2.0},
])
def test_unsupported_rope_scaling_is_rejected(rope):
    hf_cfg = config_to_hf(CFG) | {"rope_parameters": rope}
    with pytest.raises(ValueError, match="RoPE scaling type .* is not supported"):
        config_from_hf(hf_cfg)


@pytest.mark.parametrize("max_shard_bytes", [10**9, 200_000], ids=["single-file", "sharded"])
def test_export_gives_transformers_the_same_logits(tmp_path, max_shard_bytes):
    model = ours()
    save_hf(tmp_path, CFG, model.state_dict().items(), max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_NAME).exists() == (max_shard_bytes < 10**9)
    assert_same_logits(model, LlamaForCausalLM.from_pretrained(tmp_path).eval())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_of_transformers_weights_gives_the_same_logits(tmp_path, tie):
    hf = random_hf_model(tie)
    hf.save_pretrained(tmp_path)  # safetensors; a tied head is not stored
    model = ours(seed=5)
    logs = []
    load_hf_weights(model, tmp_path, CFG, logs.append)
    assert_same_logits(model, hf)
    assert ("tied embeddings" in logs[0]) == tie


def test_import_of_a_bare_safetensors_file(tmp_path):
    hf = random_hf_model()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "weights.safetensors")
    model = ours(seed=5)
    load_hf_weights(model, tmp_path / "weights.safetensors", CFG, print)
    assert_same_logits(model, hf)


def test_mismatched_shapes_are_a_clear_error(tmp_path):
    save_hf(tmp_path, CFG, ours().state_dict().items())
    wider = CFG.replace(ffn_dim=512)
    # With config.json: the architecture differs, and the error says which override fixes it.
    with pytest.raises(ValueError, match=r"ffn_dim: 384 there, 512 here.*model\.ffn_dim=384"):
        load_hf_weights(ours(wider), tmp_path, wider, print)
    # A bare weights file carries no config: every mis-shaped tensor is listed.
    mis_shaped = r"gate_proj.weight has shape \[384, 128\], the model expects \[512, 128\]"
    with pytest.raises(ValueError, match=mis_shaped):
        load_hf_weights(ours(wider), tmp_path / "model.safetensors", wider, print)
    deeper = CFG.replace(n_layers=3)
    with pytest.raises(ValueError, match=r"missing model\.layers\.2\.self_attn\.q_proj\.weight"):
        load_hf_weights(ours(deeper), tmp_path / "model.safetensors", deeper, print)


def test_pickle_checkpoints_are_refused(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle formats are not loaded"):
        load_hf_weights(ours(), tmp_path, CFG, print)
    with pytest.raises(ValueError, match="only .safetensors"):
        load_hf_weights(ours(), tmp_path / "pytorch_model.bin", CFG, print)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    save_hf(tmp_path, CFG, ours().state_dict().items())
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg | {"hidden_act": "gelu", "attention_bias": True}))
    with pytest.raises(ValueError, match="hidden_act='gelu'.*attention_bias=true"):
        load_hf_weights(ours(), tmp_path, CFG, print)


def test_export_script_turns_a_training_checkpoint_into_a_transformers_model(tmp_path):
    import importlib.util
    from pathlib import Path

    model = ours()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(CheckpointConfig(), tmp_path / "run", CFG, model, optimizer, scheduler, {}, print)
    step_dir = ckpt.save(7)

    script = Path(__file__).resolve().parent.parent / "scripts" / "export_hf.py"
    spec = importlib.util.spec_from_file_location("export_hf", script)
    export_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_hf)
    assert export_hf.main([str(step_dir), str(tmp_path / "hf"), "--max-shard-size", "300KB"]) == 0
    assert (tmp_path / "hf" / INDEX_NAME).exists()
    assert_same_logits(model, LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval())

    assert export_hf.main([str(step_dir), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert LlamaForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert export_hf.main([str(tmp_path / "run"), str(tmp_path / "x")]) == 1  # not a checkpoint
