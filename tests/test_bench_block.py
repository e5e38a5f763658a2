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
