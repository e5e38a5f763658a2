"""Device-side checks on a kernel's result, read by a training step at its end instead of one host
sync each.

A kernel whose fast path is exact only in a range (the LM head's scaled-exp pipeline, up to a
per-row loss of `cute.head.SCALED_EXP_MAX_LOSS` nats) checks its result on the device and asks
`holds` whether to keep it. Outside `deferred_checks()` that reads the check at once (a host sync)
and the kernel falls back to its exact path when it fails. Inside, `holds` keeps the fast result
and records the check: the trainer reads the step's failures with its loss (the one wait it
makes anyway), skips that step's update on the device and computes the step again outside the
context. So a step waits for the device once, not once per micro-batch, and computes what it
would have computed with every check read at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class DeferredChecks:
    """The checks recorded inside one `deferred_checks()` context."""

    def __init__(self) -> None:
        self._failed: torch.Tensor | None = None

    def record(self, ok: torch.Tensor) -> None:
        failed = ~ok
        self._failed = failed if self._failed is None else self._failed | failed

    def failed(self, like: torch.Tensor) -> torch.Tensor:
        """1.0 if any recorded check failed, else 0.0: a 0-d float32 tensor on `like`'s device, in
        the stream's order (no sync)."""
        if self._failed is None:
            return like.new_zeros((), dtype=torch.float32)
        return self._failed.to(device=like.device, dtype=torch.float32)


_active: DeferredChecks | None = None


@contextlib.contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Inside, `holds` records each check instead of reading it; the yielded object has them."""
    global _active
    if _active is not None:
        raise RuntimeError("deferred_checks() is already active: the contexts do not nest")
    _active = DeferredChecks()
    try:
        yield _active
    finally:
        _active = None


def holds(ok: torch.Tensor) -> bool:
    """Whether the device-side check `ok` (a 0-d bool tensor) holds: read now (a host sync), or,
    inside `deferred_checks()`, taken to hold and recorded for the step's end."""
    if _active is None:
        return bool(ok)
    _active.record(ok)
    return True
