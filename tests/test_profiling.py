"""train/profiling.py's StepProfiler: on a GPU the memory history is written, and the warm-up step's
kernels finish, before the profiled steps begin (else the dump's host time and the warm-up step's
queued kernels land in their trace). Checked on CPU by recording the order of the GPU-only calls."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerAction

from codatrain.train.profiling import StepProfiler


def test_the_memory_dump_and_syncs_fall_outside_the_profiled_steps(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(StepProfiler, "_record_memory", lambda self: calls.append("record"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    profiler = StepProfiler(str(tmp_path), steps=2, skip=1, rank=0, device=torch.device("cpu"))
    profiler.on_gpu = True  # the GPU-only calls, mocked above and here
    monkeypatch.setattr(StepProfiler, "_dump_memory",
                        lambda self: calls.append(f"dump in {self.profiler.current_action.name}"))
    actions = []
    for _ in range(4):  # skip, warm-up, two profiled steps
        torch.ones(8).sum()
        actions.append(profiler.profiler.current_action if profiler.profiler else None)
        profiler.step()
    profiler.stop()
    assert actions == [ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD,
                       ProfilerAction.RECORD_AND_SAVE]
    # Recording starts with the warm-up step; the dump and a sync end it, before the profiled steps;
    # a sync ends the last one, before its trace is written.
    assert calls == ["record", f"dump in {ProfilerAction.WARMUP.name}", "sync", "sync"]
    assert (tmp_path / "profile" / "summary_rank0.txt").exists()
