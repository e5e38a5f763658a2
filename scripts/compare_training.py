"""Train one model with several block implementations or recipes and check that their loss
curves agree.

Runs `scripts/train.py` once per variant with the same model, data order, seed and optimizer — by
default `block=eager` and `block=coda` with `block.backend=<backend>`; `--variant NAME=OVERRIDES`
(repeated) names others, the first being the baseline — reads each run's metrics.jsonl (logged
every step), and compares the losses averaged over consecutive windows of `--window` steps
(single steps differ by bf16 noise; a systematic error shows up in the windowed means) with the
baseline's. It prints each variant's final windowed loss and largest windowed difference, plots
the curves and the differences, and exits with status 1 when a window differs by more than
`--tolerance` (nats).

    python scripts/compare_training.py --model llama3_125m --steps 300 \\
        --run-root docs/loss_curves/llama3_125m --plot docs/loss_curves/llama3_125m.png
    # re-plot saved runs (<run-root>/eager/metrics.jsonl, <run-root>/coda-<backend>/metrics.jsonl)
    python scripts/compare_training.py --plot-only --run-root docs/loss_curves/llama3_125m \\
        --plot docs/loss_curves/llama3_125m.png
    # FP8 CODA against bf16 CODA and torchao's FP8 on the compiled eager model
    python scripts/compare_training.py --model llama3_125m --steps 600 --run-root runs/fp8 \\
        --variant coda_bf16=block=coda --variant "coda_fp8=block=coda block.precision=fp8" \\
        --variant "compile_rowwise=block=eager train.compile=true train.float8=rowwise" \\
        data.seq_len=1024 train.micro_batch_size=8 train.tokens_per_step=8192
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from codatrain.train.logger import METRICS_FILE, read_losses, windowed
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
    """Every curve (light: each step, bold: windowed means) and each one's windowed difference to
    the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base_name, base = next(iter(curves.items()))
    wbase = windowed(base, window)
    for (name, losses), color in zip(curves.items(), colors, strict=False):
        top.plot(list(losses), list(losses.values()), color=color, alpha=0.25, linewidth=0.8)
        w = windowed(losses, window)
        top.plot(list(w), list(w.values()), color=color, linewidth=2, label=f"{name} ({window}-step mean)")
        if name != base_name:
            steps = [s for s in w if s in wbase]
            bottom.plot(steps, [w[s] - wbase[s] for s in steps], marker="o", markersize=3, color=color,
                        label=name)
    top.set_ylabel("training loss (nats/token)")
    top.set_title(title)
    top.legend()
    bottom.axhspan(-tolerance, tolerance, color="green", alpha=0.15, label=f"±{tolerance} tolerance")
    bottom.axhline(0, color="gray", linewidth=0.8)
    bottom.set_ylabel(f"− {base_name}")
    bottom.set_xlabel("step")
    bottom.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """NAME=OVERRIDES (overrides separated by spaces) → (NAME, overrides)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or any(c in name for c in "/ "):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=OVERRIDES, NAME a folder name")
    return name, overrides.split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_125m")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--backend", default="cute", help="stage backend of the CODA run (default variants)")
    p.add_argument("--variant", type=parse_variant, action="append", metavar="NAME=OVERRIDES",
                   help="a run to compare (repeat; the first is the baseline). Default: eager and "
                        "coda-<backend>")
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.05, help="largest allowed windowed loss difference")
    p.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    p.add_argument("--title", help="the plot's title")
    p.add_argument("--plot-only", action="store_true", help="compare the runs already in --run-root")
    p.add_argument("overrides", nargs="*", help="further scripts/train.py overrides for every run")
    args = p.parse_args()

    coda = ["block=coda", f"block.backend={args.backend}"]
    variants = dict(args.variant or [("eager", ["block=eager"]), (f"coda-{args.backend}", coda)])
    if len(variants) < 2:
        p.error("compare needs at least two --variant runs")
    if not args.plot_only:
        for name, block in variants.items():
            train(args.run_root / name, args.model, block, args.steps, args.overrides)
    missing = [str(args.run_root / name) for name in variants
               if not (args.run_root / name / METRICS_FILE).is_file()]
    if missing:
        p.error(f"no {METRICS_FILE} in {', '.join(missing)}: run the comparison without --plot-only first"
                if args.plot_only else f"a run wrote no {METRICS_FILE}: {', '.join(missing)}")
    curves = {name: read_losses(args.run_root / name) for name in variants}
    (base_name, base), *others = curves.items()
    wbase = windowed(base, args.window)
    last = max(wbase)
    print(f"{args.model}, {args.window}-step mean loss at step {last}: {base_name} {wbase[last]:.4f} "
          "(baseline)")
    worst_overall = 0.0
    for name, losses in others:
        w = windowed(losses, args.window)
        diffs = {s: w[s] - wbase[s] for s in wbase if s in w}
        worst = max(diffs, key=lambda s: abs(diffs[s]))
        end = max(diffs)
        worst_overall = max(worst_overall, abs(diffs[worst]))
        print(f"  {name}: {w[end]:.4f} at step {end} ({100 * diffs[end] / wbase[end]:+.2f}%); "
              f"largest windowed difference {diffs[worst]:+.4f} (steps ending {worst})")
    print(f"tolerance {args.tolerance}")
    if args.plot:
        title = args.title or f"{args.model}: " + " vs ".join(variants) + ", embedded corpus"
        plot(args.plot, curves, args.window, args.tolerance, title)
    sys.exit(0 if worst_overall <= args.tolerance else 1)


if __name__ == "__main__":
    main()
