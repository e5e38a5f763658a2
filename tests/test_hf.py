"""Hugging Face interop against transformers.LlamaForCausalLM: export, import, config, errors."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_data_sources import word_tokenizer
from test_sft import chat_tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM, pipeline
from transformers import LlamaConfig as HFLlamaConfig

from codatrain.config import CheckpointConfig
from codatrain.data.tokenizer import load_tokenizer
from codatrain.model import Llama, get_preset
from codatrain.model.generate import generate
from codatrain.model.hf import INDEX_NAME, config_from_hf, config_to_hf, save_hf
from codatrain.train.checkpointer import Checkpointer
from codatrain.train.hf_io import export_checkpoint_to_hf, load_hf_weights, saved_architecture

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


def test_config_json_describes_a_plain_untied_llama_in_the_export_dtype():
    """Every key of the exported config.json: readers other than transformers (vLLM, llama.cpp's
    converter) take these as written rather than with transformers' defaults."""
    assert config_to_hf(CFG, torch.bfloat16) == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 301, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    }
    assert config_to_hf(CFG)["torch_dtype"] == "float32"


def test_config_round_trip_keeps_init_std_and_context_length():
    cfg = CFG.replace(init_std=0.01, max_seq_len=512)  # neither the defaults of ours nor of HF
    assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0},
    {"type": "dynamic", "factor": 2.0},
])
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])  # transformers 5, 4
def test_unsupported_rope_scaling_is_rejected(rope, spelling):
    hf_cfg = {k: v for k, v in config_to_hf(CFG).items() if k != "rope_parameters"} | {spelling: rope}
    with pytest.raises(ValueError, match="RoPE scaling type .* is not supported"):
        config_from_hf(hf_cfg)


def test_every_unsupported_setting_is_named_in_one_error():
    hf_cfg = config_to_hf(CFG) | {
        "rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "hidden_act": "gelu",
        "attention_bias": True, "mlp_bias": True, "architectures": ["LlamaForSequenceClassification"],
    }
    with pytest.raises(ValueError) as error:
        config_from_hf(hf_cfg)
    assert str(error.value) == (
        "unsupported Hugging Face llama config: architectures LlamaForSequenceClassification are not "
        "supported (model_type 'llama' loads as LlamaForCausalLM); RoPE scaling type 'yarn' is not "
        "supported (codatrain implements default, linear, llama3); hidden_act='gelu' is not supported "
        "(only 'silu'); attention_bias=true is not supported (codatrain's llama projections have no "
        "bias); mlp_bias=true is not supported (codatrain's llama projections have no bias)"
    )


def test_mlp_bias_alone_is_rejected():
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        config_from_hf(config_to_hf(CFG) | {"mlp_bias": True})


def test_a_head_dim_other_than_hidden_size_over_the_heads_is_the_models():
    """Without head_dim, head_dim is hidden_size // heads (130 // 4 = 32), as transformers reads it;
    an explicit one (Qwen3's, Mistral's) is taken as given."""
    without_head_dim = {k: v for k, v in config_to_hf(CFG).items() if k != "head_dim"}
    derived = config_from_hf(without_head_dim | {"hidden_size": 130})
    assert (derived.dim, derived.head_dim) == (130, 32)
    assert config_from_hf(config_to_hf(CFG) | {"head_dim": 64}).head_dim == 64


def test_model_type_outside_the_four_families_is_rejected_and_a_missing_one_is_llama():
    with pytest.raises(ValueError) as error:
        config_from_hf(config_to_hf(CFG) | {"model_type": "gemma"})
    assert str(error.value) == ("config.json has model_type='gemma'; codatrain loads 'llama', 'mistral', "
                                "'qwen2', 'qwen3' checkpoints")
    assert config_from_hf({k: v for k, v in config_to_hf(CFG).items() if k != "model_type"}) == CFG


def test_missing_required_keys_are_named():
    hf_cfg = {k: v for k, v in config_to_hf(CFG).items() if k not in ("vocab_size", "num_hidden_layers")}
    with pytest.raises(ValueError) as error:
        config_from_hf(hf_cfg)
    assert str(error.value) == "config.json lacks num_hidden_layers, vocab_size"


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
    imported = ours(seed=5)  # and codatrain reads the shards back through the index
    load_hf_weights(imported, tmp_path, CFG, print)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in imported.state_dict().items())


def test_shards_fill_up_to_exactly_the_limit_in_a_new_folder(tmp_path):
    """Tensors of 100 bytes under a 200-byte limit: two per shard; each file says it holds torch
    tensors (`format: pt`, which transformers checks); the folder and its parents are created."""
    out = tmp_path / "new" / "hf"
    save_hf(out, CFG, [(f"w{i}", torch.full((25,), float(i))) for i in range(5)], max_shard_bytes=200)
    index = json.loads((out / INDEX_NAME).read_text())
    shards = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index == {"metadata": {"total_size": 500}, "weight_map": {
        "model.w0": shards[0], "model.w1": shards[0], "model.w2": shards[1], "model.w3": shards[1],
        "model.w4": shards[2],
    }}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(torch.equal(f.get_tensor(k), torch.full((25,), float(k[-1]))) for k in f.keys())


def test_a_new_export_over_an_old_one_leaves_no_stale_files(tmp_path):
    """3 shards, then 2 (still with an index), then 1 file, then no tensors at all (an empty
    model.safetensors): only the newest export's files are left."""
    tensors = [(f"w{i}", torch.full((25,), float(i))) for i in range(5)]  # 100 bytes each
    for n_tensors, expected in ((5, 3), (4, 2), (2, 1), (0, 1)):
        save_hf(tmp_path, CFG, tensors[:n_tensors], max_shard_bytes=200)
        files = sorted(p.name for p in tmp_path.iterdir())
        if expected == 1:
            shards = ["model.safetensors"]
            assert files == ["config.json", *shards]
        else:
            shards = [f"model-{i:05d}-of-{expected:05d}.safetensors" for i in range(1, expected + 1)]
            assert files == sorted(["config.json", INDEX_NAME, *shards])
        with safe_open(tmp_path / shards[-1], framework="pt") as f:
            assert len(f.keys()) == n_tensors - 2 * (expected - 1)


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


def test_long_lists_of_problems_are_cut_with_a_count_of_the_rest(tmp_path):
    """At most 8 unexpected tensors and 12 problems are named, then how many more there are."""
    state = {k: v.contiguous() for k, v in random_hf_model().state_dict().items()}
    for n_extra, named in ((8, ""), (9, ", and 1 more")):
        file = tmp_path / f"extra_{n_extra}.safetensors"
        save_file(state | {f"model.extra_{i}": torch.zeros(1) for i in range(n_extra)}, file)
        with pytest.raises(ValueError) as error:
            load_hf_weights(ours(), file, CFG, print)
        extras = ", ".join(f"model.extra_{i}" for i in range(8))
        assert str(error.value) == f"{file} does not fit the model: unexpected tensors {extras}{named}"
    deeper = CFG.replace(n_layers=4)  # 2 layers of 9 tensors missing and the extras: 19 problems
    with pytest.raises(ValueError) as error:
        load_hf_weights(ours(deeper), tmp_path / "extra_8.safetensors", deeper, print)
    problems = str(error.value).split(": ", 1)[1].split("; ")
    assert len(problems) == 13 and problems[-1] == "and 7 more", problems
    assert all(p.startswith("missing model.layers.") for p in problems[:12])


def test_pickle_checkpoints_are_refused(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    torch.save({"w": torch.zeros(1)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(FileNotFoundError) as error:
        load_hf_weights(ours(), tmp_path, CFG, print)
    assert str(error.value) == (
        f"{tmp_path}: no model.safetensors or model.safetensors.index.json (found pytorch_model.bin, "
        "consolidated.00.pth: pickle formats are not loaded, convert to safetensors)"
    )
    with pytest.raises(ValueError, match="only .safetensors"):
        load_hf_weights(ours(), tmp_path / "pytorch_model.bin", CFG, print)


def test_a_file_of_an_hf_folder_given_for_the_folder_says_to_pass_the_folder(tmp_path):
    # checkpoint.init_from=<folder>/config.json was refused as if it were a pickle file.
    save_hf(tmp_path / "hf", CFG, ours().state_dict().items())
    with pytest.raises(ValueError) as error:
        load_hf_weights(ours(), tmp_path / "hf" / "config.json", CFG, print)
    assert str(error.value) == (
        f"{tmp_path / 'hf' / 'config.json'}: only .safetensors weights can be loaded; to load the Hugging "
        f"Face folder that holds it, pass the folder {tmp_path / 'hf'}"
    )
    with pytest.raises(ValueError) as error:  # model=hf from the weights file alone
        saved_architecture(tmp_path / "hf" / "model.safetensors")
    assert str(error.value) == (
        f"{tmp_path / 'hf' / 'model.safetensors'} has no config.json to take the architecture from; to load "
        f"the Hugging Face folder that holds it, pass the folder {tmp_path / 'hf'}"
    )
    assert saved_architecture(tmp_path / "hf") == CFG


def test_missing_weights_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_hf_weights(ours(), tmp_path / "nowhere", CFG, print)
    assert str(error.value) == f"{tmp_path / 'nowhere'}: no such file or directory"
    with pytest.raises(FileNotFoundError) as error:  # a folder without weights (and no pickle files)
        load_hf_weights(ours(), tmp_path, CFG, print)
    assert str(error.value) == f"{tmp_path}: no model.safetensors or model.safetensors.index.json"
    save_hf(tmp_path / "hf", CFG, ours().state_dict().items(), max_shard_bytes=200_000)
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    for shard in shards[1:]:
        shard.unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_hf_weights(ours(), tmp_path / "hf", CFG, print)
    assert str(error.value) == (
        f"{tmp_path / 'hf'}: the index lists missing files: {', '.join(str(s) for s in shards[1:])}"
    )


def test_a_truncated_or_malformed_file_of_a_folder_is_a_clear_error_naming_it(tmp_path):
    # An interrupted download: one error line naming the file, not safetensors' or json's own error
    # (which names none) as a traceback.
    save_hf(tmp_path / "hf", CFG, ours().state_dict().items(), max_shard_bytes=200_000)
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"^{re.escape(str(shard))} is not a readable safetensors file "):
        load_hf_weights(ours(), tmp_path / "hf", CFG, print)
    save_hf(tmp_path / "one", CFG, ours().state_dict().items())
    (tmp_path / "one" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'one' / 'model.safetensors'))} is not"):
        load_hf_weights(ours(), tmp_path / "one", CFG, print)
    for name in ("config.json", "model.safetensors.index.json"):
        folder = tmp_path / name
        save_hf(folder, CFG, ours().state_dict().items(), max_shard_bytes=200_000)
        (folder / name).write_text('{"hidden_size": 12')
        with pytest.raises(ValueError, match=f"^{re.escape(str(folder / name))} is not valid JSON "):
            load_hf_weights(ours(), folder, CFG, print)


def test_tied_checkpoints_are_checked_like_untied_ones(tmp_path):
    """Only lm_head.weight may be absent when the embeddings are tied: every other tensor is checked."""
    random_hf_model(tie=True).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        tied = CFG.replace(tie_embeddings=True)
        load_hf_weights(ours(tied), tmp_path, tied, print)
    assert str(error.value) == (
        f"{tmp_path} does not fit the model: missing model.layers.1.mlp.down_proj.weight "
        "(expected shape [128, 384])"
    )


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
    step_dir = ckpt.save(7, tokens_seen=7 * 512)

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
    for size in ("0", "0.1B", "abc"):
        with pytest.raises(SystemExit):  # argparse's usage error, before anything is written
            export_hf.main([str(step_dir), str(tmp_path / "zero"), "--max-shard-size", size])
    assert not (tmp_path / "zero").exists()


@pytest.mark.parametrize("kind", ["folder", "tokenizer.json", "byte"])
def test_an_export_names_the_tokenizers_delimiters_and_carries_a_hugging_face_tokenizer(tmp_path, kind):
    """config.json and generation_config.json name the run's BOS and EOS (transformers would assume 1
    and 2), and a Hugging Face tokenizer's files go along, so that AutoTokenizer and pipeline load the
    export as it is: offline and live exports alike."""
    if kind == "folder":
        chat_tokenizer(tmp_path / "tok")
        spec = str(tmp_path / "tok")
    elif kind == "tokenizer.json":  # a bare file names no delimiters; transformers gets them named
        word_tokenizer(["<s>", "</s>"])[0].save(str(tmp_path / "words.json"))
        spec = str(tmp_path / "words.json")
    else:
        spec = "byte"
    tokenizer = load_tokenizer(spec)
    assert (tokenizer.bos_id, tokenizer.eos_id) not in ((1, 2), (None, 2))
    model = ours().eval()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(CheckpointConfig(), tmp_path / "run", CFG, model, optimizer, scheduler, {}, print,
                        tokenizer=spec)
    export_checkpoint_to_hf(ckpt.save(1, tokens_seen=1 * 512), tmp_path / "hf")
    for out in (tmp_path / "hf", ckpt.export_hf(1)):
        delimiters = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        assert json.loads((out / "config.json").read_text()).items() >= delimiters.items()
        assert json.loads((out / "generation_config.json").read_text()) == delimiters
        generation = LlamaForCausalLM.from_pretrained(out).generation_config
        assert (generation.bos_token_id, generation.eos_token_id) == tuple(delimiters.values())
        if kind == "byte":  # no Hugging Face form
            assert not list(out.glob("tokenizer*"))
            continue
        auto = AutoTokenizer.from_pretrained(out)
        assert (auto.bos_token_id, auto.eos_token_id) == tuple(delimiters.values())
        prompt = "what is two plus"
        ids = tokenizer.encode_batch([prompt])[0].tolist()
        assert auto(prompt, add_special_tokens=False)["input_ids"] == ids
        expected = generate(model, torch.tensor([ids]), 6, eos_id=tokenizer.eos_id)[0].tolist()
        generated = pipeline("text-generation", model=str(out))(prompt, max_new_tokens=6, do_sample=False,
                                                                 return_tensors=True)
        assert generated[0]["generated_token_ids"] == expected
