"""scripts/bench_data.py on CPU: what its report says of the corpus it measured."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_corpus_an_earlier_call_wrote_is_reported_as_it_is(tmp_path):
    # A second call into the same --work measured the first call's corpus but printed its own --mb
    # and --files (and tokenized into --files shards).
    def bench(mb: str, files: str) -> str:
        cmd = [sys.executable, str(REPO / "scripts" / "bench_data.py"), "--work", str(tmp_path / "work"),
               "--mb", mb, "--files", files, "--vocab", "300", "--seq-len", "64", "--batch", "2",
               "--batches", "2"]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return next(line for line in done.stdout.splitlines() if " cores; corpus " in line)

    assert " corpus 0.2 MiB in 2 files; tokenizer " in bench("0.2", "2")
    again = bench("1", "4")
    assert " corpus 0.2 MiB in 2 files (written by an earlier call into " in again
