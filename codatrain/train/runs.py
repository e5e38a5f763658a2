"""Training jobs launched as subprocesses, and the summaries of their metrics: what the benchmark
scripts (scripts/bench_train.py, bench_scaling.py, compare_training.py) share.

A job is `scripts/train.py` of this checkout (the package is installed editable from it), under
torchrun even for one process; it runs as every training job does, a plain `python` one too: FSDP2
with its mixed-precision policy (bf16 compute on a GPU, fp32 master weights).
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codatrain.train.logger import METRICS_FILE, read_records

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "scripts" / "train.py"

# Block implementations compared by the benchmarks: name → scripts/train.py overrides.
VARIANTS: dict[str, list[str]] = {
    "eager": ["block=eager"],
    "compile": ["block=eager", "train.compile=true"],
    "coda": ["block=coda"],
    "coda_compile": ["block=coda", "train.compile=true"],
    "coda_reference": ["block=coda", "block.backend=reference"],
    # CODA with FP8 layer GEMMs (e4m3/e5m2, per-tensor delayed scaling; head and attention in bf16).
    "coda_fp8": ["block=coda", "block.precision=fp8"],
    # The FP8 peer: the eager model, torch.compile and torchao's float8 training (LM head in bf16).
    "compile_fp8_tensorwise": ["block=eager", "train.compile=true", "train.float8=tensorwise"],
    "compile_fp8_rowwise": ["block=eager", "train.compile=true", "train.float8=rowwise"],
    "liger": ["block=liger"],  # the eager model on liger-kernel's fused RMSNorm, SwiGLU, RoPE, head + loss
}


@dataclass(frozen=True)
class Launch:
    """Where torchrun starts a job: `nproc_per_node` processes on this machine alone (--standalone),
    or as many on each of `nnodes` nodes that meet at the c10d rendezvous `rdzv_endpoint` (host:port)
    under `rdzv_id`, every node running the same command (README, "Several nodes")."""

    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    def __post_init__(self) -> None:
        if self.nnodes > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            raise ValueError(f"a launch on {self.nnodes} nodes needs a rendezvous endpoint and id")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def torchrun_options(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone", f"--nproc-per-node={self.nproc_per_node}"]
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]


def train_command(launch: Launch, overrides: list[str], run_dir: Path) -> list[str]:
    """scripts/train.py under torchrun as `launch` says, every step logged. Of two values for one
    key, the later override wins."""
    return [
        sys.executable, "-m", "torch.distributed.run", *launch.torchrun_options(), str(TRAIN_SCRIPT),
        *overrides, "train.log_every=1", "train.val_every=0", "train.progress=false",
        f"train.run_dir={run_dir}",
    ]


def train_job(launch: Launch, overrides: list[str], run_dir: Path) -> int:
    """`train_command` run into run_dir, its metrics file started afresh; returns the exit code."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    cmd = train_command(launch, overrides, run_dir)
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=os.environ.copy()).returncode


def run_variant(name: str, overrides: list[str], steps: int, run_dir: Path, launch: Launch,
                profile: int) -> dict[str, Any]:
    """`steps` timed training steps of variant `name` (then `profile` profiled ones) into run_dir:
    {"variant", "records", "profile": the profiler summary or None}, or {"variant", "error"}."""
    # Profiled steps (and the profiler's warm-up step) come after the timed ones.
    total_steps = steps + profile + 1 if profile else steps
    # One micro-batch per process and step unless the overrides say otherwise: a step of the
    # model's recipe batch (millions of tokens) would make every timed step minutes long.
    code = train_job(launch, [
        *VARIANTS[name], "train.tokens_per_step=null", *overrides, f"train.steps={total_steps}",
        f"train.profile_steps={profile}", f"train.profile_skip={steps}", "checkpoint.at_end=false",
        "checkpoint.resume=none",
    ], run_dir)
    if code != 0:
        return {"variant": name, "error": f"exit code {code}"}
    profile_summary = run_dir / "profile" / "summary_rank0.txt"
    return {"variant": name, "records": [r for r in read_records(run_dir) if r["step"] <= steps],
            "profile": str(profile_summary) if profile_summary.exists() else None}


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Medians over the steps after `warmup` of a `run_variant` result (errors pass through)."""
    if "error" in result:
        return result
    timed = [r for r in result["records"] if r["step"] > warmup and "step_time_s" in r]
    if not timed:
        return {"variant": result["variant"], "error": "no steps after warm-up"}

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    resident = [r["resident_memory_gib"] for r in timed if r.get("resident_memory_gib") is not None]
    peak = max(r["peak_memory_gib"] for r in timed)
    reserved = [r["reserved_memory_gib"] for r in timed if r.get("reserved_memory_gib") is not None]
    # The allocator counts its retries from the process start: the timed steps' own are the count at
    # the last timed step less the count at the last warm-up step.
    warm = [r for r in result["records"] if r["step"] <= warmup and "step_time_s" in r]
    retries = timed[-1].get("alloc_retries")
    if retries is not None and warm:
        retries -= warm[-1].get("alloc_retries") or 0
    return {
        "variant": result["variant"],
        "timed_steps": len(timed),
        "step_time_s": median("step_time_s"),
        "tokens_per_s_per_device": median("tokens_per_s_per_device"),
        "tflops_per_device": median("tflops_per_device"),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": peak,
        "resident_memory_gib": statistics.median(resident) if resident else None,
        "step_memory_gib": peak - statistics.median(resident) if resident else None,
        "reserved_memory_gib": max(reserved) if reserved else None,
        "alloc_retries": retries,
        "data_time_s": median("data_time_s"),
        "final_loss": timed[-1]["loss"],
        "losses": {r["step"]: r["loss"] for r in result["records"]},
        "profile": result["profile"],
    }


def software_versions() -> dict[str, str | None]:
    """torch, CUDA, the GPU and the kernel packages, for a benchmark report."""
    import torch

    versions: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    versions["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    for package in ("nvidia-cutlass-dsl", "quack-kernels", "flash-attn-4", "liger-kernel"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
