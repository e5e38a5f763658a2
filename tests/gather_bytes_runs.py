"""`mesh_runs` with the bytes FSDP2 all-gathers counted: each run's rank 0 writes
<run_dir>/all_gather_bytes.json, {"total": bytes a rank sent into all-gathers during `fit`
(training, validation, checkpoints), "fp8": of which FP8 weight shards (`Fp8GatherShard`)}.

    torchrun --nproc_per_node=2 tests/gather_bytes_runs.py '[[overrides...], ...]'
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from mesh_runs import main

from codatrain.train.fp8_allgather import Fp8GatherShard
from codatrain.train.trainer import Trainer

BYTES_FILE = "all_gather_bytes.json"


def counting(runs: list[list[str]]) -> None:
    sent = {"total": 0, "fp8": 0}
    # FSDP2's default all-gather calls dist.all_gather_single with one flat buffer per group.
    all_gather_single, pre_all_gather, fit = (dist.all_gather_single, Fp8GatherShard.fsdp_pre_all_gather,
                                              Trainer.fit)

    def counted_all_gather(output_tensor, input_tensor, *args, **kwargs):
        sent["total"] += input_tensor.numel() * input_tensor.element_size()
        return all_gather_single(output_tensor, input_tensor, *args, **kwargs)

    # FSDP2 reads the hook's signature: its five arguments spelled out.
    def counted_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        sent["fp8"] += sum(t.numel() * t.element_size() for t in inputs)
        return inputs, metadata

    def counted_fit(self):
        sent.update(total=0, fp8=0)
        result = fit(self)
        if self.dist.is_main:
            (Path(self.run_dir) / BYTES_FILE).write_text(json.dumps(sent))
        return result

    dist.all_gather_single = counted_all_gather
    Fp8GatherShard.fsdp_pre_all_gather = counted_pre_all_gather
    Trainer.fit = counted_fit
    main(runs)


if __name__ == "__main__":
    counting(json.loads(sys.argv[1]))
