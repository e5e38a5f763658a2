"""scripts/profile_breakdown.py on a profile summary of a real GPU run (docs/bench/profiles)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from profile_breakdown import breakdown  # noqa: E402

SUMMARY = REPO / "docs" / "bench" / "profiles" / "llama3_1b_coda.txt"


def test_families_of_a_coda_step():
    families, total, steps = breakdown(SUMMARY.read_text())
    assert steps == 2
    # The attention row of the summary: the FA4 backward and forward kernels, 2 steps.
    assert families["attention (FA4 / cuDNN SDPA)"] == pytest.approx((192.122 + 77.728 + 4.793 + 4.549) / 2)
    assert families["LM head, CODA"] == pytest.approx(
        (55.814 + 50.111 + 48.221 + 45.893) / 2  # final-norm dgrad, fp32 wgrad, CE backward, LSE
    )
    # Kernels only: the operator rows (aten::mm, the autograd Functions) would count time twice.
    assert sum(families.values()) <= total
    assert sum(families.values()) > 0.95 * total


def test_not_a_summary_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\nworld\n")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "profile_breakdown.py"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "not a profile summary" in proc.stderr


def test_gaps_charge_the_gpu_idle_time_to_the_host_operators_that_ended_it():
    """Two profiled steps: kernels at 0–10 µs, 30–40 (launched inside aten::mm inside Layer), 40–50
    (back to back: no gap) and 150–160 (launched by a bare runtime call). Idle: 20 µs charged to
    Layer › aten::mm, 100 µs to no operator; per step half of each."""
    from profile_breakdown import idle_gaps

    def kernel(ts, correlation):
        return {"ph": "X", "cat": "kernel", "name": f"k{ts}", "ts": ts, "dur": 10,
                "args": {"correlation": correlation}}

    def launch(ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 1,
                "args": {"correlation": correlation}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 80},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "ts": 80, "dur": 80},
        {"ph": "X", "cat": "cpu_op", "name": "Layer", "ts": 5, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 5, "tid": 1},
        kernel(0, 1), kernel(30, 2), kernel(40, 3), kernel(150, 4),
        launch(1, 1), launch(12, 2), launch(20, 3), launch(140, 4),
    ]
    idle, steps, by_op = idle_gaps({"traceEvents": events})
    assert steps == 2 and idle == pytest.approx(0.06)
    assert by_op == {"Layer › aten::mm": (pytest.approx(0.01), 1), "(no operator)": (pytest.approx(0.05), 1)}


def test_kernel_times_split_each_kernel_by_its_launching_operator():
    """Two steps: the same GEMM kernel launched from a forward stage twice and from a weight
    gradient once (that one through the driver API, as cuBLAS launches its kernels, by an aten::mm
    of recorded shapes); per step 15 µs and 1 launch from the first, 2.5 µs and 0.5 from the
    second, which runs 2·64·32·16 FLOP in 5 µs: 0.0131072 TFLOP/s."""
    from profile_breakdown import kernel_times

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "F3", "ts": 0, "dur": 200, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "wgrad", "ts": 150, "dur": 10, "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 154, "dur": 3, "tid": 2,
         "args": {"Input Dims": [[64, 32], [32, 16]]}},
    ]
    for i, (ts, dur, tid) in enumerate([(10, 10, 1), (110, 20, 1), (155, 5, 2)]):
        api = ("cuda_runtime", "cudaLaunchKernel") if tid == 1 else ("cuda_driver", "cuLaunchKernelEx")
        events.append({"ph": "X", "cat": api[0], "name": api[1], "ts": ts, "dur": 1,
                       "tid": tid, "args": {"correlation": i}})
        events.append({"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": ts + 2, "dur": dur,
                       "args": {"correlation": i}})
    steps, rows = kernel_times({"traceEvents": events})
    assert steps == 2
    wgrad_rate = pytest.approx(0.0131072)
    assert rows == [("nvjet_gemm", "F3", pytest.approx(0.015), 1.0, None, 0.0),
                    ("nvjet_gemm", "wgrad › aten::mm", pytest.approx(0.0025), 0.5, wgrad_rate, 0.0)]


def test_kernel_times_share_of_each_kernel_that_other_streams_overlap():
    """One step: GEMMs on stream 7 at 0–100 and 150–250 µs, a copy on stream 25 at 60–140 and a
    long copy on stream 26 at −10–190. The GEMMs are overlapped 100 + 40 of their 200 µs; the copy
    all 80 of its µs (by a GEMM and the long copy at once, counted once); the long copy 0–140 and
    150–190, 180 of its 200."""
    from profile_breakdown import kernel_times

    def activity(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": -10, "dur": 400},
        activity("gemm", 0, 100, 7), activity("gemm", 150, 100, 7),
        activity("copy", 60, 80, 25), activity("long copy", -10, 200, 26),
    ]
    _, rows = kernel_times({"traceEvents": events})
    share = {name: overlapped for name, _, _, _, _, overlapped in rows}
    assert share == {"gemm": pytest.approx(0.7), "copy": pytest.approx(1.0), "long copy": pytest.approx(0.9)}


@pytest.mark.parametrize(("name", "dims", "flops"), [
    ("aten::mm", [[8, 4], [4, 2]], 128),
    ("aten::addmm", [[2], [8, 4], [4, 2], [], []], 128),
    ("aten::bmm", [[3, 8, 4], [3, 4, 2]], 384),
    ("aten::_scaled_mm", [[8, 4], [4, 2], [], []], 128),
    ("aten::mm", None, None),  # a profile without shapes
    ("aten::add", [[8, 4], [8, 4]], None),
])
def test_matmul_flops_from_the_recorded_shapes(name, dims, flops):
    from profile_breakdown import matmul_flops

    assert matmul_flops({"name": name, "args": {} if dims is None else {"Input Dims": dims}}) == flops
