"""scripts/bench_scaling.py on CPU (gloo): 1 vs 2 processes (replicated: --mesh 2x1), a 2-process
checkpoint resumed on 1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_scaling.py"
TRAIN = ["data=synthetic", "data.num_workers=0", "data.seq_len=64", "train.micro_batch_size=4",
         "optim.warmup_steps=2"]


def bench(out: Path, *options: str, overrides: list[str] = TRAIN) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--variants", "eager", "--steps", "8",
           "--throughput-steps", "3", "--warmup", "1", "--window", "2", "--out", str(out), *options,
           "--", *overrides]
    return subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_scaling_legs_checks_and_rerun(tmp_path):
    out = tmp_path / "scaling"
    # No timing threshold in a test: the efficiency check is switched off here.
    proc = bench(out, "--min-efficiency", "0", "--mesh", "2x1", "--plot", str(tmp_path / "loss.png"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_scaling.json").read_text())
    assert report["mesh"] == "2x1"
    for leg in ("throughput_2", "loss_2"):
        assert "2 × cpu (replicate 2)" in (out / "eager" / leg / "train.log").read_text()
    (eager,) = report["variants"]
    assert set(eager["throughput"]["tokens_per_s_per_device"]) == {"1", "2"}
    assert sorted(map(int, eager["losses"]["loss_1"])) == list(range(1, 9))
    assert sorted(map(int, eager["losses"]["resume_1"])) == list(range(5, 9))
    # fp32 on CPU: 1 process accumulating 2 micro-batches and 2 FSDP2 ranks differ only in the
    # order of gradient sums; the resumed run starts from the 2-rank step-4 checkpoint resharded.
    for check in ("parity", "resume"):
        assert eager[check]["ok"]
        assert eager[check]["first_step_rel_diff"] < 1e-5
        assert eager[check]["max_step_abs_diff"] < 1e-4
    assert eager["resume"]["first_step"] == 5
    assert (out / "eager" / "loss_2" / "checkpoints" / "step_4").is_dir()
    assert (tmp_path / "loss.png").stat().st_size > 10_000

    # A second call finds every leg complete and only re-evaluates: here a check that fails.
    proc = bench(out, "--min-efficiency", "1000", "--mesh", "2x1")
    assert proc.returncode == 1
    assert proc.stdout.count("complete, not run again") == 5
    assert "throughput FAILED" in proc.stdout.splitlines()[-1]


def test_a_mesh_that_does_not_fit_is_refused_before_any_job(tmp_path):
    proc = bench(tmp_path / "scaling", "--mesh", "3x1")
    assert proc.returncode == 2
    assert "--mesh 3x1: give full, auto or RxS with R·S = --nproc 2" in proc.stderr
    assert not (tmp_path / "scaling").exists()


def test_bad_override_is_named_before_any_job(tmp_path):
    proc = bench(tmp_path / "scaling", overrides=["train.bogus_key=1"])
    assert proc.returncode == 2
    assert "bogus_key" in proc.stderr
    assert not (tmp_path / "scaling").exists()
