import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from codatrain.config import load_config, model_config, validate
from codatrain.model.config import LlamaConfig, get_preset

REPO = Path(__file__).resolve().parent.parent


def test_default_config_composes():
    cfg = load_config()
    run = validate(cfg)
    assert run.block.impl == "eager" and run.train.run_dir == "runs/tiny-eager"  # enums compare as str
    assert cfg.model.preset == "tiny" and cfg.block.impl == "eager" and cfg.data.source == "embedded"
    assert model_config(cfg.model).dim == 128


def test_model_overrides_apply_to_the_preset():
    cfg = load_config(["model=llama3_8b", "model.n_layers=4"])
    resolved = model_config(cfg.model)
    assert resolved.n_layers == 4 and resolved.dim == 4096 and resolved.ffn_dim == 14336


@pytest.mark.parametrize("override,named", [
    ("train.stpes=5", "stpes"),
    ("train.steps=many", "train.steps"),
    ("model=llama9", "llama9"),
    ("optim.lr=fast", "optim.lr"),
    # string choices are enums in the schema, so a bad one fails at composition too
    ("block.impl=fast", "block.impl"),
    ("optim.schedule=linear", "optim.schedule"),
    ("kernels.on_stale=sometimes", "kernels.on_stale"),
    ("data.text_sample_by=word", "data.text_sample_by"),
])
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigCompositionException) as info:
        load_config([override])
    message = str(info.value) + str(info.value.__cause__)
    assert named in message


@pytest.mark.parametrize("override,named", [
    ("train.steps=0", "train.steps"),
    ("train.log_every=0", "train.log_every"),
    ("train.val_batches=0", "train.val_batches"),
    ("block.attention=fa4", "block.attention"),  # a CODA option, with block=eager
    ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.save_hf_every=-2", "checkpoint.save_hf_every"),
    ("data.seq_len=0", "data.seq_len"),
    ("model.n_layers=0", "model.n_layers"),
    ("model.n_heads=3", "model.n_heads"),
])
def test_bad_values_name_the_key(override, named):
    with pytest.raises(ValueError, match=named):
        validate(load_config([override]))


def test_forced_unknown_key_is_rejected():
    with pytest.raises(ValueError, match="stpes"):
        validate(load_config(["+train.stpes=5"]))


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        model_config(load_config(["model.preset=nope"]).model)


def test_every_model_field_can_be_overridden():
    """The model schema is generated from LlamaConfig: a field there is a `model.<field>` key."""
    overrides = {f.name: getattr(get_preset("tiny"), f.name) for f in dataclasses.fields(LlamaConfig)}
    assert set(overrides) <= set(OmegaConf.to_container(load_config().model))
    resolved = model_config(validate(load_config(["model.init_std=0.01", "model.rope_theta=1e4"])).model)
    assert resolved.init_std == 0.01 and resolved.rope_theta == 1e4


def test_a_bad_choice_fails_the_script_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "block.impl=fast",
                           f"train.run_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "block.impl" in proc.stderr and "expected one of [eager, coda]" in proc.stderr
