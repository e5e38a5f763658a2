"""Train one model with two block implementations and check that their loss curves agree.

Runs `scripts/train.py` twice with the same model, data order, seed and optimizer — `block=eager`
and `block=coda` with `block.backend=<backend>` — reads each run's metrics.jsonl (logged every
step), and compares the losses averaged over consecutive windows of `--window` steps (single
steps differ by bf16 noise; a systematic error shows up in the windowed means). It prints the
largest windowed difference, plots both curves and the difference, and exits with status 1 when
a window differs by more than `--tolerance` (nats).

    python scripts/compare_training.py --model llama3_125m --steps 300 \\
        --run-root docs/loss_curves/llama3_125m --plot docs/loss_curves/llama3_125m.png
    # re-plot saved runs (<run-root>/eager/metrics.jsonl, <run-root>/coda-<backend>/metrics.jsonl)
    python scripts/compare_training.py --plot-only --run-root docs/loss_curves/llama3_125m \\
        --plot docs/loss_curves/llama3_125m.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from codatrain.train.logger import read_losses, windowed
from codatrain.train.runs import REPO, TRAIN_SCRIPT


def train(run_dir: Path, model: str, block: list[str], steps: int, extra: list[str]) -> None:
    """One training run into run_dir (replaced if it exists, checkpoints included)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    # A plain single process (bf16 on a GPU through FSDP2's policy, as every job; the loss curves in
    # docs/ predate that and were made under autocast).
    cmd = [
        sys.executable, str(TRAIN_SCRIPT), f"model={model}", *block,
        f"train.steps={steps}", "train.log_every=1", "train.val_every=0", "train.progress=false",
        "checkpoint.at_end=false", "checkpoint.resume=none", f"train.run_dir={run_dir}", *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def plot(path: Path, curves: dict[str, dict[int, float]], window: int, tolerance: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (name_a, a), (name_b, b) = curves.items()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
    for (name, losses), color in zip(curves.items(), ("tab:blue", "tab:orange"), strict=True):
        top.plot(list(losses), list(losses.values()), color=color, alpha=0.3, linewidth=0.8)
        w = windowed(losses, window)
        top.plot(list(w), list(w.values()), color=color, linewidth=2, label=f"{name} ({window}-step mean)")
    top.set_ylabel("training loss (nats/token)")
    top.set_title(title)
    top.legend()
    wa, wb = windowed(a, window), windowed(b, window)
    steps = [s for s in wa if s in wb]
    bottom.plot(steps, [wb[s] - wa[s] for s in steps], marker="o", color="black")
    bottom.axhspan(-tolerance, tolerance, color="green", alpha=0.15, label=f"±{tolerance} tolerance")
    bottom.axhline(0, color="gray", linewidth=0.8)
    bottom.set_ylabel(f"{name_b} − {name_a}")
    bottom.set_xlabel("step")
    bottom.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_125m")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--backend", default="cute", help="stage backend of the CODA run")
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.05, help="largest allowed windowed loss difference")
    p.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    p.add_argument("--plot-only", action="store_true", help="compare the runs already in --run-root")
    p.add_argument("overrides", nargs="*", help="further scripts/train.py overrides for both runs")
    args = p.parse_args()

    runs = {
        "eager": (args.run_root / "eager", ["block=eager"]),
        f"coda ({args.backend})": (args.run_root / f"coda-{args.backend}",
                                   ["block=coda", f"block.backend={args.backend}"]),
    }
    if not args.plot_only:
        for run_dir, block in runs.values():
            train(run_dir, args.model, block, args.steps, args.overrides)
    curves = {name: read_losses(run_dir) for name, (run_dir, _) in runs.items()}
    (name_a, a), (name_b, b) = curves.items()
    wa, wb = windowed(a, args.window), windowed(b, args.window)
    diffs = {s: wb[s] - wa[s] for s in wa if s in wb}
    worst = max(diffs, key=lambda s: abs(diffs[s]))
    last = max(diffs)
    print(f"{args.model}, {len(a)} / {len(b)} steps: {args.window}-step mean loss {name_a} {wa[last]:.4f}, "
          f"{name_b} {wb[last]:.4f} at step {last}; largest windowed difference {diffs[worst]:+.4f} "
          f"(steps ending {worst}), tolerance {args.tolerance}")
    if args.plot:
        plot(args.plot, curves, args.window, args.tolerance,
             f"{args.model}: block=eager vs block=coda ({args.backend}), bf16, embedded corpus")
    sys.exit(0 if abs(diffs[worst]) <= args.tolerance else 1)


if __name__ == "__main__":
    main()
