"""GPU time per training step by kernel family, from the profile summaries `train.profile_steps`
writes (<run_dir>/profile/summary_rank0.txt, a torch.profiler table sorted by self device time).

    python scripts/profile_breakdown.py docs/bench/profiles/llama3_1b_coda.txt \
        docs/bench/profiles/llama3_1b_compile.txt

Only device kernels and copies count (operator rows such as `aten::mm` or `_LayerFnBackward` hold
the same time again); the table lists the top rows only, so the families are summed over what it
lists and shown beside the profile's total. Times are divided by the number of profiled steps.

The GPU's idle time within the profiled steps (a step slower than its kernels: the host enqueues
behind the GPU, or waits on it) comes from the Chrome trace beside the summary:

    python scripts/profile_breakdown.py --gaps runs/prof/coda_fp8/profile/trace_rank0.json

sums the gaps between device activity per step and names the host operators whose launches ended
them, the largest first; `--kernels TRACE` lists the longest kernels per step, each split by the
host operators that launched it (to line up two variants' GEMMs of the same shape), with the rate
in TFLOP/s of those launched by a matrix product whose shapes the profile recorded (cuBLAS GEMMs)
and the share of each kernel's time during which another stream's kernels or copies ran.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from pathlib import Path

# First match wins: (family, pattern on the kernel name).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("attention (FA4 / cuDNN SDPA)", r"flash|cudnn|fmha"),
    # The head before issue 16 (LSE, CE-backward, final-norm dgrad and wgrad GEMMs) and after it
    # (QuACK's RMSNorm, its linear cross-entropy's GEMMs, CE row kernel and Triton glue); the
    # layers' plain dgrad/wgrad GEMMs run in cuBLAS, so QuACK's default-epilogue GEMM is the head's.
    ("LM head, CODA", r"quack.*(lse|ce_bwd|rms_bwd_epi|default_epi|scaled_exp|vscale|identity_epi|rmsnorm"
                      r"|cross_entropy)|^_lce_glue"),
    ("layer GEMM + epilogue, CODA", r"quack"),
    ("GEMM, cuBLAS", r"^nvjet|^sm90_xmma|gemm"),
    ("optimizer + clipping (foreach)", r"multi_tensor"),
    ("softmax / cross-entropy", r"SoftMax"),
    ("triton fused elementwise", r"^triton_"),
    ("CODA row-wise kernels", r"codatrain"),
    ("copies, casts, other elementwise", r"."),
)
KERNEL = re.compile(r"^(kernel_|nvjet|sm90_|cudnn|void |triton_|_lce_glue|Memcpy|Memset|cutlass)")


def family_of(kernel: str) -> str:
    return next(f for f, pattern in FAMILIES if re.search(pattern, kernel))


def seconds(text: str) -> float:
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"not a time: {text!r}")


def breakdown(summary: str) -> tuple[dict[str, float], float, int]:
    """({family: ms per step}, the profile's total device ms per step, profiled steps)."""
    lines = summary.splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    self_device, calls = header.index("Self CUDA"), header.index("# of Calls")
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[3:]]
    rows = [r for r in rows if len(r) == len(header) and not r[0].startswith("-")]
    steps = next(int(r[calls]) for r in rows if r[0] == "ProfilerStep*")
    total = next(line for line in lines if line.startswith("Self CUDA time total"))
    families: dict[str, float] = {}
    seen = set()
    for row in rows:
        name = row[0]
        # Triton kernels appear twice, as the launching op and as the kernel, with equal times.
        if not KERNEL.match(name) or (name, row[self_device]) in seen:
            continue
        seen.add((name, row[self_device]))
        family = family_of(name)
        families[family] = families.get(family, 0.0) + 1e3 * seconds(row[self_device]) / steps
    return families, 1e3 * seconds(total.split(":")[1].strip()) / steps, steps


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def _profiled_steps(events: list[dict]) -> int:
    steps = sum(1 for e in events
                if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    if steps == 0:
        raise ValueError("no ProfilerStep annotations")
    return steps


def _device_activity(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"),
                  key=lambda e: e["ts"])


def _launching_ops(events: list[dict]):
    """A function giving the host operators (cpu_op events) open at the launch of a device
    activity, outermost first ([] for a bare runtime call or an unknown launch)."""
    # cuBLAS launches its kernels through the driver API (cuLaunchKernelEx), the rest through the runtime.
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ops: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            ops.setdefault(e["tid"], []).append(e)
    starts = {}
    for tid, tid_ops in ops.items():
        tid_ops.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in tid_ops]

    def open_ops(activity: dict) -> list[dict]:
        launch = launches.get(activity.get("args", {}).get("correlation"))
        if launch is None or launch["tid"] not in ops:
            return []
        t, tid_ops = launch["ts"], ops[launch["tid"]]
        # The operators open at the launch: the outermost is the earliest-starting one that still covers it.
        i = bisect.bisect_right(starts[launch["tid"]], t)
        return [op for op in tid_ops[max(0, i - 5000):i] if op["ts"] + op["dur"] >= t]

    return open_ops


def _operator_name(covering: list[dict]) -> str:
    """"outermost › innermost" of the operators open at a launch, "(no operator)" for none."""
    if not covering:
        return "(no operator)"
    outer, inner = covering[0]["name"], covering[-1]["name"]
    return outer if outer == inner else f"{outer} › {inner}"


def _launcher_names(events: list[dict]):
    """A function naming the host operators open at the launch of a device activity."""
    open_ops = _launching_ops(events)
    return lambda activity: _operator_name(open_ops(activity))


# The matrix products whose FLOPs follow from their input shapes (the profiler's "Input Dims",
# recorded by `train.profile_steps`): the index of A (.., M, K) and B (.., K, N) among the inputs.
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::_scaled_mm": (0, 1), "aten::addmm": (1, 2)}


def matmul_flops(op: dict) -> float | None:
    """2·(batch·)M·K·N of a matrix-product operator event with recorded shapes, else None."""
    operands = MATMUL_OPERANDS.get(op["name"])
    dims = op.get("args", {}).get("Input Dims")
    if operands is None or not dims:
        return None
    a, b = dims[operands[0]], dims[operands[1]]
    if len(a) < 2 or len(b) < 2:
        return None
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def idle_gaps(trace: dict, min_gap_us: float = 5.0) -> tuple[float, int, dict[str, tuple[float, int]]]:
    """(GPU idle ms per profiled step, steps, {launching host operator: (idle ms per step, gaps)}):
    the gaps of at least `min_gap_us` between device activity from the first profiled step's first
    kernel to the last one's end, each charged to the host operators (cpu_op) open at the launch of
    the activity ending it, as "outermost › innermost" ("(no operator)" for a bare runtime call)."""
    events = trace["traceEvents"]
    steps = _profiled_steps(events)
    device = _device_activity(events)
    launcher = _launcher_names(events)
    idle, by_op = 0.0, {}
    busy_until = device[0]["ts"] + device[0]["dur"]
    for activity in device[1:]:
        gap = activity["ts"] - busy_until
        if gap >= min_gap_us:
            idle += gap
            name = launcher(activity)
            total, count = by_op.get(name, (0.0, 0))
            by_op[name] = (total + gap, count + 1)
        busy_until = max(busy_until, activity["ts"] + activity["dur"])
    per_step = {name: (us / 1e3 / steps, count) for name, (us, count) in by_op.items()}
    return idle / 1e3 / steps, steps, per_step


def _overlapped_us(device: list[dict]) -> list[float]:
    """For each device activity (sorted by start), the µs of it during which activity of another
    stream ran (any number of them counted once): a kernel slower in a step than alone may have
    been sharing the GPU."""
    longest = max((a["dur"] for a in device), default=0.0)
    starts = [a["ts"] for a in device]
    overlapped = []
    for activity in device:
        start, end, stream = activity["ts"], activity["ts"] + activity["dur"], activity["args"].get("stream")
        # Candidates start before this one ends and no more than the longest duration before it.
        lo, hi = bisect.bisect_left(starts, start - longest), bisect.bisect_left(starts, end)
        spans = sorted((max(start, other["ts"]), min(end, other["ts"] + other["dur"]))
                       for other in device[lo:hi] if other["args"].get("stream") != stream)
        covered, reached = 0.0, start
        for span_start, span_end in spans:
            if span_end > reached:
                covered += span_end - max(span_start, reached)
                reached = span_end
        overlapped.append(covered)
    return overlapped


def kernel_times(trace: dict) -> tuple[int, list[tuple[str, str, float, float, float | None, float]]]:
    """(steps, [(kernel name, launching host operators, ms per step, launches per step, TFLOP/s,
    overlapped share)]), the longest first: each kernel's time split by where it was launched from,
    so two variants' GEMMs of the same shape line up by operator (a forward stage, a dgrad, a weight
    gradient). TFLOP/s where every launch came from a matrix product with recorded shapes (cuBLAS
    GEMMs), else None; the overlapped share is the fraction of its time another stream ran."""
    events = trace["traceEvents"]
    steps = _profiled_steps(events)
    open_ops = _launching_ops(events)
    device = _device_activity(events)
    totals: dict[tuple[str, str], tuple[float, int, float | None, float]] = {}
    for activity, overlapped in zip(device, _overlapped_us(device), strict=True):
        covering = open_ops(activity)
        key = (activity["name"], _operator_name(covering))
        flops = matmul_flops(covering[-1]) if covering else None
        us, count, row_flops, row_overlapped = totals.get(key, (0.0, 0, 0.0, 0.0))
        totals[key] = (us + activity["dur"], count + 1,
                       None if row_flops is None or flops is None else row_flops + flops,
                       row_overlapped + overlapped)
    rows = [(name, op, us / 1e3 / steps, count / steps, None if flops is None else flops / us / 1e6,
             overlapped / us if us else 0.0)
            for (name, op), (us, count, flops, overlapped) in totals.items()]
    return steps, sorted(rows, key=lambda row: -row[2])


def _analyse_trace(path: Path, analyse):
    """analyse(the Chrome trace at path), or a one-line refusal naming the file."""
    try:
        return analyse(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise SystemExit(f"{path}: not a torch.profiler Chrome trace ({error!r})") from None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("summaries", nargs="*", type=Path)
    parser.add_argument("--gaps", nargs="+", type=Path, default=[], metavar="TRACE",
                        help="the GPU's idle time in these Chrome traces (trace_rank0.json)")
    parser.add_argument("--kernels", nargs="+", type=Path, default=[], metavar="TRACE",
                        help="the longest kernels in these Chrome traces, by launching operator")
    parser.add_argument("--top", type=int, default=15, help="host operators (kernels) to list per trace")
    args = parser.parse_args()
    for path in args.kernels:
        steps, rows = _analyse_trace(path, kernel_times)
        print(f"{path} ({steps} steps): the longest kernels, ms and launches per step, TFLOP/s of "
              "matrix products, % of the time another stream ran")
        for name, op, ms, count, tflops, overlapped in rows[: args.top]:
            rate = f"{tflops:6.0f}" if tflops is not None else " " * 6
            family = family_of(name)[:24]
            print(f"  {ms:8.2f} ms  {count:7.1f}  {rate}  {100 * overlapped:4.0f}%  {family:24s}  {name[:90]}"
                  f"  <- {op[:80]}")
    for path in args.gaps:
        idle, steps, by_op = _analyse_trace(path, idle_gaps)
        print(f"{path} ({steps} steps): GPU idle {idle:.2f} ms per step, in gaps ended by launches from")
        for name, (ms, count) in sorted(by_op.items(), key=lambda item: -item[1][0])[: args.top]:
            print(f"  {ms:8.2f} ms  {count / steps:7.1f} gaps  {name}")
    for path in args.summaries:
        try:
            families, total, steps = breakdown(path.read_text())
        except (OSError, ValueError, StopIteration, IndexError) as error:
            raise SystemExit(f"{path}: not a profile summary of scripts/train.py ({error!r})") from None
        print(f"{path} ({steps} steps; ms per step)")
        for family, ms in sorted(families.items(), key=lambda item: -item[1]):
            print(f"  {family:36s} {ms:8.1f}")
        print(f"  {'(the rows listed)':36s} {sum(families.values()):8.1f}   profile total {total:.1f}")


if __name__ == "__main__":
    main()
