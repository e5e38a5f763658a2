"""The CPU reports on the cute stages: scripts/kernel_report.py's spill count on SASS lines as
CuTeDSL's nvdisasm writes them (its compile runs in
test_precompile.py::test_every_gemm_keeps_four_k_tiles_in_flight), and scripts/memory_report.py's
count of a micro-step's live tensors."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from kernel_report import sass_digest, spills  # noqa: E402

SASS = """
        /*2570*/                   STL [R1+0x88], R2                                        (*"SpillRefill"*);
        /*2580*/                   STL.64 [R1+0x90], R4                                     (*"SpillRefill"*);
        /*3510*/                   LDL R23, [R1+0x88]                                       (*"SpillRefill"*);
        /*3520*/                   LDL.128 R8, [R1+0xa0]                                    (*"SpillRefill"*);
        /*3530*/                   STS [R5], R6 ;
        /*3540*/                   LDS R7, [R5] ;
        /*3550*/                   LDSM.16.M88.4 R12, [R9] ;
        /*3560*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64] ;
        /*3570*/                   STG.E desc[UR4][R10.64], R2 ;
"""


def test_spills_count_local_memory_stores_and_loads_only():
    assert spills(SASS) == (2, 2)
    assert spills("") == (0, 0)


def test_the_sass_digest_reads_the_instructions_and_not_the_kernel_name():
    """Two builds of one kernel from epilogue sources that differ (QuACK names the kernel by their
    fingerprint) but compile alike have one digest; another instruction, or an operand, changes it."""
    named = ("//---- .text.kernel_GemmMod_rstd_bias_rope_epi_{0}_sm90 ----\n"
             ".text.kernel_GemmMod_rstd_bias_rope_epi_{0}:\n")
    first, second = named.format("4fbec4d2") + SASS, named.format("ab0eb2ae") + SASS
    assert sass_digest(first) == sass_digest(second) != sass_digest("")
    assert sass_digest(first) != sass_digest(first.replace("STS [R5], R6", "STS [R5], R7"))
    assert sass_digest(first) != sass_digest(first + "        /*3580*/                   NOP ;\n")


def test_a_block_without_stages_is_refused_by_name():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_report.py"), "block=eager"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "runs no CuTeDSL GEMM stages" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("cutlass", "quack", "triton")),
                    reason="needs the cuda extras (nvidia-cutlass-dsl, quack-kernels) and triton")
def test_memory_report_counts_the_tensors_alive_at_the_peak(tmp_path):
    """The tiny config's micro-step (4 layers, 16 × 128 tokens, F 384): the tensors listed alive at
    the peak add up to it, and among them are what the backward must hold, each layer's gate/up
    pre-activation (M × 2F in bf16, saved by F2)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_report.py"), "model=tiny",
                           "--json", str(tmp_path / "report.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert sum(entry["bytes"] for entry in report["alive"]) == report["peak_bytes"] > 0
    # Each phase's own peak, the higher of them the step's.
    phases = report["phase_peaks"]
    assert set(phases) == {"forward", "backward"} and all(peak > 0 for peak, _ in phases.values()), phases
    assert max(peak for peak, _ in phases.values()) == report["peak_bytes"], phases
    preacts = [e for e in report["alive"] if "gemm_rstd_swiglu" in e["made_by"] and e["shape"] == "2048×768"]
    assert len(preacts) == 4 and all(e["bytes"] == 2048 * 768 * 2 for e in preacts), report["alive"][:10]


def _event(action: str, addr: int, size: int, name: str = "") -> dict:
    frames = [{"filename": f"/x/codatrain/model/{name}.py", "line": 1, "name": name}] if name else []
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_memory_report_replays_a_gpu_allocator_history_to_its_peak():
    """A history as torch.cuda.memory._snapshot() writes it: 100 bytes held before it began; the
    step allocates a (60) and b (30), frees a (held until its free completes), allocates c (50).
    The peak is 100 + 60 + 30 at b's allocation, with a and b alive."""
    from memory_report import replay_snapshot

    trace = [_event("alloc", 1, 60, "fwd"), _event("alloc", 2, 30, "bwd"), _event("free_requested", 1, 60),
             _event("free_completed", 1, 60), _event("alloc", 3, 50, "opt"), _event("segment_alloc", 9, 512)]
    segments = [{"device": 0, "blocks": [{"size": 100, "state": "active_allocated"},
                                         {"size": 30, "state": "active_allocated"},
                                         {"size": 50, "state": "active_allocated"},
                                         {"size": 60, "state": "inactive"}]}]
    report = replay_snapshot({"segments": segments, "device_traces": [trace]})
    assert report["before_bytes"] == 100 and report["peak_bytes"] == 190
    assert report["peak_at"] == "bwd:1"
    assert [(e["bytes"], e["made_by"]) for e in report["alive"]] == [(60, "fwd:1"), (30, "bwd:1")]


def test_memory_report_finds_where_the_allocator_released_its_cache():
    """A retried allocation shows as a run of segment_free events (the cache released) before the
    segment and block that satisfy it: one release per run, with the allocation that came next."""
    from memory_report import cache_releases

    trace = [_event("alloc", 1, 60, "fwd"), _event("segment_free", 7, 256), _event("segment_free", 8, 512),
             _event("segment_alloc", 9, 1024), _event("alloc", 9, 1000, "bwd"),
             _event("free_completed", 1, 60), _event("segment_free", 5, 128)]
    releases = cache_releases({"segments": [], "device_traces": [trace]})
    assert releases == [{"segments": 2, "bytes": 768, "then_bytes": 1000, "then_at": "bwd:1"},
                        {"segments": 1, "bytes": 128, "then_bytes": None, "then_at": "(none)"}]
