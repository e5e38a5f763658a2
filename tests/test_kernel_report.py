"""scripts/kernel_report.py's spill count on SASS lines as CuTeDSL's nvdisasm writes them (the
compile itself runs in test_precompile.py::test_every_gemm_keeps_four_k_tiles_in_flight)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from kernel_report import spills  # noqa: E402

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


def test_a_block_without_stages_is_refused_by_name():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_report.py"), "block=eager"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "runs no CuTeDSL GEMM stages" in proc.stderr, proc.stderr[-2000:]
