"""Several training runs one after another in the same torchrun processes, so a multi-process test
pays torchrun's start-up and the imports once:

    torchrun --nproc_per_node=4 tests/mesh_runs.py '[["parallel.dp_replicate=2", ...], ...]'

Each item is a list of config overrides (as for scripts/train.py); each run builds its `Trainer`
on the one process group (`init_distributed`), with its own mesh, and writes its run dir as a job
of scripts/train.py would. `launch` starts such a job from a test (tests/test_hsdp.py, test_train.py,
test_checkpoint_resume.py), which then reads the runs' metrics and checkpoints.
"""

import json
import subprocess
import sys
from pathlib import Path

from codatrain.config import load_config, validate
from codatrain.train.distributed import barrier, init_distributed, shutdown_distributed
from codatrain.train.trainer import Trainer


def launch(nproc: int, runs: list[list[str]], cwd: Path, script: str = __file__) -> str:
    """The runs in one torchrun job of `nproc` CPU processes (by `script`, a `main` like this
    file's); its output (stdout and stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, json.dumps(runs)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def main(runs: list[list[str]]) -> None:
    dist_info = None
    try:
        for overrides in runs:
            run = validate(load_config(overrides))
            dist_info = dist_info or init_distributed(run.train.device)
            trainer = Trainer(run, dist_info)
            try:
                trainer.fit()
            finally:
                trainer.close()
            barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
