import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from codatrain.config import load_config, model_config, unknown_override_key, validate
from codatrain.model.config import LlamaConfig, get_preset
from codatrain.train.trainer import train

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
    ("data.max_documents=0", "data.max_documents must be positive, got 0"),
    ("model.n_layers=0", "model.n_layers"),
    ("model.n_heads=3", "model.n_heads"),
    ("model.norm_eps=-1e-5", "model.norm_eps must be positive, got -1e-05"),
    ("model.init_std=-0.02", "model.init_std must be positive, got -0.02"),
    ("optim.lr=-1", "optim.lr must be positive"),
    ("optim.warmup_steps=-5", "optim.warmup_steps"),
    ("optim.min_lr_ratio=2", r"optim.min_lr_ratio must lie in \[0, 1\]"),
    ("optim.decay_fraction=1.5", "optim.decay_fraction"),
    ("optim.beta2=1", r"optim.beta2 must lie in \[0, 1\)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
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
    assert "block.impl" in proc.stderr and "expected one of [eager, coda, liger]" in proc.stderr


def test_liger_block_composes_and_refuses_coda_options():
    assert validate(load_config(["block=liger"])).block.impl == "liger"
    with pytest.raises(ValueError, match="block.backend='cute' chooses the CODA block's kernels"):
        validate(load_config(["block=liger", "block.backend=cute"]))


# ---- training recipes: one per model config (configs/model/<preset>.yaml) -----------------------

RECIPE_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")


def recipe(run) -> dict:
    values = {key: getattr(run.optim, key) for key in RECIPE_KEYS}
    return {**values, "tokens_per_step": run.train.tokens_per_step}


def readme_recipes() -> dict[str, dict]:
    """The README's recipe table, read back as config values."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| preset | peak lr |"):].split("\n\n")[0].splitlines()[2:]
    recipes = {}
    for row in table:
        cells = (cell.strip() for cell in row.strip("|").split("|"))
        preset, lr, warmup, min_lr, decay, betas, clip, tokens, _source = cells
        beta1, beta2 = (float(b) for b in betas.strip("()").split(","))
        recipes[preset.strip("`")] = {
            "lr": float(lr), "warmup_steps": int(warmup), "min_lr_ratio": float(min_lr.split()[0]),
            "weight_decay": float(decay), "beta1": beta1, "beta2": beta2, "grad_clip": float(clip),
            "tokens_per_step": int(tokens.split()[0].replace(",", "")) if tokens[0].isdigit() else None,
        }
    return recipes


def test_every_preset_has_its_recipe_and_the_readme_lists_it():
    table = readme_recipes()
    presets = sorted(path.stem for path in (REPO / "configs" / "model").glob("*.yaml"))
    assert sorted(table) == presets == [
        "hf", "llama3_125m", "llama3_1_8b", "llama3_1b", "llama3_2_1b", "llama3_2_3b", "llama3_8b", "tiny"
    ]
    for preset in presets:
        run = validate(load_config([f"model={preset}"]))
        assert run.model.preset == preset
        assert recipe(run) == table[preset], preset
    # Larger models train at lower peak rates.
    lrs = [table[p]["lr"] for p in ("tiny", "llama3_125m", "llama3_1b", "llama3_8b")]
    assert lrs == sorted(lrs, reverse=True)


def test_the_default_run_keeps_its_recipe():
    run = validate(load_config())
    assert recipe(run) == {"lr": 3e-3, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.1,
                           "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "tokens_per_step": None}
    assert run.optim.schedule == "cosine"


def test_recipe_keys_are_overridable_one_by_one():
    base = recipe(validate(load_config(["model=llama3_1b"])))
    run = validate(load_config(["model=llama3_1b", "optim.lr=1e-3", "train.tokens_per_step=null"]))
    assert recipe(run) == {**base, "lr": 1e-3, "tokens_per_step": None}
    # Another schedule keeps the recipe's values; another model brings its own.
    wsd = validate(load_config(["model=llama3_1b", "optim=wsd"]))
    assert wsd.optim.schedule == "wsd" and recipe(wsd) == base
    assert recipe(validate(load_config(["model=llama3_8b", "model.n_layers=4"]))) != base


def test_run_header_prints_the_recipe(tmp_path, capsys):
    train(load_config(["model.n_layers=1", "optim.lr=1e-3", "optim.grad_clip=0", "train.steps=1",
                       "train.val_every=0", "train.progress=false", "checkpoint.at_end=false",
                       f"train.run_dir={tmp_path}"]))
    header = capsys.readouterr().out.splitlines()[1]
    assert header == ("recipe: AdamW lr 0.001, 20 warmup steps, cosine to 0.1× | weight decay 0.1 | "
                      "betas (0.9, 0.95) | grad clip off")


# ---- docs/config.md and --help -------------------------------------------------------------------
def config_reference():
    sys.path.insert(0, str(REPO / "scripts"))
    import config_reference

    return config_reference


def test_the_config_reference_page_is_what_the_schema_gives():
    page = (REPO / "docs" / "config.md").read_text()
    assert page == config_reference().reference_page(), (
        "docs/config.md and the schema disagree: run python scripts/config_reference.py")
    run = OmegaConf.to_container(load_config([]), resolve=False)
    keys = [f"{group}.{key}" for group, node in run.items() if group != "logger" for key in node]
    keys += [f"logger.wandb.{key}" for key in run["logger"]["wandb"]]
    assert all(f"| `{key}` |" in page for key in keys)


def test_a_key_without_its_line_stops_the_reference(tmp_path):
    module = tmp_path / "node.py"
    module.write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass Node:\n"
                      "    said: int = 1  # what it sets\n    unsaid: int = 2\n")
    sys.path.insert(0, str(tmp_path))
    import node

    reference = config_reference()
    with pytest.raises(SystemExit, match="error: x.unsaid has no comment in the schema's source"):
        reference.rows(node.Node, "x", reference.field_comments(node.Node))


def test_help_lists_the_group_choices_without_the_schema_nodes():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "block: coda, eager, liger\n" in proc.stdout and "optim: adamw, wsd\n" in proc.stdout
    assert "schema" not in proc.stdout


def test_a_home_path_is_expanded_and_never_a_folder_named_tilde(tmp_path, monkeypatch):
    """Hydra keeps `~` as it is (and has no bare `~` in its grammar): a run directory `~/runs/x`
    made a folder named `~` in the working directory, and `~` paths to data were not found."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    run = validate(load_config(["train.run_dir=~/runs/a", 'data.path="~/corpus"', "data.source=files",
                                "checkpoint.init_from=~/hf", "kernels.cache_dir='~/kernels'"]))
    assert (run.train.run_dir, run.data.path) == (f"{home}/runs/a", f"{home}/corpus")
    assert (run.checkpoint.init_from, run.kernels.cache_dir) == (f"{home}/hf", f"{home}/kernels")
    for given in ("train.run_dir=~/runs/b", 'train.run_dir="~/runs/c"'):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), given, "train.steps=1",
                               "data=synthetic", "train.val_every=0", "checkpoint.at_end=false"], cwd=work,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (home / "runs").iterdir()) == ["b", "c"]
    assert (home / "runs" / "c" / ".hydra").is_dir() and not list(work.iterdir())


def readme_train_commands() -> list[tuple[int, list[str]]]:
    """(processes, overrides) of every scripts/train.py command in the README's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("&&")[-1], comments=True)
            if "scripts/train.py" in words:
                nproc = next((int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node=")), 1)
                commands.append((nproc, words[words.index("scripts/train.py") + 1:]))
    return commands


def test_a_misspelt_key_is_one_line_with_the_nearest_key_and_every_readme_key_is_known(tmp_path):
    assert unknown_override_key(["train.stesp=3"]) == ("unknown config key 'train.stesp'; did you mean "
                                                       "train.steps? (docs/config.md lists every key)")
    assert unknown_override_key(["logger.wandb.mod=offline"]).startswith(
        "unknown config key 'logger.wandb.mod'; did you mean logger.wandb.mode?")
    others = ["+train.new=1", "~data.path", "hydra.verbose=true", "-m", "model=tiny"]
    assert unknown_override_key(others) is None  # forced, deleted, Hydra's own, flags, groups
    commands = readme_train_commands()
    assert len(commands) >= 10
    for _, overrides in commands:
        assert unknown_override_key(overrides) is None, overrides
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "model.nlayers=2",
                           f"train.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    assert proc.stderr == ("error: unknown config key 'model.nlayers'; did you mean model.n_layers? "
                           "(docs/config.md lists every key)\n")
    assert not (tmp_path / "run").exists()


def test_every_readme_training_command_has_a_batch_its_micro_batches_divide():
    """The model=hf examples on 8 GPUs once asked for micro-steps of 16 × 8192 × 8 tokens, more than the
    recipe's 262,144-token step."""
    commands = readme_train_commands()
    assert sum("model=hf" in overrides for _, overrides in commands) >= 3  # the parser finds them
    for nproc, overrides in commands:
        run = validate(load_config(overrides))
        micro_step = run.train.micro_batch_size * run.data.seq_len * nproc
        step = run.train.tokens_per_step or micro_step
        assert step % micro_step == 0, (overrides, step, micro_step)
