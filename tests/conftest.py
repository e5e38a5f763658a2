import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codatrain.train.distributed import shutdown_distributed

# The models under test are tiny: one thread per process avoids oversubscribing CI's two cores
# (the torchrun tests start two processes) and is faster than two threads fighting over them.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A Trainer built in a test joins the process group of one that `init_distributed` makes
    (scripts/train.py's `train` ends it); end it after the test, so that each test starts as a
    new process does. Then free what the test left in reference cycles: a DataLoader worker forked
    by a later test would otherwise inherit an ended gloo group as garbage, and its collector
    hangs in the group's destructor (its threads are not in the fork). What survives is frozen
    (left out of every later collection, a forked worker's too), so each test's collection scans
    only the objects made since the last: a full one scans torch's and its libraries' millions of
    objects, about 0.4 s, which after every test cost CI minutes."""
    yield
    shutdown_distributed()
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """The frozen objects are collected at exit as they would have been (nanobind, in triton, reports
    the objects of its types that outlive the interpreter as leaks)."""
    gc.unfreeze()


@pytest.fixture
def run_torchrun(tmp_path):
    """Run scripts/train.py under torchrun with `nproc` CPU processes; returns the CompletedProcess."""

    def run(nproc: int, overrides: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "scripts" / "train.py"), *overrides,
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc

    return run
