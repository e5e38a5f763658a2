"""Exports of a training checkpoint as HF Llama (train/hf_io.py): the groups a checkpoint is read
in, the dtype kept, no tokenizer, and where an export may go."""

import json

import pytest
import torch
from safetensors import safe_open

from codatrain.config import CheckpointConfig
from codatrain.data.tokenizer import TOKENIZER_FILES, folder_tokenizer
from codatrain.model import Llama, get_preset
from codatrain.train import hf_io
from codatrain.train.checkpoint import CheckpointError, inspect_checkpoint
from codatrain.train.checkpointer import Checkpointer

CFG = get_preset("tiny").replace(n_layers=1, vocab_size=96)


def saved_checkpoint(run_dir, dtype=torch.float32):
    model = Llama(CFG).to(dtype)
    model.init_weights(seed=2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(CheckpointConfig(), run_dir, CFG, model, optimizer, scheduler, {}, print)
    return model, ckpt.save(1, tokens_seen=1 * 512)


@pytest.mark.parametrize("group_bytes", [1, 40_000, 1 << 30])
def test_a_checkpoint_is_read_in_groups_of_at_least_group_bytes(tmp_path, monkeypatch, group_bytes):
    model, step_1 = saved_checkpoint(tmp_path)
    groups = []
    read = hf_io.dcp_load

    def recording_load(tensors, path, manifest):
        groups.append([t.numel() * t.element_size() for t in tensors.values()])
        read(tensors, path, manifest)

    monkeypatch.setattr(hf_io, "dcp_load", recording_load)
    tensors = dict(hf_io._checkpoint_model_tensors(step_1, inspect_checkpoint(step_1), group_bytes))
    assert tensors.keys() == model.state_dict().keys() - {"rope_inv_freq"}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    # A group closes as soon as it holds group_bytes; only the last may hold less.
    assert sum(map(len, groups)) == len(tensors)
    for sizes in groups[:-1]:
        assert sum(sizes[:-1]) < group_bytes <= sum(sizes)
    assert sum(groups[-1][:-1]) < group_bytes
    expected = {1: len(tensors), 1 << 30: 1}.get(group_bytes)
    if expected is None:
        assert 1 < len(groups) < len(tensors)
    else:
        assert len(groups) == expected


def test_an_export_keeps_the_checkpoints_dtype_and_without_a_tokenizer_names_no_delimiters(tmp_path):
    model, step_1 = saved_checkpoint(tmp_path / "run", dtype=torch.bfloat16)
    hf_io.export_checkpoint_to_hf(step_1, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf/model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    hf_io.save_hf_with_tokenizer(tmp_path / "bare", CFG, model.state_dict().items(), None)
    config = json.loads((tmp_path / "bare/config.json").read_text())
    assert "bos_token_id" not in config and "eos_token_id" not in config
    assert not (tmp_path / "bare/generation_config.json").exists()


def test_an_export_over_an_earlier_one_keeps_none_of_its_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hi": 1, "</s>": 2}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.add_special_tokens(["</s>"])
    words.save(str(tmp_path / "tokenizer.json"))
    model = Llama(CFG)
    out = tmp_path / "hf"
    hf_io.save_hf_with_tokenizer(out, CFG, model.state_dict().items(), str(tmp_path / "tokenizer.json"))
    assert folder_tokenizer(out) == str(out)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    for tokenizer, eos_id in (("byte", 257), (None, None)):
        hf_io.save_hf_with_tokenizer(out, CFG, model.state_dict().items(), tokenizer)
        assert folder_tokenizer(out) is None
        assert not [name for name in TOKENIZER_FILES if (out / name).exists()]
        generation = out / "generation_config.json"
        assert (json.loads(generation.read_text())["eos_token_id"] if generation.exists() else None) == eos_id


def test_an_export_goes_into_an_existing_directory_but_not_onto_a_file(tmp_path):
    _, step_1 = saved_checkpoint(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    hf_io.export_checkpoint_to_hf(step_1, tmp_path / "empty")
    assert (tmp_path / "empty/config.json").is_file()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"^.*a_file is a file; the export needs a directory$"):
        hf_io.export_checkpoint_to_hf(step_1, tmp_path / "a_file")
    for out in (step_1 / "hf", tmp_path / "run/checkpoints/hf"):
        with pytest.raises(ValueError, match=rf"^{out} is inside the checkpoint folder .*; export to a "
                                             "directory outside the run's checkpoints$"):
            hf_io.export_checkpoint_to_hf(step_1, out)
    (tmp_path / "elsewhere/checkpoints").mkdir(parents=True)  # named so, but not this checkpoint's
    hf_io.export_checkpoint_to_hf(step_1, tmp_path / "elsewhere/checkpoints/hf")


def test_a_run_directory_given_for_a_checkpoint_is_named_with_its_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step, saved in ((3, True), (8, False), (5, True)):  # step 8: a save cut short
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        if saved:
            (run / "checkpoints" / f"step_{step}" / "checkpoint.json").write_text("{}")
    newest = f"holds checkpoints: pass one, e.g. the newest, {run / 'checkpoints' / 'step_5'}$"
    for folder in (run, run / "checkpoints"):
        with pytest.raises(CheckpointError, match=newest):  # export
            inspect_checkpoint(folder)
        with pytest.raises(FileNotFoundError, match=newest):  # generation, model=hf
            hf_io.saved_architecture(folder)
        with pytest.raises(FileNotFoundError, match=newest):  # init_from
            hf_io.load_hf_weights(Llama(CFG), folder, CFG, log=print)
    # A folder with neither weights nor checkpoints keeps its own message.
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf_io.saved_architecture(tmp_path / "run" / "checkpoints" / "step_8")
