"""A training job's side of the kernel cache (`codatrain.kernels.cache` owns the directory).

Before anything imports a CuTeDSL library, `KernelCache` points QuACK and FA4 at
`kernels.cache_dir`; once the run plan has resolved the block, `ensure` checks that the cache holds
this run's kernels (the plan's `kernel_shapes`) and rebuilds it or stops, as `kernels.on_stale`
says. After the first optimizer step, `first_step_report` says how startup went.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed

from codatrain.kernels.cache import KernelShapes, ensure_cache, point_libraries_at
from codatrain.train.distributed import DistInfo


def process_age_s() -> float | None:
    """Seconds since this process started (from Linux /proc), or None where that is unknown."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    # Field 22 of /proc/<pid>/stat is the start time in clock ticks since boot; fields are
    # counted after the parenthesised command name, which may itself contain spaces.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class KernelCache:
    """A training job's view of `kernels.cache_dir` (None: no cache; always None off CUDA)."""

    def __init__(self, cache_dir: str | Path | None, dist: DistInfo) -> None:
        """Point QuACK and FA4 at `cache_dir`. Call it before anything imports them (resolving
        ``auto`` on a GPU does)."""
        self.dist, self.opened = dist, time.time()
        self.cache_dir = Path(cache_dir).resolve() if cache_dir and dist.device.type == "cuda" else None
        if self.cache_dir is not None:
            point_libraries_at(self.cache_dir)

    def ensure(self, shapes: KernelShapes, on_stale: str) -> None:
        """Make sure the cache holds the kernels of `shapes` (`ensure_cache`).

        Local rank 0 of each node rebuilds a stale cache while the other ranks wait; every rank
        checks the same files, so with on_stale=fail all of them stop.
        """
        if not shapes.any:
            self.cache_dir = None  # the run launches no CuTeDSL kernel: it uses no cache
        if self.cache_dir is None:
            return
        dist = self.dist
        ensure_cache(
            self.cache_dir, shapes, on_stale=on_stale,
            num_sms=torch.cuda.get_device_properties(dist.device).multi_processor_count,
            build=dist.local_rank == 0, log=print if dist.is_main else _quiet,
        )
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def first_step_report(self) -> str:
        """One line for after the first optimizer step: the time since the process started, and
        how many CuTeDSL kernels it loaded from disk and how many it had to compile."""
        age = process_age_s()
        started = time.time() - age if age is not None else self.opened
        since = "process start" if age is not None else "trainer setup"
        line = f"time to first step: {time.time() - started:.1f} s from {since}"
        if "codatrain.kernels.cute" in sys.modules:
            from codatrain.kernels.cute.pins import kernel_counts

            loaded, compiled, names = kernel_counts(started)
            where = f" from {self.cache_dir}" if self.cache_dir is not None else ""
            line += f" | CuTeDSL kernels: {loaded} loaded{where}, {compiled} compiled"
            if names:
                line += f" ({', '.join(names)})"
        return line


def _quiet(message: str) -> None:
    del message  # ranks other than 0 do not log
