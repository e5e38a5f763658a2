"""Train a Llama-style model.

    python scripts/train.py                                   # tiny model, embedded corpus, CPU or GPU
    torchrun --nproc_per_node=8 scripts/train.py model=llama3_1b block=coda data=files data.path=...

Any config key can be overridden on the command line; see configs/train.yaml.
"""

import sys

import hydra
from omegaconf import DictConfig

from codatrain.config import register_configs
from codatrain.kernels.stages import BackendUnavailableError
from codatrain.train.checkpoint import CheckpointError
from codatrain.train.run_lock import RunDirError
from codatrain.train.trainer import NonFiniteError, train

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (ValueError, FileNotFoundError, BackendUnavailableError, CheckpointError, NonFiniteError,
            RunDirError) as error:
        # Bad input, an unusable run dir, a failed save or a diverged run: one clear line, not a
        # traceback (checkpoints stay intact).
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    sys.exit(main())
