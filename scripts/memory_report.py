"""Peak memory of one training micro-step of block=coda on the cute stages, counted on any machine,
GPU or not: the model runs its forward and backward on fake tensors (each stage compiles or loads
its kernels for sm_90a and launches nothing) while a dispatch mode counts the bytes of every live
tensor storage made in the step. Prints the peak (activations, gradients and temporaries: what the
step adds to the parameters and optimizer state), where in the step it falls, the forward's and
the backward's own peaks, and the largest tensors alive at the step's peak with the code that made
them. At llama3_1b 4×8192 the count put FP8 CODA's peak 0.41 GiB above bf16 CODA's, as the GPU
measured (0.42 GiB), and later its backward's 0.198 GiB above (the GPU: 0.20; docs/benchmarks.md).

    python scripts/memory_report.py model=llama3_1b data=synthetic data.seq_len=8192 \\
        train.micro_batch_size=4 [block.precision=fp8] [--top 20] [--json report.json]

Takes the overrides of scripts/train.py (block defaults to coda). The kernels compile into a
temporary cache unless kernels.cache_dir names one (a minute or two on two cores the first time).

What the GPU itself holds (allocator rounding, library workspaces, the optimizer's step) the count
cannot see. A profiled GPU run records it: `train.profile_steps=1` (or `bench_train.py --profile
1`) writes the caching allocator's history of one whole step to profile/memory_rank0.pickle, and

    python scripts/memory_report.py --snapshot runs/<run>/profile/memory_rank0.pickle [--top 20]

replays it on any machine: the step's peak of allocated bytes, the allocation that reached it, and
the allocations alive there, each with the codatrain frames that made it, and where the allocator
released its cache to retry an allocation (a step at the card's capacity: see `alloc_retries` in
the run's metrics).
"""

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from hydra.errors import ConfigCompositionException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from codatrain.kernels.cache import HOPPER_SMS, KernelShapes, compile_env
from codatrain.model.config import LlamaConfig
from codatrain.train.plan import target_plan


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages made under it while they live; keeps the peak and
    the storages alive at it, each with the op and the codatrain frames that made it."""

    def __init__(self, phase: str = "") -> None:
        super().__init__()
        self.phase = phase  # a label for the allocations that follow (forward, backward)
        self.live: dict[int, tuple[int, str, str, str]] = {}  # storage → (bytes, dtype, shape, maker)
        self._refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0
        self.peak_maker = ""
        self.phase_peaks: dict[str, tuple[int, str]] = {}  # phase → (its own peak, where)
        self.at_peak: list[tuple[int, str, str, str]] = []

    def _maker(self, op: Any) -> str:
        frames = [f for f in traceback.extract_stack()[:-2] if f"{os.sep}codatrain{os.sep}" in f.filename]
        return f"{self.phase} {op.__name__} @ " + " < ".join(f"{f.name}:{f.lineno}" for f in frames[::-1][:3])

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's)
        out = op(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            self.live[key] = (storage.nbytes(), str(tensor.dtype).removeprefix("torch."),
                              "×".join(map(str, tensor.shape)), self._maker(op))
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._release(key))
            self.current += storage.nbytes()
            # A phase's peak is at most the step's: only a new one of the phase's needs the check.
            if self.current > self.phase_peaks.get(self.phase, (0, ""))[0]:
                self._drop_released()
            if self.current > self.phase_peaks.get(self.phase, (0, ""))[0]:
                self.phase_peaks[self.phase] = (self.current, self.live[key][3])
            if self.current > self.peak:
                self.peak, self.peak_maker = self.current, self.live[key][3]
                self.at_peak = list(self.live.values())
        return out

    def _drop_released(self) -> None:
        """Stop counting the storages whose memory was freed while tensors still hold them
        (`untyped_storage().resize_(0)`, which no op reports), before a new peak is taken."""
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is not None and storage.nbytes() == 0 and self.live[key][0]:
                self._release(key)

    def _release(self, key: int) -> None:
        self._refs.pop(key, None)
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]


def count_step(cfg: LlamaConfig, shapes: KernelShapes) -> LiveBytes:
    """In a compile process: one micro-step of the cute CODA model of `cfg` on fake tensors of
    `shapes`' batch, after a first one (with FP8: a run's first step, current scaling; the counted
    one scales from the amax history, as every later step)."""
    from codatrain.train.fake_step import fake_cute_model

    with fake_cute_model(cfg, shapes) as (model, tokens):
        model(tokens, tokens).backward()
        if model.fp8_scaling is not None:
            model.fp8_scaling.commit_step()
        for parameter in model.parameters():
            parameter.grad = None
        counter = LiveBytes("forward")
        with counter:
            loss = model(tokens, tokens)
            counter.phase = "backward"
            loss.backward()
    return counter


def _frames(frames: list[dict[str, Any]]) -> str:
    """The innermost codatrain frames of an allocator stack, else its innermost Python frame."""
    ours = [f for f in frames if f"{os.sep}codatrain{os.sep}" in f["filename"]]
    shown = ours[:3] or frames[:1]
    return " < ".join(f"{f['name']}:{f['line']}" for f in shown) or "(no Python frame)"


def replay_snapshot(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """The peak of allocated bytes over a CUDA allocator history (`torch.cuda.memory._snapshot()`
    taken while `_record_memory_history` ran) and what was alive there.

    The history starts after the parameters and optimizer state exist: what was allocated before it
    (`before_bytes`) is what is allocated at the end less the history's net allocations. A block
    counts from its `alloc` to its `free_completed` (a free that waits on another stream's use holds
    its memory until then, as the allocator's own statistics do)."""
    trace = snapshot["device_traces"][device]
    at_end = sum(block["size"] for segment in snapshot["segments"] if segment["device"] == device
                 for block in segment["blocks"] if block["state"].startswith("active"))
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"]
              for e in trace if e["action"] in ("alloc", "free_completed"))
    before = at_end - net
    current = peak = before
    peak_index = -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif event["action"] == "free_completed":
            current -= event["size"]
    live: dict[int, dict[str, Any]] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    alive = sorted(({"bytes": e["size"], "made_by": _frames(e.get("frames", []))} for e in live.values()),
                   key=lambda entry: -entry["bytes"])
    peak_at = _frames(trace[peak_index].get("frames", [])) if peak_index >= 0 else "(before the history)"
    return {"before_bytes": before, "peak_bytes": peak, "peak_at": peak_at, "alive": alive}


def cache_releases(snapshot: dict[str, Any], device: int = 0) -> list[dict[str, Any]]:
    """Where the caching allocator released cached segments in the history: each run of
    `segment_free` events, which (with no `empty_cache` in the step) is an allocation that found no
    free device memory and was retried after the cache was released (`num_alloc_retries`), a device
    synchronization. Each: the segments and bytes released, and the allocation that came next (its
    size and the codatrain frames that made it)."""
    trace, releases = snapshot["device_traces"][device], []
    for index, event in enumerate(trace):
        if event["action"] != "segment_free" or (index and trace[index - 1]["action"] == "segment_free"):
            continue
        end = index
        while end < len(trace) and trace[end]["action"] == "segment_free":
            end += 1
        then = next((e for e in trace[end:] if e["action"] == "alloc"), None)
        releases.append({"segments": end - index, "bytes": sum(e["size"] for e in trace[index:end]),
                         "then_bytes": None if then is None else then["size"],
                         "then_at": "(none)" if then is None else _frames(then.get("frames", []))})
    return releases


def snapshot_report(path: Path, top: int) -> None:
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    report = replay_snapshot(snapshot)
    print(f"{path}: peak {report['peak_bytes'] / 2**30:.3f} GiB allocated, of which "
          f"{report['before_bytes'] / 2**30:.3f} GiB before the recorded step (parameters, optimizer "
          f"state, caches); reached at {report['peak_at']}")
    groups: dict[str, list[int]] = {}
    for entry in report["alive"]:
        groups.setdefault(entry["made_by"], []).append(entry["bytes"])
    print(f"  alive at the peak, made in the step ({len(report['alive'])} blocks), by maker:")
    for maker, sizes in sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"  {sum(sizes) / 2**20:10.1f} MiB  {len(sizes):4d} × (largest {max(sizes) / 2**20:.1f})"
              f"  {maker}")
    releases = cache_releases(snapshot)
    print(f"  cache releases in the step (an allocation retried after freeing the cache: a device "
          f"synchronization each): {len(releases)}")
    for release in releases:
        then = "nothing" if release["then_bytes"] is None else f"{release['then_bytes'] / 2**20:.1f} MiB"
        print(f"  {release['bytes'] / 2**20:10.1f} MiB in {release['segments']} segments released, then "
              f"{then} at {release['then_at']}")


def main(argv: list[str]) -> int | str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides, as for scripts/train.py")
    parser.add_argument("--top", type=int, default=15, help="tensors alive at the peak to list")
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument("--snapshot", type=Path,
                        help="instead: replay a GPU step's allocator history (profile/memory_rank0.pickle)")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # the compile process's own argument
    args = parser.parse_intermixed_args(argv)
    if args.job:
        job = json.loads(args.job)
        counter = count_step(LlamaConfig(**job["model"]), KernelShapes(**job["shapes"]))
        alive = sorted(counter.at_peak, key=lambda entry: -entry[0])
        print(json.dumps({"peak_bytes": counter.peak, "peak_at": counter.peak_maker,
                          "phase_peaks": counter.phase_peaks,
                          "alive": [dict(zip(("bytes", "dtype", "shape", "made_by"), e, strict=True))
                                    for e in alive]}))
        return 0
    if args.snapshot:
        snapshot_report(args.snapshot, args.top)
        return 0

    try:
        plan = target_plan(args.overrides)
    except (ValueError, ConfigCompositionException) as error:
        return f"error: {error}"
    if not plan.kernel_shapes.stages:
        return f"error: block={plan.block.describe()} does not run the cute stages"
    job = json.dumps({"model": dataclasses.asdict(plan.model_cfg),
                      "shapes": dataclasses.asdict(plan.kernel_shapes)})
    with tempfile.TemporaryDirectory() as tmp:
        cache = plan.run.kernels.cache_dir or Path(tmp)
        proc = subprocess.run([sys.executable, __file__, "--job", job],
                              env=compile_env(Path(cache), HOPPER_SMS), capture_output=True, text=True)
    if proc.returncode != 0:
        return f"error: the counting process failed:\n{proc.stderr[-5000:]}"
    report = json.loads(proc.stdout.splitlines()[-1])
    shapes = plan.kernel_shapes
    print(f"{plan.block.describe()}, {plan.model_cfg.n_layers} layers, micro-batch {shapes.batch} × "
          f"{shapes.seq_len}: peak {report['peak_bytes'] / 2**30:.3f} GiB above the parameters and "
          f"optimizer state, at {report['peak_at']}")
    for phase, (peak_bytes, peak_at) in report["phase_peaks"].items():
        print(f"  the {phase}'s own peak: {peak_bytes / 2**30:.3f} GiB, at {peak_at}")
    for entry in report["alive"][:args.top]:
        print(f"  {entry['bytes'] / 2**20:10.1f} MiB  {entry['dtype']:>13} {entry['shape']:>16}  "
              f"{entry['made_by']}")
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
