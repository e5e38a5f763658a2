"""End-to-end training benchmark: real steps (data loading, optimizer, logging, FSDP2 under
torchrun) for several block variants of one model, each in its own torchrun job, side by side.

    python scripts/bench_train.py --variants eager,compile,coda --steps 30 --warmup 10 \
        --plot runs/bench_train/bench.png \
        -- model=llama3_1b data=synthetic data.seq_len=8192 train.micro_batch_size=4
    python scripts/bench_train.py --replot runs/a/bench_train.json:eager runs/b/bench_train.json \
        --plot bench.png

Everything after `--` is passed to scripts/train.py for every variant. Each variant's per-step
records (metrics.jsonl) are read back; the first `--warmup` steps are excluded and the medians of
the rest are reported: time per step, tokens/s and TFLOP/s per device, MFU, peak memory and the
resident model state (parameters + optimizer state, allocated between steps), whose difference is
what a step needs for activations, gradients and temporaries, and the CUDA caching allocator's
retries in the timed steps (each frees its cache and synchronizes the device: a step at the card's
capacity, slower than its kernels). Writes <out>/bench_train.json (after
every variant: a run stopped by a time limit keeps the finished ones) and prints a table; `--replot`
redraws the chart and the table from such JSONs (`FILE:a,b` takes the variants a and b of FILE; a
variant in a later file replaces one of the same name). `--profile N` profiles N more steps after
the timed ones (a torch.profiler summary per variant, named in the JSON).

Variants (`--variants`, names from codatrain/train/runs.py VARIANTS): eager, compile (eager +
torch.compile), coda, coda_compile, coda_reference, coda_fp8 (block.precision=fp8: the layer GEMMs
in FP8 with per-tensor delayed scaling), liger: the eager model with liger-kernel
0.8.5's fused RMSNorm, SwiGLU, RoPE and fused linear cross-entropy, the peer for memory savings
without custom kernels (a CUDA GPU and `pip install 'codatrain[liger]'`), and compile_fp8_tensorwise
/ compile_fp8_rowwise: the compile variant with torchao's float8 training of the layer GEMMs
(`train.float8`, LM head in bf16; `pip install 'codatrain[float8]'`), the FP8 peer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from codatrain.config import load_config, unknown_override_key, validate
from codatrain.train.runs import REPO, VARIANTS, Launch, run_variant, software_versions, summarize


def plot(path: Path, summaries: list[dict], title: str) -> None:
    """Bars of tokens/s, MFU and peak memory per variant, the loss curves and each variant's loss
    minus the first variant's (the same seed, data and initial weights), into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in summaries if "error" not in s]
    names = [s["variant"] for s in ok]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.5))
    bars = [("tokens/s per device", [s["tokens_per_s_per_device"] for s in ok]),
            ("MFU (%)", [None if s["mfu"] is None else 100 * s["mfu"] for s in ok]),
            ("peak memory (GiB)", [s["peak_memory_gib"] for s in ok])]
    colors = [f"C{i}" for i in range(len(ok))]
    for ax, (label, values) in zip(axes, bars, strict=False):
        ax.bar(names, [v or 0 for v in values], color=colors)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
        for i, value in enumerate(values):
            text = "n/a" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
            ax.text(i, value or 0, text, ha="center", va="bottom")
    # The resident model state (parameters + optimizer state) hatched at the foot of each memory bar.
    state = [s.get("resident_memory_gib") for s in ok]
    if all(v is not None for v in state):
        axes[2].bar(names, state, color="none", edgecolor="black", hatch="//", label="model state")
        axes[2].legend(loc="upper right")
    # int keys, or str keys after a JSON round trip
    curves = [{int(k): v for k, v in s["losses"].items()} for s in ok]
    for i, (name, curve) in enumerate(zip(names, curves, strict=True)):
        steps = sorted(curve)
        axes[3].plot(steps, [curve[k] for k in steps], color=f"C{i}", label=name)
        if i:
            common = [k for k in steps if k in curves[0]]
            axes[4].plot(common, [curve[k] - curves[0][k] for k in common], color=f"C{i}", label=name)
    axes[3].set_title("training loss")
    axes[4].set_title(f"loss − {names[0]} loss" if names else "loss difference")
    axes[4].axhline(0.0, color="black", linewidth=0.5)
    for ax in axes[3:]:
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def print_table(summaries: list[dict]) -> None:
    """One row per variant; tokens/s relative to `compile` (eager + torch.compile) when it ran."""
    base = next((s for s in summaries if s["variant"] == "compile" and "error" not in s), None)
    print(f"\n{'variant':<14}{'ms/step':>9}{'tok/s/dev':>11}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}"
          f"{'state GiB':>11}{'step GiB':>10}{'retries':>9}{'vs compile':>12}")
    for s in summaries:
        if "error" in s:
            print(f"{s['variant']:<14}  {s['error']}")
            continue
        mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        ratio = f"{s['tokens_per_s_per_device'] / base['tokens_per_s_per_device']:.3f}x" if base else "-"
        state, step, retries = (s.get(k) for k in ("resident_memory_gib", "step_memory_gib", "alloc_retries"))
        print(f"{s['variant']:<14}{1e3 * s['step_time_s']:>9.1f}{s['tokens_per_s_per_device']:>11,.0f}"
              f"{s['tflops_per_device']:>9.1f}{mfu:>7}{s['peak_memory_gib']:>10.2f}"
              f"{'-' if state is None else f'{state:.2f}':>11}{'-' if step is None else f'{step:.2f}':>10}"
              f"{'-' if retries is None else retries:>9}{ratio:>12}")


def merge_reports(sources: list[str]) -> dict:
    """One report from `FILE[:variant,...]` sources, in order: the first file's settings, every
    file's date, and the chosen variants (all by default), a later one replacing a namesake."""
    report, variants, dates = None, {}, []
    for source in sources:
        path, _, chosen = source.partition(":")
        loaded = json.loads(Path(path).read_text())
        names = chosen.split(",") if chosen else [v["variant"] for v in loaded["variants"]]
        available = {v["variant"]: v for v in loaded["variants"]}
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(f"{path} has no variant(s) {missing}; it has {', '.join(available)}")
        variants.update((n, available[n]) for n in names)
        dates.append(loaded["date"])
        report = report or loaded
    return {**report, "date": ", ".join(dict.fromkeys(dates)), "variants": list(variants.values())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default="eager,compile,coda", help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps excluded from the medians")
    parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun) per variant")
    parser.add_argument("--profile", type=int, default=0,
                        help="after the timed steps, profile this many more (<out>/<variant>/profile/)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_train")
    parser.add_argument("--plot", type=Path, help="also draw the results into this PNG")
    parser.add_argument("--replot", nargs="+", metavar="JSON[:VARIANTS]",
                        help="run nothing: redraw --plot and the table from these bench_train.json files")
    parser.add_argument("overrides", nargs="*", help="scripts/train.py overrides (after --)")
    args = parser.parse_args()

    if args.replot:
        try:
            report = merge_reports(args.replot)
        except (OSError, ValueError) as error:
            parser.error(f"--replot: {error}")
    else:
        names = args.variants.split(",")
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
        if not 0 <= args.warmup < args.steps:
            parser.error("--warmup must be 0 or more and smaller than --steps")
        # A bad override, before any variant's job starts: each would fail alike, reported only as
        # its exit code in the table.
        if (unknown := unknown_override_key(args.overrides)) is not None:
            parser.error(f"overrides: {unknown}")
        for name in names:  # with each variant's own overrides, as run_variant composes them
            try:
                validate(load_config([*VARIANTS[name], "train.tokens_per_step=null", *args.overrides]))
            except Exception as error:
                parser.error(f"overrides, variant {name}: {error}")
        report = {"overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
                  "nproc": args.nproc, "date": time.strftime("%Y-%m-%d"), "software": software_versions(),
                  "variants": []}
        args.out.mkdir(parents=True, exist_ok=True)
        for name in names:
            result = run_variant(name, args.overrides, args.steps, args.out / name, Launch(args.nproc),
                                 args.profile)
            report["variants"].append(summarize(result, args.warmup))
            # Written after every variant: a run stopped by a time limit keeps the finished ones.
            (args.out / "bench_train.json").write_text(json.dumps(report, indent=2))
    if args.plot:
        gpu = report["software"]["gpu"] or "CPU"
        title = f"{gpu}, {report['nproc']} process(es), {report['date']}: {' '.join(report['overrides'])}"
        plot(args.plot, report["variants"], title)
    print_table(report["variants"])


if __name__ == "__main__":
    main()
