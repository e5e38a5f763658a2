"""GPU time per training step by kernel family, from the profile summaries `train.profile_steps`
writes (<run_dir>/profile/summary_rank0.txt, a torch.profiler table sorted by self device time).

    python scripts/profile_breakdown.py docs/bench/profiles/llama3_1b_coda.txt \
        docs/bench/profiles/llama3_1b_compile.txt

Only device kernels and copies count (operator rows such as `aten::mm` or `_LayerFnBackward` hold
the same time again); the table lists the top rows only, so the families are summed over what it
lists and shown beside the profile's total. Times are divided by the number of profiled steps.
"""

from __future__ import annotations

import argparse
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
        family = next(f for f, pattern in FAMILIES if re.search(pattern, name))
        families[family] = families.get(family, 0.0) + 1e3 * seconds(row[self_device]) / steps
    return families, 1e3 * seconds(total.split(":")[1].strip()) / steps, steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("summaries", nargs="+", type=Path)
    args = parser.parse_args()
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
