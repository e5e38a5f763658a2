"""Hugging Face interop against transformers.LlamaForCausalLM: export, import, config, errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from codatrain.config import CheckpointConfig
from codatrain.model import Llama, get_preset
from codatrain.model.hf import INDEX_NAME, config_from_hf, config_to_hf, save_hf
from codatrain.train.checkpointer import Checkpointer
from codatrain.train.hf_io import load_hf_weights

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


def test_export_gives_transformers_the_same_logits(tmp_path):
    model = ours()
    save_hf(tmp_path, CFG, model.state_dict().items())
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / INDEX_NAME).exists()
    assert_same_logits(model, LlamaForCausalLM.from_pretrained(tmp_path).eval())


# 200 kB holds every tensor of CFG (the largest, gate_proj and up_proj, are 196,608 bytes); at 100 kB
# the embedding, lm_head and the MLP tensors are each larger than the limit.
@pytest.mark.parametrize("limit", [200_000, 100_000])
def test_sharded_export_keeps_shards_under_the_limit_and_indexes_them(tmp_path, limit):
    """Shard i of N is model-0000i-of-0000N.safetensors and holds at most `limit` bytes of tensors
    (a tensor larger than the limit gets a shard of its own); the index maps every tensor to its
    shard and its total_size is the sum of the tensor bytes; transformers loads the directory."""
    model = ours()
    save_hf(tmp_path, CFG, model.state_dict().items(), max_shard_bytes=limit)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    shard_of, total = {}, 0
    for file in files:
        with safe_open(tmp_path / file, framework="pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
            shard_of |= dict.fromkeys(f.keys(), file)
        assert sizes and (sum(sizes) <= limit or len(sizes) == 1), (file, sizes)
        total += sum(sizes)
    assert set(shard_of) == set(random_hf_model().state_dict())
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"] == shard_of
    assert index["metadata"]["total_size"] == total
    assert_same_logits(model, LlamaForCausalLM.from_pretrained(tmp_path).eval())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_of_transformers_weights_gives_the_same_logits(tmp_path, tie):
    cfg = CFG.replace(tie_embeddings=tie)
    hf = random_hf_model(tie)
    hf.save_pretrained(tmp_path)  # safetensors; a tied head is not stored
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tie)
    model = ours(cfg, seed=5)
    load_hf_weights(model, tmp_path, cfg, print)
    assert_same_logits(model, hf)
    if tie:  # a tied folder into an untied model: the architecture check names the key
        untied = r"tie_embeddings: True there, False here.*model\.tie_embeddings=True"
        with pytest.raises(ValueError, match=untied):
            load_hf_weights(ours(), tmp_path, CFG, print)


# Each feature of Llama 3.x folders; the pretraining context of 16 positions is shorter than TOKENS.
FEATURES = {
    "llama3-rope": CFG.replace(rope_type="llama3", rope_factor=4.0, rope_original_max_positions=16),
    "linear-rope": CFG.replace(rope_type="linear", rope_factor=2.0),
    "tied": CFG.replace(tie_embeddings=True),
    "llama3-rope-tied": CFG.replace(rope_type="llama3", rope_factor=32.0, rope_original_max_positions=16,
                                    tie_embeddings=True),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_export_of_each_llama3_feature_gives_transformers_the_same_logits(tmp_path, name):
    """RoPE scaling and a tied head survive the export: transformers' fp32 logits at positions past
    the pretraining context equal ours, a tied head stores no tensor, and the folder imports back."""
    cfg = FEATURES[name]
    model = ours(cfg)
    save_hf(tmp_path, cfg, model.state_dict().items())
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    assert hf.config.rope_parameters["rope_type"] == cfg.rope_type
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_embeddings)
    assert TOKENS.shape[1] > cfg.rope_original_max_positions or cfg.rope_type != "llama3"
    assert_same_logits(model, hf)
    back = ours(cfg, seed=5)
    load_hf_weights(back, tmp_path, cfg, print)
    assert_same_logits(back, hf)


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


# What an older or hand-written config.json may be reduced to: no bias flags, eps, RoPE θ, context
# length, KV heads, head_dim or initializer range.
MINIMAL_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": CFG.dim,
    "intermediate_size": CFG.ffn_dim, "num_hidden_layers": CFG.n_layers,
    "num_attention_heads": CFG.n_heads, "vocab_size": CFG.vocab_size,
}


def test_minimal_config_loads_with_the_defaults_of_transformers(tmp_path):
    ours_cfg, theirs = config_from_hf(MINIMAL_HF_CONFIG), HFLlamaConfig.from_dict(MINIMAL_HF_CONFIG)
    assert (ours_cfg.norm_eps, ours_cfg.rope_theta, ours_cfg.max_seq_len, ours_cfg.n_kv_heads) == (
        theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.max_position_embeddings,
        theirs.num_key_value_heads,
    )
    assert (ours_cfg.head_dim, ours_cfg.init_std) == (theirs.head_dim, theirs.initializer_range)
    # End to end: an export whose config.json is cut down to the minimum imports, and transformers,
    # filling in its own defaults, computes the same logits.
    save_hf(tmp_path, ours_cfg, ours(ours_cfg).state_dict().items())
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL_HF_CONFIG))
    model = ours(ours_cfg, seed=5)
    load_hf_weights(model, tmp_path, ours_cfg, print)
    assert_same_logits(model, LlamaForCausalLM.from_pretrained(tmp_path).eval())


def test_unexpected_tensors_are_named_and_rotary_buffers_ignored(tmp_path):
    hf = random_hf_model()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(16) for i in range(CFG.n_layers)}
    save_file(state | buffers, tmp_path / "with_rotary_buffers.safetensors")
    model = ours(seed=5)
    load_hf_weights(model, tmp_path / "with_rotary_buffers.safetensors", CFG, print)
    assert_same_logits(model, hf)

    extra = {"model.layers.0.self_attn.q_norm.weight": torch.ones(CFG.head_dim), "model.bias": torch.zeros(1)}
    save_file(state | extra, tmp_path / "with_extra_tensors.safetensors")
    model = ours(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    named = r"unexpected tensors model\.bias, model\.layers\.0\.self_attn\.q_norm\.weight"
    with pytest.raises(ValueError, match=named):
        load_hf_weights(model, tmp_path / "with_extra_tensors.safetensors", CFG, print)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


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
