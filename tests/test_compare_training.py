"""scripts/compare_training.py on saved runs (--plot-only): the FP8 parity runs in docs/, and runs
that disagree."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "compare_training.py"
FP8_RUNS = REPO / "docs" / "loss_curves" / "fp8_125m"


def compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--plot-only", *args], capture_output=True, text=True)


def write_run(folder: Path, losses: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)))


def test_the_fp8_parity_runs_agree_and_plot(tmp_path):
    plot = tmp_path / "fp8.png"
    proc = compare("--run-root", str(FP8_RUNS), "--window", "50", "--variant", "coda_bf16=block=coda",
                   "--variant", "coda_fp8=block=coda block.precision=fp8",
                   "--variant", "compile_rowwise=block=eager train.float8=rowwise", "--plot", str(plot))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "coda_bf16 1.1943 (baseline)" in proc.stdout
    assert "coda_fp8: 1.1964 at step 600 (+0.18%)" in proc.stdout
    assert plot.stat().st_size > 10_000


def test_a_variant_beyond_the_tolerance_fails_and_names_itself(tmp_path):
    write_run(tmp_path / "base", [2.0] * 40)
    write_run(tmp_path / "close", [2.01] * 40)
    write_run(tmp_path / "far", [2.0] * 20 + [2.2] * 20)
    runs = ["--run-root", str(tmp_path), "--variant", "base=", "--variant", "close="]
    proc = compare(*runs, "--tolerance", "0.05")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = compare(*runs, "--variant", "far=")
    assert proc.returncode == 1
    assert ("far: 2.2000 at step 40 (+10.00%); largest windowed difference +0.2000 (steps ending 40)"
            in proc.stdout)


def test_a_variant_without_a_name_or_alone_is_refused_by_name():
    proc = compare("--variant", "no equals sign")
    assert proc.returncode == 2 and "--variant 'no equals sign': expected NAME=OVERRIDES" in proc.stderr
    proc = compare("--variant", "coda=block=coda")
    assert proc.returncode == 2 and "compare needs at least two --variant runs" in proc.stderr


def test_runs_that_are_not_there_are_named(tmp_path):
    write_run(tmp_path / "base", [2.0] * 5)
    proc = compare("--run-root", str(tmp_path), "--variant", "base=", "--variant", "other=")
    assert proc.returncode == 2
    missing = tmp_path / "other"
    assert proc.stderr.endswith(f"error: no metrics.jsonl in {missing}: run the comparison without "
                                "--plot-only first\n")
