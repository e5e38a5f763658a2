"""Every script answers --help with its usage and exit status 0, on a CPU, and writes nothing: a
user's first look at a script must neither run it (a benchmark, a rebuild of a shipped file) nor
fail."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path.name for path in (REPO / "scripts").glob("*.py"))


def repository_files() -> dict[Path, str]:
    """The content hash of every file a script could rewrite (the package, its configs and docs)."""
    return {path: hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in ("codatrain", "configs", "docs", "scripts") for path in (REPO / folder).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_writes_nothing(tmp_path, script):
    before = repository_files()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert script.removesuffix(".py") in done.stdout and ("usage:" in done.stdout or "Hydra" in done.stdout)
    # Files other tests make meanwhile (caches) do not count; a changed or removed one does.
    after = repository_files()
    assert {path: after.get(path) for path in before} == before
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script, extra", [
    ("precompile.py", ["kernels.cache_dir=unused"]),
    ("kernel_report.py", []),
    ("memory_report.py", []),
    ("tokenize_corpus.py", ["--out", "unused"]),
])
def test_a_misspelt_key_is_named_with_the_nearest_as_train_py_names_it(tmp_path, script, extra):
    # It was Hydra's "Could not override 'train.stesp'. To append to your config use
    # +train.stesp=3", an override the run's schema then refuses too.
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), *extra, "train.stesp=3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("error: unknown config key 'train.stesp'; did you mean "
                                            "train.steps? (docs/config.md lists every key)")
    assert not list(tmp_path.iterdir())
