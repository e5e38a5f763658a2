"""`model=hf checkpoint.init_from=<folder>`: the architecture from the folder (an HF config.json or a
codatrain checkpoint's manifest), contradicting overrides named, and the folder's tokenizer as the
default data.tokenizer."""

import json
import re
import shutil

import pytest
import torch
from test_generate import load_script, save_word_tokenizer
from test_sft import chat_tokenizer

from codatrain.config import load_config, validate
from codatrain.data.tokenizer import load_tokenizer
from codatrain.model import Llama, LlamaConfig
from codatrain.model.generate import generate
from codatrain.model.hf import save_hf
from codatrain.train.checkpoint import CheckpointError, inspect_checkpoint
from codatrain.train.distributed import init_distributed
from codatrain.train.hf_io import run_tokenizer
from codatrain.train.trainer import Trainer, train

# A Llama 3.2-like folder in miniature: llama3 RoPE, tied head, eps and θ unlike our defaults.
FOLDER_CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300,
                         rope_theta=20000.0, rope_type="llama3", rope_factor=32.0,
                         rope_original_max_positions=16, tie_embeddings=True, norm_eps=1e-6, max_seq_len=256)
FAST = ["train.val_every=0", "train.progress=false", "data=synthetic", "data.num_workers=0",
        "data.seq_len=32", "train.micro_batch_size=2", "train.steps=1"]


def hf_folder(path, cfg=FOLDER_CFG):
    model = Llama(cfg)
    model.init_weights(seed=3)
    save_hf(path, cfg, model.state_dict().items())
    return model


def trainer(tmp_path, *overrides) -> Trainer:
    cfg = load_config([*FAST, f"train.run_dir={tmp_path / 'run'}", *overrides])
    return Trainer(validate(cfg), init_distributed("cpu"))


def test_the_architecture_and_weights_come_from_an_hf_folder_or_a_checkpoint(tmp_path):
    source = hf_folder(tmp_path / "hf")
    # Non-architecture fields may be set; an architecture field equal to the folder's too.
    run = trainer(tmp_path, "model=hf", f"checkpoint.init_from={tmp_path / 'hf'}", "model.max_seq_len=128",
                  "model.rope_factor=32")
    assert run.model_cfg == FOLDER_CFG.replace(max_seq_len=128, init_std=FOLDER_CFG.init_std)
    assert run.flops_per_token == FOLDER_CFG.flops_per_token(32)
    for name, param in run.model.named_parameters():
        assert torch.equal(param.full_tensor(), source.state_dict()[name]), name
    run.checkpointer.save(1, tokens_seen=1 * 512)
    run.close()
    checkpoint = tmp_path / "run/checkpoints/step_1"
    again = trainer(tmp_path / "again", "model=hf", f"checkpoint.init_from={checkpoint}")
    assert again.model_cfg == run.model_cfg
    again.close()


def test_a_preset_unlike_the_weights_names_the_overrides_and_model_hf(tmp_path):
    hf_folder(tmp_path / "hf")
    message = (rf"^init_from={re.escape(str(tmp_path / 'hf'))} holds a different model \(dim: 64 there, 128 "
               r"here, .*; to match it, set model\.dim=64 .*, or model=hf, which takes the architecture from "
               r"checkpoint\.init_from$")
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path, f"checkpoint.init_from={tmp_path / 'hf'}")


@pytest.mark.parametrize("override, message", [
    ("model.dim=128", r"model\.dim=128 contradicts checkpoint\.init_from=\S+, whose architecture has dim=64"),
    ("model.tie_embeddings=false", r"model\.tie_embeddings=False contradicts .* tie_embeddings=True"),
    ("model.rope_type=default", r"model\.rope_type=default contradicts .* rope_type=llama3"),
])
def test_an_override_that_contradicts_the_folder_names_the_key(tmp_path, override, message):
    hf_folder(tmp_path / "hf")
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path, "model=hf", f"checkpoint.init_from={tmp_path / 'hf'}", override)


def test_model_hf_needs_a_folder_with_a_config(tmp_path):
    with pytest.raises(ValueError, match=r"model=hf takes the architecture .* set checkpoint\.init_from="):
        trainer(tmp_path, "model=hf")
    hf_folder(tmp_path / "hf")
    bare = tmp_path / "hf/model.safetensors"
    with pytest.raises(ValueError, match=r"model\.safetensors has no config\.json"):
        trainer(tmp_path, "model=hf", f"checkpoint.init_from={bare}")


def test_the_folders_tokenizer_is_the_default_and_a_vocabulary_that_does_not_fit_is_an_error(tmp_path):
    hf_folder(tmp_path / "hf")
    with_tokenizer = tmp_path / "hf"
    save_word_tokenizer(with_tokenizer)
    run = validate(load_config(["model=hf", f"checkpoint.init_from={with_tokenizer}"]))
    assert run.data.tokenizer is None and run_tokenizer(run)[0] == str(with_tokenizer)
    chosen = validate(load_config(["model=hf", f"checkpoint.init_from={with_tokenizer}",
                                   "data.tokenizer=byte"]))
    assert run_tokenizer(chosen)[0] == "byte"
    assert run_tokenizer(validate(load_config([])))[0] == "byte"  # no folder: bytes

    small = tmp_path / "small"  # 3 token ids in the model, 4 in the folder's tokenizer
    hf_folder(small, LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=3))
    save_word_tokenizer(small)
    (tmp_path / "text.txt").write_text("hello world\n" * 50)
    too_many = rf"data\.tokenizer={small} has 4 token ids, more than model\.vocab_size=3"
    with pytest.raises(ValueError, match=too_many):
        trainer(tmp_path, "model=hf", f"checkpoint.init_from={small}", "data=files",
                f"data.path={tmp_path / 'text.txt'}", f"data.cache_dir={tmp_path / 'cache'}")


def test_a_broken_tokenizer_of_the_folder_is_named_by_init_from(tmp_path):
    hf_folder(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")  # no tokenizer.json beside it
    run = validate(load_config(["model=hf", f"checkpoint.init_from={tmp_path / 'hf'}"]))
    named = rf"\(checkpoint\.init_from={re.escape(str(tmp_path))}/hf\) cannot be loaded by transformers "
    with pytest.raises(ValueError, match=named + ".*needs tokenizer.json beside"):
        run_tokenizer(run)


def test_a_checkpoint_keeps_its_tokenizer_for_init_from_and_generate(tmp_path, capsys):
    """Continued pretraining from an HF folder with a tokenizer, then SFT and generation from that
    run's checkpoint: both use the folder's tokenizer (its chat template too), which the checkpoint
    carries, unless data.tokenizer / --tokenizer names another; the header says which is in force."""
    hf_folder(tmp_path / "hf")
    words = chat_tokenizer(tmp_path / "hf")
    (tmp_path / "text.txt").write_text("what is two plus two\n" * 50)
    train(load_config([*FAST, "model=hf", f"checkpoint.init_from={tmp_path / 'hf'}", "data=files",
                       f"data.path={tmp_path / 'text.txt'}", f"data.cache_dir={tmp_path / 'cache'}",
                       "data.val_fraction=0", "train.tokens_per_step=64",
                       f"train.run_dir={tmp_path / 'cpt'}"]))
    checkpoint = tmp_path / "cpt/checkpoints/step_1"
    manifest = inspect_checkpoint(checkpoint)  # the tokenizer's files are checksummed with the rest
    assert manifest["tokenizer"] == {"source": str(tmp_path / "hf"), "folder": "tokenizer",
                                     "fingerprint": load_tokenizer(str(tmp_path / "hf")).fingerprint}
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
            "tokenizer/chat_template.jinja"} <= manifest["files"].keys()
    shutil.rmtree(tmp_path / "hf")  # the checkpoint needs the folder no more

    records = [{"prompt": "what is two plus two", "response": "four"}] * 20
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sft = ["model=hf", f"checkpoint.init_from={checkpoint}", "data=sft",
           f"data.path={tmp_path / 'sft.jsonl'}", "data.val_fraction=0"]
    run = trainer(tmp_path / "sft", *sft)
    assert run.plan.tokenizer_line == (f"tokenizer: {checkpoint / 'tokenizer'} (the one checkpoint.init_from="
                                       f"{checkpoint} was trained with)")
    assert "the tokenizer's chat template" in run.train_data.report
    run.close()
    run = trainer(tmp_path / "sft-bytes", *sft, "data.tokenizer=byte", "data.seq_len=128")
    assert run.plan.tokenizer_line == (f"tokenizer: byte (data.tokenizer), not {checkpoint / 'tokenizer'}, "
                                       f"which checkpoint.init_from={checkpoint} was trained with")
    run.close()

    capsys.readouterr()
    assert load_script().main([str(checkpoint), "--prompt", "what is", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert f"tokenizer: {checkpoint / 'tokenizer'}" in err
    model = load_script().load_model(str(checkpoint), "cpu")
    kept = load_tokenizer(str(checkpoint / "tokenizer"))
    prompt = [kept.bos_id, *kept.encode_batch(["what is"])[0].tolist()]
    assert [words[i] for i in prompt] == ["<s>", "what", "is"]
    tokens = generate(model, torch.tensor([prompt]), 3, eos_id=kept.eos_id)
    assert out == kept.decode(tokens[0].tolist()) + "\n"


def test_resuming_with_another_tokenizer_is_refused(tmp_path):
    save_word_tokenizer(tmp_path)
    options = [*FAST, "train.tokens_per_step=64", f"train.run_dir={tmp_path / 'run'}"]
    train(load_config(options))
    with pytest.raises(CheckpointError) as error:
        trainer(tmp_path, f"data.tokenizer={tmp_path / 'tokenizer.json'}", "train.steps=2")
    assert str(error.value) == (
        f"{tmp_path / 'run/checkpoints/step_1'} was trained with the tokenizer byte, this run's is "
        f"{tmp_path / 'tokenizer.json'}: resume with the same data.tokenizer, or start a new run from its "
        "weights (checkpoint.init_from) with another train.run_dir")
    trainer(tmp_path, "data.tokenizer=byte", "train.steps=2").close()  # the same one, named


def test_a_hub_id_where_a_folder_is_wanted_says_how_to_get_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hint = (r" \(a Hugging Face Hub id\? codatrain reads local folders: download it first, `hf download "
            r"meta-llama/Llama-3\.2-1B --local-dir <folder>`, and pass the folder\)$")
    missing = r"^meta-llama/Llama-3\.2-1B: no such file or directory"
    with pytest.raises(FileNotFoundError, match=missing + hint):
        trainer(tmp_path, "model=hf", "checkpoint.init_from=meta-llama/Llama-3.2-1B")
    with pytest.raises(FileNotFoundError, match=r"^tokenizer 'meta-llama/Llama-3\.2-1B' \(data\.tokenizer\) "
                                                r"does not exist" + hint):
        load_tokenizer("meta-llama/Llama-3.2-1B")
    with pytest.raises(FileNotFoundError, match=r"^tokenizer 'llama3' \(data\.tokenizer\) does not exist$"):
        load_tokenizer("llama3")
