"""Train a Llama-style model.

    python scripts/train.py                                   # tiny model, embedded corpus, CPU or GPU
    torchrun --nproc_per_node=8 scripts/train.py model=llama3_1b block=coda data=files data.path=...

Any config key can be overridden on the command line; see configs/train.yaml.
"""

import os
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from codatrain.config import expand_home_in_overrides, register_configs, unknown_override_key
from codatrain.kernels.stages import BackendUnavailableError
from codatrain.train.checkpoint import CheckpointError
from codatrain.train.run_lock import RunDirError, create_run_dir
from codatrain.train.trainer import NonFiniteError, train

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # the job's own folder (configs/train.yaml: sweep)
        cfg.train.run_dir = HydraConfig.get().runtime.output_dir
    hydra = HydraConfig.get()
    # What Hydra's output_subdir held (configs/train.yaml says why the run writes it).
    record = {"config.yaml": cfg, "hydra.yaml": OmegaConf.create({"hydra": hydra}),
              "overrides.yaml": OmegaConf.create(list(hydra.overrides.task))}
    try:
        result = train(cfg, config_record=record)
    except (ValueError, FileNotFoundError, BackendUnavailableError, CheckpointError, NonFiniteError,
            RunDirError) as error:
        # Bad input, an unusable run dir, a failed save or a diverged run: one clear line, not a
        # traceback (checkpoints stay intact).
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:  # Ctrl-C before the training loop, which handles it itself
        sys.exit("interrupted before training started")
    if result.stopped_by:  # its line is logged; the shell's status of a run that a signal ended
        sys.exit(128 + signal.Signals[result.stopped_by])


def run_dir_argument(argv: list[str]) -> str | None:
    """The `train.run_dir=` given on the command line, if any (the last one wins, as in Hydra), read
    by Hydra's own override parser (quotes, escapes); None where Hydra will reject the argument."""
    given = [arg for arg in argv if arg.lstrip("+").startswith("train.run_dir=")]
    if not given:
        return None
    try:
        value = OverridesParser.create().parse_override(given[-1]).value()
    except HydraException:  # Hydra reports it, with its grammar
        return None
    return os.path.expanduser(value) if isinstance(value, str) else None


if __name__ == "__main__":
    sys.argv[1:] = expand_home_in_overrides(sys.argv[1:])  # `train.run_dir=~/runs/x`, as a shell would
    if (unknown := unknown_override_key(sys.argv[1:])) is not None:
        sys.exit(f"error: {unknown}")
    # Hydra creates the run directory (hydra.run.dir) before main() runs and reports a failure as a
    # traceback: create it here first, so that a run dir that is a file or read-only is one line.
    run_dir = run_dir_argument(sys.argv[1:])
    if run_dir is not None and "${" not in run_dir:
        try:
            create_run_dir(run_dir)
        except RunDirError as error:
            sys.exit(f"error: {error}")
    sys.exit(main())
