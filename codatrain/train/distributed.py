"""Process-group setup: from the torchrun environment, or a group of one for a plain `python` run.

Every training job has a process group, so that FSDP2 wraps the model at any world size and its
`MixedPrecisionPolicy` is the one place that sets the compute dtype (as torchtitan applies FSDP2
at world size 1 too). torchtitan is always launched by torchrun; a plain `python` process here
makes its group of one itself, on an in-memory store, so it needs no port or torchrun variables.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_GLOO_DRAIN_S = 0.25  # seconds a process that used gloo waits at exit for its worker threads
_gloo_drain_registered = False


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _let_gloo_workers_finish() -> None:
    """At exit, before the interpreter finalizes: sleep, which hands the GIL to gloo's worker
    threads. One frees a finished collective (and the tensors it kept, some made in Python) after
    its waiter has returned, and freeing a Python tensor takes the GIL; asked for while the
    interpreter finalizes, it aborts the process ("terminate called without an active exception",
    SIGABRT after a finished run; a CPU test job's core dump: the worker in ~AsyncBarrierWork →
    ~AsyncAllgatherWork → decref_pyobject)."""
    time.sleep(_GLOO_DRAIN_S)


def init_distributed(device_name: str) -> DistInfo:
    """The process group (nccl on GPU, gloo on CPU): torchrun's processes when launched by it
    (WORLD_SIZE set), else this process alone. An existing group is kept."""
    global _gloo_drain_registered
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_name, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        if backend == "gloo" and not _gloo_drain_registered:
            atexit.register(_let_gloo_workers_finish)
            _gloo_drain_registered = True
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, device_id=device_id)
        else:
            dist.init_process_group(backend=backend, device_id=device_id, store=dist.HashStore(), rank=0,
                                    world_size=1)
    world_size = dist.get_world_size()
    # Without torchrun's variable (a process group made otherwise), all processes are one node.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return DistInfo(dist.get_rank(), local_rank, world_size, device, local_world_size)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def decide_on_rank0(decide: Callable[[], T], error: type[Exception]) -> T:
    """Run `decide` on rank 0 only (one scan of the file system, one set of messages) and give its
    answer to every rank. If it raises, every rank raises `error` with its message, so no rank
    waits for an answer that never comes."""
    answer: list = [None, None]  # result, error message
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            answer[0] = decide()
        except error as raised:
            answer[1] = str(raised)
        except Exception as raised:  # an OSError, say: the other ranks must not hang
            answer[1] = f"{type(raised).__name__}: {raised}"
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise error(answer[1])
    return answer[0]


def first_error_of_any_rank(message: str | None) -> str | None:
    """This rank's error message or None, gathered from every rank: the first rank's error, if any
    rank had one (every rank gets the same answer)."""
    messages = [message]
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_max_(value: torch.Tensor) -> None:
    """`value` becomes its elementwise maximum over all ranks, in place (NaN wins)."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
