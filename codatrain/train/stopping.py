"""Stopping a run on Ctrl-C or SIGTERM (what Slurm sends before preemption) at a step boundary.

A handler only records the signal: the step in flight finishes, then every rank learns at once
whether any rank was signalled (one all-reduce of two flags per step, so all ranks stop after the
same step and take part in the same final checkpoint save). Repeated signals are ignored: torchrun
forwards the one it receives to workers that Slurm or the terminal signalled already.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch

from codatrain.train.distributed import all_reduce_sum

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """`with StopSignals(device) as stop:` around the training loop; `stop.agreed()` at each step
    boundary returns the signal's name ("SIGTERM") once any rank received one, the same on every
    rank, else None. Outside the block the previous handlers are back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received = torch.zeros(len(STOP_SIGNALS))
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

    def agreed(self) -> str | None:
        received = all_reduce_sum(self.received.to(self.device)).cpu()
        for signum, count in zip(reversed(STOP_SIGNALS), reversed(received.tolist()), strict=True):
            if count > 0:  # SIGTERM names the stop when both arrived: it is the scheduler's
                return signum.name
        return None
