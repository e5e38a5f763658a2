"""`mesh_runs` with a kernel check that fails on one rank: in each run whose run dir's name starts
with "fail", rank 1's forwards record a failed deferred check (`codatrain.kernels.checks.holds`)
during optimizer step FAILING_STEP (two micro-batches a step), as the LM head's fast pipeline does
on data past its exact range.

    torchrun --nproc_per_node=2 tests/deferred_check_runs.py '[[overrides...], ...]'
"""

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mesh_runs import main

from codatrain.kernels import checks
from codatrain.model import Llama
from codatrain.train.trainer import Trainer

FAILING_STEP, GRAD_ACCUM = 2, 2


def fail_a_check_on_rank_1() -> None:
    forward, fit, run = Llama.forward, Trainer.fit, {}

    def counted_fit(self):
        run.update(calls=itertools.count(), failing=Path(self.run_dir).name.startswith("fail"))
        return fit(self)

    def failing_forward(self, tokens, targets=None, **options):
        if run["failing"] and targets is not None and dist.get_rank() == 1 and \
                next(run["calls"]) // GRAD_ACCUM + 1 == FAILING_STEP:
            checks.holds(torch.tensor(False))  # inside the step's deferred_checks(): recorded
        return forward(self, tokens, targets, **options)

    Trainer.fit, Llama.forward = counted_fit, failing_forward


if __name__ == "__main__":
    fail_a_check_on_rank_1()
    main(json.loads(sys.argv[1]))
