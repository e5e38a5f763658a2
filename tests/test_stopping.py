"""A real SIGTERM (what Slurm sends before preemption) to scripts/train.py, alone and under torchrun:
the run stops after a step, saves there, says so in one line without a traceback, and the same
command resumes it to the final step."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from codatrain.train.logger import read_losses

REPO = Path(__file__).resolve().parent.parent
STEPS = 40
RUN = ["data=synthetic", "data.num_workers=1", "data.seq_len=64", "train.micro_batch_size=8",
       f"train.steps={STEPS}", "train.log_every=1", "train.val_every=10", "train.progress=false",
       "checkpoint.at_end=true"]
STOPPED = re.compile(r"stopped at step (\d+) by SIGTERM; checkpoint (\S+); resume with the same command")


def environment() -> dict[str, str]:
    # Unbuffered, so the test sees each step's line as it is printed; this checkout's codatrain.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def sigterm_after_step(command: list[str], cwd, step: int) -> tuple[int, str, str]:
    """Start `command`, send SIGTERM to it once a line reports step `step`; (status, stdout, stderr)."""
    proc = subprocess.Popen(command, cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {step}/"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + out, err


def assert_stopped(out: str, err: str, run_dir) -> int:
    """The one line of a stopped run and its checkpoint; returns the step it stopped at."""
    assert not re.search(r'File ".*(codatrain/|scripts/train\.py)', err), err[-3000:]  # no traceback of ours
    stops = STOPPED.findall(out)
    assert len(stops) == 1, out[-3000:]
    step, checkpoint = int(stops[0][0]), stops[0][1]
    assert 3 <= step < STEPS and checkpoint == str(run_dir / "checkpoints" / f"step_{step}")
    assert sorted(read_losses(run_dir)) == list(range(1, step + 1))
    return step


@pytest.mark.slow
def test_sigterm_stops_a_python_run_that_the_same_command_resumes(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "train.py"), *RUN, f"train.run_dir={tmp_path}"]
    status, out, err = sigterm_after_step(command, tmp_path, 3)
    assert status == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    step = assert_stopped(out, err, tmp_path)
    resumed = subprocess.run(command, cwd=tmp_path, env=environment(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{step}'} at step {step}" in resumed.stdout
    assert f"done: step {STEPS}/{STEPS}" in resumed.stdout
    assert sorted(read_losses(tmp_path)) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_and_they_resume(tmp_path):
    """torchrun forwards the signal to its workers (Slurm signals them too); they agree on the step,
    save collectively and resume together."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "scripts" / "train.py"), *RUN, f"train.run_dir={tmp_path}"]
    status, out, err = sigterm_after_step(command, tmp_path, 3)
    assert status != 0  # torchrun itself reports the signal it received
    step = assert_stopped(out, err, tmp_path)
    resumed = subprocess.run(command, cwd=tmp_path, env=environment(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{step}'} at step {step}" in resumed.stdout
    assert f"done: step {STEPS}/{STEPS}" in resumed.stdout
    assert sorted(read_losses(tmp_path)) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_a_job_that_torchrun_may_restart(tmp_path):
    """A stopped rank exits with 143, which torchrun's agent takes for a failure: with --max-restarts
    it restarted the job, which resumed and trained on (only a signal to the agent itself ends it).
    The restart now trains nothing; a relaunch of the same command resumes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", str(REPO / "scripts" / "train.py"), *RUN, f"train.run_dir={tmp_path}"]
    # Restarts need it (README: Several nodes): else the restarted ranks read the old addresses.
    env = {**environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/"):  # rank 1 alone, as `kill <pid>` of one worker
            os.kill(json.loads((tmp_path / "attempts/1/rank_00001.json").read_text())["pid"], signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    out = "".join(lines) + out
    assert proc.returncode != 0
    step = assert_stopped(out, err, tmp_path)
    assert (f"not training: attempt 1 was stopped at step {step} by SIGTERM and torchrun restarted it "
            "(--max-restarts); resume with the same command") in out
    assert "done:" not in out
    relaunched = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{step}'} at step {step}" in relaunched.stdout
    assert sorted(read_losses(tmp_path)) == list(range(1, STEPS + 1))
