"""Optional torch.profiler capture of a few training steps, to name where the time goes."""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Profiles `steps` optimizer steps after skipping `skip` (and one warm-up step), then writes
    `<run_dir>/profile/summary_rank<r>.txt` (ops sorted by their own device time, or CPU time on
    CPU) and a Chrome trace beside it. Does nothing when `steps` is 0.

    On a GPU the warm-up step also records the caching allocator's history (every allocation with
    its Python stack), written as `memory_rank<r>.pickle`: where in the step the peak falls and
    what is alive there (`scripts/memory_report.py --snapshot`). It is the warm-up step's so that
    the recording's host cost stays out of the profiled steps. The GPU is synchronized as the
    profiled steps begin and end, so their trace holds their own kernels and no others (its first
    few launches may then show the GPU waiting for the host, which a steady step hides)."""

    def __init__(self, run_dir: str, steps: int, skip: int, rank: int, device: torch.device) -> None:
        self.out_dir, self.rank, self.on_gpu = os.path.join(run_dir, "profile"), rank, device.type == "cuda"
        self.profiler = None
        self.steps_done, self.skip, self.steps = 0, skip, steps
        if steps > 0:
            if self.on_gpu and skip == 0:
                self._record_memory()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
            # Shapes let scripts/profile_breakdown.py rate each cuBLAS GEMM in TFLOP/s.
            self.profiler = profile(
                activities=activities,
                record_shapes=True,
                schedule=schedule(wait=skip, warmup=1, active=steps, repeat=1),
                on_trace_ready=self._write,
            )
            self.profiler.start()

    def step(self) -> None:
        if self.profiler is None:
            return
        if self.on_gpu and self.steps_done == self.skip:
            # The warm-up step ends: its memory history is written and its kernels finish before
            # the profiled steps begin, so that neither the dump's host time (GPU idle) nor the
            # warm-up step's queued kernels (its optimizer, say) land in their trace.
            self._dump_memory()
            torch.cuda.synchronize()
        elif self.on_gpu and self.steps_done == self.skip + self.steps:
            # The last profiled step's kernels finish inside the trace.
            torch.cuda.synchronize()
        self.profiler.step()
        self.steps_done += 1
        if self.on_gpu and self.steps_done == self.skip:
            self._record_memory()

    def _record_memory(self) -> None:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)

    def _dump_memory(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        torch.cuda.memory._dump_snapshot(os.path.join(self.out_dir, f"memory_rank{self.rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def _write(self, prof: profile) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        sort_by = "self_device_time_total" if self.on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=110)
        with open(os.path.join(self.out_dir, f"summary_rank{self.rank}.txt"), "w") as f:
            f.write(table)
        prof.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
