"""scripts/bench_train.py on CPU: the variants run, the medians skip warm-up, profiles and plots appear."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codatrain.train.runs import summarize

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_train_reports_every_variant(tmp_path):
    cmd = [
        sys.executable, str(REPO / "scripts" / "bench_train.py"), "--variants", "eager,coda_reference",
        "--steps", "4", "--warmup", "1", "--profile", "1", "--out", str(tmp_path),
        "--plot", str(tmp_path / "bench.png"), "--",
        "train.micro_batch_size=4", "train.tokens_per_step=512", "model.n_layers=2",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_train.json").read_text())
    eager, coda = report["variants"]
    assert [eager["variant"], coda["variant"]] == ["eager", "coda_reference"]
    for summary in (eager, coda):
        assert summary["timed_steps"] == 3  # steps 2-4: warm-up and the profiled steps excluded
        assert summary["mfu"] is None and summary["tokens_per_s_per_device"] > 0
        assert "aten::mm" in Path(summary["profile"]).read_text()
    # Same seed, data and weights: the two block implementations start on the same loss.
    assert coda["losses"]["1"] == pytest.approx(eager["losses"]["1"], rel=1e-5)
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "coda_reference" in proc.stdout.splitlines()[-1]


def test_summary_takes_medians_after_warmup():
    """codatrain.train.runs.summarize, which bench_train and bench_scaling share."""
    records = [{"step": s, "loss": 10.0 - s, "step_time_s": float(s), "tokens_per_s_per_device": 100.0 * s,
                "tflops_per_device": 1.0, "mfu": None, "peak_memory_gib": float(s),
                "resident_memory_gib": 1.0, "data_time_s": 0.0} for s in range(1, 5)]
    summary = summarize({"variant": "eager", "records": records, "profile": None}, warmup=1)
    assert summary["timed_steps"] == 3 and summary["step_time_s"] == 3.0  # steps 2-4
    assert summary["tokens_per_s_per_device"] == 300.0 and summary["mfu"] is None
    assert summary["peak_memory_gib"] == 4.0 and summary["step_memory_gib"] == 3.0
    assert summary["final_loss"] == 6.0 and summary["losses"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
    assert summarize({"variant": "coda", "error": "exit code 1"}, warmup=1)["error"] == "exit code 1"
    assert "error" in summarize({"variant": "eager", "records": records[:1], "profile": None}, warmup=1)


def test_summary_counts_the_allocator_retries_of_the_timed_steps():
    """The records carry the allocator's retries since the process started; the summary reports
    those of the timed steps (after the last warm-up step's count), and None where there is no GPU."""
    records = [{"step": s, "loss": 1.0, "step_time_s": 1.0, "tokens_per_s_per_device": 1.0,
                "tflops_per_device": 1.0, "mfu": None, "peak_memory_gib": 1.0, "resident_memory_gib": 1.0,
                "reserved_memory_gib": 2.0 + s, "alloc_retries": retries, "data_time_s": 0.0}
               for s, retries in zip(range(1, 5), (2, 5, 5, 9), strict=True)]
    summary = summarize({"variant": "coda", "records": records, "profile": None}, warmup=1)
    assert summary["alloc_retries"] == 7 and summary["reserved_memory_gib"] == 6.0
    cpu = [{**r, "reserved_memory_gib": None, "alloc_retries": None} for r in records]
    summary = summarize({"variant": "coda", "records": cpu, "profile": None}, warmup=1)
    assert summary["alloc_retries"] is None and summary["reserved_memory_gib"] is None


def test_a_run_stopped_after_one_variant_keeps_its_report(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_train

    records = [{"step": s, "loss": 5.0, "step_time_s": 1.0, "tokens_per_s_per_device": 10.0,
                "tflops_per_device": 1.0, "mfu": None, "peak_memory_gib": 1.0, "resident_memory_gib": 0.5,
                "data_time_s": 0.0} for s in range(1, 4)]

    def run_variant(name, overrides, steps, out, launch, profile):
        if name != "eager":
            raise KeyboardInterrupt  # the time limit, while the second variant runs
        return {"variant": name, "records": records, "profile": None}

    monkeypatch.setattr(bench_train, "run_variant", run_variant)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--variants", "eager,coda", "--steps", "3",
                                      "--warmup", "1", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        bench_train.main()
    report = json.loads((tmp_path / "bench_train.json").read_text())
    assert [v["variant"] for v in report["variants"]] == ["eager"]
    assert report["variants"][0]["timed_steps"] == 2


@pytest.mark.parametrize("options, overrides, refusal", [
    # Each variant's job failed alike, shown only as "exit code 1" in the table.
    ([], ["train.stesp=3"], "overrides: unknown config key 'train.stesp'; did you mean train.steps? "
                            "(docs/config.md lists every key)"),
    ([], ["block.attention=sdpa"], "overrides, variant eager: block.attention='sdpa' chooses the CODA "
                                   "block's kernels; it needs block=coda"),
    (["--steps", "0", "--warmup", "-1"], [], "--warmup must be 0 or more and smaller than --steps"),
])
def test_options_and_overrides_no_variant_can_run_are_refused_before_any_job(tmp_path, options, overrides,
                                                                            refusal):
    cmd = [sys.executable, str(REPO / "scripts" / "bench_train.py"), "--variants", "coda_reference,eager",
           "--out", str(tmp_path / "out"), *options, "--", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"bench_train.py: error: {refusal}"
    assert not (tmp_path / "out").exists()
