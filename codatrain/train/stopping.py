"""Stopping a run on Ctrl-C or SIGTERM (what Slurm sends before preemption) at a step boundary.

A handler only records the signal: the step in flight finishes, then every rank learns at once
whether any rank was signalled, so all ranks stop after the same step and take part in the same
final checkpoint save. The two flags travel in the step's own all-reduce of its loss (the trainer
adds `on_device()` to it and hands the sums to `name`): no collective and no wait for the device of
their own. Repeated signals are ignored: torchrun forwards the one it receives to workers that Slurm
or the terminal signalled already.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType

import torch

from codatrain.train.distributed import all_reduce_sum

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """`with StopSignals(device) as stop:` around the training loop. `stop.agreed()` (a collective
    that waits for the device; before the first step) and `stop.name(sums)` (of `on_device()`
    summed over the ranks in a step) return the signal's name ("SIGTERM") once any rank received
    one, the same on every rank, else None. Outside the block the previous handlers are back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Pinned on a GPU run, so copying it to the device does not wait for the device's queue.
        self.received = torch.zeros(len(STOP_SIGNALS), pin_memory=device.type == "cuda")
        self.previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received[STOP_SIGNALS.index(signal.Signals(signum))] = 1

    def on_device(self) -> torch.Tensor:
        """This rank's flags (one per signal in STOP_SIGNALS, 1. once received) on the device."""
        return self.received.to(self.device, non_blocking=True)

    def agreed(self) -> str | None:
        return self.name(all_reduce_sum(self.on_device()).tolist())

    @staticmethod
    def name(sums: Sequence[float]) -> str | None:
        """The stop's name from the flags summed over the ranks."""
        for signum, count in zip(reversed(STOP_SIGNALS), reversed(sums), strict=True):
            if count > 0:  # SIGTERM names the stop when both arrived: it is the scheduler's
                return signum.name
        return None
