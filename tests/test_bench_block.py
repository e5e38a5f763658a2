"""scripts/bench_block.py on CPU: the reference stages against their eager ops and GEMM floor."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bench_block(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_block.py"), *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_the_headline_layer_forward_and_backward_runs_on_the_reference_stages(tmp_path):
    # The fwd_bwd section built its CodaLayer without the layer index the layer takes since the
    # FP8 twin (it names the layer's amax histories): a TypeError after the other sections' tables.
    done = bench_block(tmp_path, "--impl", "reference", "--model", "tiny", "--tokens", "128",
                       "--seq-len", "64", "--device", "cpu", "--warmup", "1", "--iters", "2",
                       "--sections", "fwd_bwd", "--json", str(tmp_path / "bench.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    times = json.loads((tmp_path / "bench.json").read_text())["fwd_bwd"]
    assert set(times) == {"eager", "CODA", "floor"} and all(ms > 0 for ms in times.values())


def test_the_docstrings_cpu_command_runs_with_one_sequence_of_its_tokens(tmp_path):
    # `--tokens 512 --device cpu` was refused: --tokens must be a multiple of --seq-len, whose
    # default was 4096 whatever the tokens.
    done = bench_block(tmp_path, "--impl", "reference", "--model", "tiny", "--tokens", "512",
                       "--device", "cpu", "--warmup", "1", "--iters", "1", "--sections", "layer")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer fwd (CODA vs floor vs eager)" in done.stdout


def test_a_device_or_backend_this_machine_lacks_is_a_usage_error(tmp_path, monkeypatch):
    # Both were tracebacks: torch's AssertionError "Torch not compiled with CUDA enabled" for the
    # default --device cuda, the backend's BackendUnavailableError for the default --impl cute.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    no_gpu = bench_block(tmp_path, "--model", "tiny", "--tokens", "128")
    assert no_gpu.returncode == 2
    assert no_gpu.stderr.splitlines()[-1] == ("bench_block.py: error: --device cuda: no CUDA device is "
                                              "available here; use --device cpu (with --impl reference)")
    cute_on_cpu = bench_block(tmp_path, "--model", "tiny", "--tokens", "128", "--device", "cpu")
    assert cute_on_cpu.returncode == 2
    assert cute_on_cpu.stderr.splitlines()[-1].startswith("bench_block.py: error: --impl cute: ")
