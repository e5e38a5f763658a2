import pytest
from hydra.errors import ConfigCompositionException

from codatrain.config import load_config, model_config, validate


def test_default_config_composes():
    cfg = load_config()
    validate(cfg)
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
])
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigCompositionException) as info:
        load_config([override])
    message = str(info.value) + str(info.value.__cause__)
    assert named in message


@pytest.mark.parametrize("override,named", [
    ("block.impl=fast", "block.impl"),
    ("optim.schedule=linear", "optim.schedule"),
    ("train.steps=0", "train.steps"),
    ("train.log_every=0", "train.log_every"),
    ("train.val_batches=0", "train.val_batches"),
    ("block.attention=fa4", "block.attention"),  # a CODA option, with block=eager
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
