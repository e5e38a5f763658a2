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
