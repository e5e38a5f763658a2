"""The out-of-the-box run: `python scripts/train.py` learns from the embedded corpus."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from unigram import unigram_entropy

from codatrain.config import DataConfig, load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a training subprocess
def test_default_run_learns_the_embedded_corpus_below_its_unigram_entropy(tmp_path):
    assert load_config().data.source == "embedded"
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    # The default run, shortened (fewer, smaller steps): its loss is already well below the unigram
    # entropy by then (about 2.7 against 3.2 nats).
    steps = 40
    overrides = [f"train.steps={steps}", "train.tokens_per_step=2048", f"train.val_every={steps}",
                 f"train.run_dir={tmp_path / 'run'}", "train.progress=false", "checkpoint.at_end=false"]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), *overrides], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["step"] == steps

    # The loss of the best context-free model, from the token cache the run just filled.
    entropy = unigram_entropy(DataConfig(cache_dir=env["HF_DATASETS_CACHE"]))
    assert 3.0 < entropy < 3.5  # bytes of English prose
    assert final["loss"] < entropy - 0.25, (final["loss"], entropy)
    assert final["val_loss"] < entropy - 0.25, (final["val_loss"], entropy)


def test_readme_files_example_names_the_validation_share():
    """A small folder holds too few documents for the default held-out share: the example says
    which key sets it."""
    readme = (REPO / "README.md").read_text()
    example = readme[readme.index("python scripts/train.py data=files"):].split("\npython")[0]
    assert "data.val_fraction=" in example
