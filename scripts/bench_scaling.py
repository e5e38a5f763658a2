"""Data-parallel scaling on N processes (GPUs) and its correctness checks, for each block variant.

    NCCL_NVLS_ENABLE=0 python scripts/bench_scaling.py --nproc 2 --variants compile,coda \\
        --steps 200 --out runs/scaling --plot runs/scaling/loss.png \\
        -- model=llama3_1b data=synthetic data.seq_len=8192 train.micro_batch_size=4

Everything after `--` goes to scripts/train.py. Per variant (codatrain/train/runs.py's VARIANTS),
five jobs under torchrun, each in <out>/<variant>/<leg>/:
- throughput_1, throughput_N: `--throughput-steps` steps at the given micro-batch on 1 and on N
  processes (medians after `--warmup`, as bench_train reports them). Check: tokens/s per device on
  N processes ≥ `--min-efficiency` × the 1-process figure.
- loss_1, loss_N: `--steps` steps at the same global batch, N × micro-batch sequences (one process
  accumulates N micro-batches; N processes take one each). loss_N saves a checkpoint halfway.
  Check: the loss curves agree — the first step's losses (same weights, same batch) within
  `--first-step-rtol`, and the means over windows of `--window` steps within `--tolerance` nats.
- resume_1: one process resumes loss_N's halfway checkpoint (DCP reshards N → 1) and trains on to
  `--steps`. Check: the same two criteria against loss_N over the resumed steps.

`--mesh` sets the N-process legs' data-parallel mesh (README, "Several nodes"): `full` (default:
FSDP2 shards over all N), `RxS` (HSDP: R replicas × S shards, R·S = N; `Nx1` replicates only) or
`auto` (one replica per node). Two calls with different `--mesh` and `--out` measure HSDP against
full sharding on the same GPUs.

On several nodes (N = `--nnodes` × `--nproc` per node) the command runs once on every node, with
the same options but `--node-rank`, as torchrun does in the README's multi-node launch
(scripts/bench_scaling.sbatch under Slurm):

    python scripts/bench_scaling.py --nnodes 2 --node-rank <0|1> --nproc 8 \
        --rdzv-endpoint $HEAD:29500 --rdzv-id scaling-1 --mesh auto --out /shared/runs/scaling-hsdp -- ...

Every node joins the N-process legs of every variant, in step: each is a torchrun of `--nproc`
processes per node meeting at the c10d rendezvous under its own id (`<rdzv-id>-<variant>-<leg>`).
Then node 0 alone runs the 1-process legs, on one of its GPUs, evaluates and reports; the other
nodes exit. `--out` must be a directory every node sees (checkpoints are written by every rank).

A leg whose metrics already reach its last step is not run again, so calling the command again
after an interruption (a time limit, say) continues where it stopped; `--fresh` reruns all. With
`--nproc 1` every leg runs on one process: a smoke test of the script. Writes
<out>/bench_scaling.json, prints a table and exits with status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from codatrain.config import load_config, unknown_override_key, validate
from codatrain.train.logger import METRICS_FILE, read_losses, read_records, windowed
from codatrain.train.plan import data_parallel_mesh
from codatrain.train.runs import REPO, VARIANTS, Launch, run_variant, software_versions, summarize, train_job

CHECKS = ("throughput", "parity", "resume")


def complete(run_dir: Path, last_step: int) -> bool:
    return (run_dir / METRICS_FILE).exists() and any(r["step"] == last_step for r in read_records(run_dir))


def agreement(reference: dict[int, float], other: dict[int, float], window: int) -> dict:
    """How closely `other` follows `reference` over the steps both logged."""
    steps = sorted(set(reference) & set(other))
    first = steps[0]
    wa = windowed({s: reference[s] for s in steps}, window)
    wb = windowed({s: other[s] for s in steps}, window)
    window_diffs = [wb[s] - wa[s] for s in wa]
    return {
        "steps": [first, steps[-1]],
        "first_step": first,
        "first_step_rel_diff": abs(other[first] - reference[first]) / abs(reference[first]),
        "max_step_abs_diff": max(abs(other[s] - reference[s]) for s in steps),
        "max_window_abs_diff": max(map(abs, window_diffs)) if window_diffs else None,
    }


def check_agreement(result: dict, first_step_rtol: float, tolerance: float) -> bool:
    windows_ok = result["max_window_abs_diff"] is None or result["max_window_abs_diff"] <= tolerance
    result["ok"] = result["first_step_rel_diff"] <= first_step_rtol and windows_ok
    return result["ok"]


def run_leg(run_dir: Path, last_step: int, fresh: bool, job: Callable[[Path], str | None]) -> str | None:
    """Run `job(run_dir)` unless an earlier call completed it; returns an error or None. On several
    nodes each node decides alike from the shared directory, and clears it before its agent joins
    the rendezvous, so before any process of the leg writes."""
    if not fresh and complete(run_dir, last_step):
        print(f"= {run_dir}: complete, not run again", flush=True)
        return None
    shutil.rmtree(run_dir, ignore_errors=True)  # a partial run (and its checkpoints) starts over
    return job(run_dir)


def mesh_overrides(mesh: str) -> list[str]:
    """The parallel.* overrides of `--mesh`: full, auto or RxS; ValueError for anything else."""
    if mesh == "full":
        return []
    if mesh == "auto":
        return ["parallel.dp_replicate=auto"]
    replicate, _, shard = mesh.partition("x")
    if not (replicate.isdigit() and shard.isdigit()):
        raise ValueError(f"--mesh {mesh}: give full, auto or RxS (R replicas × S shards)")
    return [f"parallel.dp_replicate={replicate}", f"parallel.dp_shard={shard}"]


@dataclass(frozen=True)
class Leg:
    """One job of a variant: `run(run_dir)` trains `last_step` steps as `launch` says; an error or None."""

    launch: Launch
    last_step: int
    run: Callable[[Path], str | None]


def variant_legs(name: str, args: argparse.Namespace, nodes: Launch, micro_batch: int,
                 seq_len: int) -> dict[str, Leg]:
    """The five jobs of variant `name` (module docstring) in run order, the N-process ones (on
    `nodes`: every node, each with its own rendezvous id) first, then the 1-process ones."""
    n, out = nodes.world_size, args.out / name
    mesh = mesh_overrides(args.mesh)  # for the N-process legs; one process has no mesh

    def throughput(launch: Launch, overrides: list[str]) -> Leg:
        return Leg(launch, args.throughput_steps, lambda run_dir: run_variant(
            name, [*args.overrides, *overrides], args.throughput_steps, run_dir, launch, 0).get("error"))

    def training(launch: Launch, overrides: list[str]) -> Leg:
        return Leg(launch, args.steps,
                   lambda run_dir: None if train_job(launch, overrides, run_dir) == 0 else "training failed")

    def on_nodes(leg: str) -> Launch:  # a rendezvous per leg: no agent joins another leg's
        return nodes if nodes.nnodes == 1 else replace(nodes, rdzv_id=f"{nodes.rdzv_id}-{name}-{leg}")

    # Loss curves at one global batch on 1 and N processes; N saves halfway; 1 resumes from it.
    half, one = args.steps // 2, Launch(1)
    batch = [*VARIANTS[name], *args.overrides, f"train.tokens_per_step={n * micro_batch * seq_len}",
             f"train.steps={args.steps}", "checkpoint.at_end=false"]
    n_process = {
        f"throughput_{n}": throughput(on_nodes("throughput"), mesh),
        f"loss_{n}": training(on_nodes("loss"), [*batch, *mesh, "checkpoint.resume=none",
                                                 f"checkpoint.every={half}", "checkpoint.keep_last=0"]),
    }
    one_process = {
        "throughput_1": throughput(one, []),
        "loss_1": training(one, [*batch, "checkpoint.resume=none"]),
        "resume_1": training(one, [*batch, f"checkpoint.resume={out / f'loss_{n}/checkpoints/step_{half}'}"]),
    }
    # With N = 1 the N-process legs (loss_1 with its checkpoint) take the 1-process legs' places.
    return {**n_process, **one_process, **n_process}


def run_legs(legs: dict[str, dict[str, Leg]], args: argparse.Namespace) -> dict[str, str]:
    """Run this node's legs of every variant: the multi-node ones first, on every node in step (an
    agent waits for the others at each leg's rendezvous), then node 0 alone runs the 1-process ones
    (and, on one node, all). Returns variant → the error that stopped its legs."""
    errors: dict[str, str] = {}
    for multi_node in (True, False):
        if not multi_node and args.node_rank > 0:
            break
        for name, variant in legs.items():
            for leg_name, leg in variant.items():
                if name in errors or (leg.launch.nnodes > 1) != multi_node:
                    continue
                error = run_leg(args.out / name / leg_name, leg.last_step, args.fresh, leg.run)
                if error:
                    errors[name] = f"{leg_name}: {error}"
    return errors


def evaluate(name: str, args: argparse.Namespace, n: int) -> dict:
    """The checks of variant `name` from the metrics its legs wrote under <out>/<name>/."""
    out = args.out / name
    result: dict = {"variant": name}
    # Throughput at the given micro-batch: per-device tokens/s on N processes against 1.
    rates = {}
    for procs in (1, n):
        leg = out / f"throughput_{procs}"
        records = {"variant": name, "records": read_records(leg), "profile": None}
        rates[procs] = summarize(records, args.warmup)
        if "error" in rates[procs]:
            return {**result, "error": f"{leg.name}: {rates[procs]['error']}"}
    efficiency = rates[n]["tokens_per_s_per_device"] / rates[1]["tokens_per_s_per_device"]
    result["throughput"] = {
        "tokens_per_s_per_device": {str(p): rates[p]["tokens_per_s_per_device"] for p in rates},
        "mfu": {str(p): rates[p]["mfu"] for p in rates},
        "peak_memory_gib": {str(p): rates[p]["peak_memory_gib"] for p in rates},
        "efficiency": efficiency, "ok": efficiency >= args.min_efficiency,
    }
    curves = {leg: read_losses(out / leg) for leg in ("loss_1", f"loss_{n}", "resume_1")}
    result["losses"] = curves
    result["parity"] = agreement(curves["loss_1"], curves[f"loss_{n}"], args.window)
    result["resume"] = agreement(curves[f"loss_{n}"], curves["resume_1"], args.window)
    for check in ("parity", "resume"):
        check_agreement(result[check], args.first_step_rtol, args.tolerance)
    return result


def plot(path: Path, results: list[dict], nproc: int, window: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    fig, axes = plt.subplots(2, max(len(ok), 1), figsize=(7 * max(len(ok), 1), 7), squeeze=False,
                             sharex="col", height_ratios=(3, 2))
    for col, r in enumerate(ok):
        top, bottom = axes[0][col], axes[1][col]
        labels = {"loss_1": "1 process", f"loss_{nproc}": f"{nproc} processes",
                  "resume_1": f"1 process, resumed from the {nproc}-process checkpoint"}
        reference = {int(k): v for k, v in r["losses"][f"loss_{nproc}"].items()}
        for i, (leg, label) in enumerate(labels.items()):
            curve = {int(k): v for k, v in r["losses"][leg].items()}
            steps = sorted(curve)
            top.plot(steps, [curve[s] for s in steps], color=f"C{i}", label=label, linewidth=1)
            if leg != f"loss_{nproc}":
                wa = windowed({s: reference[s] for s in steps if s in reference}, window)
                wb = windowed({s: curve[s] for s in steps if s in reference}, window)
                bottom.plot(list(wa), [wb[s] - wa[s] for s in wa], color=f"C{i}", marker="o", label=label)
        top.set_title(f"{r['variant']}: training loss, one global batch")
        top.legend()
        bottom.axhline(0, color="gray", linewidth=0.8)
        bottom.set_ylabel(f"{window}-step mean − {nproc}-process run")
        bottom.set_xlabel("step")
        bottom.legend()
    fig.suptitle(textwrap.fill(title, 80 * max(len(ok), 1)))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def print_table(results: list[dict], nproc: int) -> None:
    print(f"\n{'variant':<14}{'tok/s/dev 1':>13}{f'tok/s/dev {nproc}':>13}{'efficiency':>12}"
          f"{'parity Δwin':>13}{'resume Δwin':>13}{'resume Δ1st':>13}  checks")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<14}  {r['error']}")
            continue
        t, p, s = r["throughput"], r["parity"], r["resume"]
        rates = t["tokens_per_s_per_device"]
        verdict = ", ".join(f"{k} {'ok' if r[k]['ok'] else 'FAILED'}" for k in CHECKS)
        window = lambda a: "-" if a["max_window_abs_diff"] is None else f"{a['max_window_abs_diff']:.1e}"
        print(f"{r['variant']:<14}{rates['1']:>13,.0f}{rates[str(nproc)]:>13,.0f}{t['efficiency']:>12.3f}"
              f"{window(p):>13}{window(s):>13}{s['first_step_rel_diff']:>13.1e}  {verdict}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per node of the data-parallel runs")
    p.add_argument("--mesh", default="full",
                   help="the N-process legs' mesh: full, auto or RxS (R·S = N = nodes × --nproc)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the data-parallel runs; one call per node")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index: 0 also runs the 1-process legs and writes the report")
    p.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (several nodes)")
    p.add_argument("--rdzv-id", help="the same on every node, new per call (several nodes)")
    p.add_argument("--variants", default="compile,coda", help=f"any of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=200, help="steps of the loss-curve runs (even)")
    p.add_argument("--throughput-steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=10, help="throughput steps excluded from the medians")
    p.add_argument("--window", type=int, default=20, help="steps per window of the loss comparison")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest windowed mean loss difference")
    p.add_argument("--first-step-rtol", type=float, default=1e-3,
                   help="largest relative loss difference at the first compared step")
    p.add_argument("--min-efficiency", type=float, default=0.9,
                   help="per-device tokens/s on N processes over 1, at least")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "scaling",
                   help="the legs' run directories; on several nodes one that every node sees")
    p.add_argument("--plot", type=Path, help="draw the loss curves and their differences into this PNG")
    p.add_argument("--fresh", action="store_true", help="rerun legs that an earlier call completed")
    p.add_argument("overrides", nargs="*", help="scripts/train.py overrides (after --)")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if args.steps < 2 or args.steps % 2:
        p.error("--steps must be even (the N-process run saves its checkpoint halfway)")
    if not 0 <= args.warmup < args.throughput_steps:
        p.error("--warmup must be 0 or more and smaller than --throughput-steps")
    if args.window < 1:  # checked here, not after every leg has run: windowed() steps by it
        p.error(f"--window must be at least 1, got {args.window}")
    if args.nproc < 1 or args.nnodes < 1:
        p.error("--nproc and --nnodes must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank}: give 0 to {args.nnodes - 1} for --nnodes {args.nnodes}")
    if (args.nnodes > 1) != bool(args.rdzv_endpoint and args.rdzv_id):
        p.error("--rdzv-endpoint and --rdzv-id: give both with --nnodes > 1, neither on one node")
    nodes = Launch(args.nproc, args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    per_leg = ("train.tokens_per_step", "train.run_dir", "parallel.dp_replicate", "parallel.dp_shard")
    if any(o.split("=")[0].lstrip("+~") in per_leg for o in args.overrides):
        p.error(f"{', '.join(per_leg)} are set per leg by this script (the mesh: --mesh)")
    try:
        mesh = mesh_overrides(args.mesh)
    except ValueError as error:
        p.error(str(error))
    if (unknown := unknown_override_key(args.overrides)) is not None:  # as scripts/train.py names it
        p.error(f"overrides: {unknown}")
    try:
        run = validate(load_config(args.overrides))
    except Exception as error:  # a bad override: one line naming it, before any job starts
        p.error(f"overrides: {error}")
    try:  # the N-process legs' mesh as the trainer will decide it (auto: one replica per node)
        degrees = data_parallel_mesh(validate(load_config([*args.overrides, *mesh])).parallel,
                                     nodes.world_size, nodes.nproc_per_node)
    except ValueError as error:
        p.error(f"--mesh {args.mesh} on {args.nnodes} node(s) × {args.nproc} processes: {error}")

    n = nodes.world_size
    micro_batch, seq_len = run.train.micro_batch_size, run.data.seq_len
    legs = {name: variant_legs(name, args, nodes, micro_batch, seq_len) for name in names}
    errors = run_legs(legs, args)
    if args.node_rank > 0:
        print(f"node {args.node_rank}: its part of the {n}-process legs is done" + "".join(
            f"; {name} stopped at {error}" for name, error in errors.items()) + "; node 0 reports")
        sys.exit(1 if errors else 0)

    results = [{"variant": name, "error": errors[name]} if name in errors else evaluate(name, args, n)
               for name in names]
    measured = (f"{args.nnodes} node(s) × {args.nproc} process(es) = {n} ({degrees.describe()}, "
                f"--mesh {args.mesh}) vs 1 process on node 0")
    report = {"nnodes": args.nnodes, "nproc_per_node": args.nproc, "processes": n, "mesh": args.mesh,
              "mesh_degrees": {"replicate": degrees.replicate, "shard": degrees.shard},
              "measured": measured, "overrides": args.overrides,
              "steps": args.steps, "throughput_steps": args.throughput_steps, "warmup": args.warmup,
              "window": args.window, "tolerance": args.tolerance, "first_step_rtol": args.first_step_rtol,
              "min_efficiency": args.min_efficiency, "date": time.strftime("%Y-%m-%d"),
              "software": software_versions(), "variants": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scaling.json").write_text(json.dumps(report, indent=2))
    if args.plot:
        gpu = report["software"]["gpu"] or "CPU"
        plot(args.plot, results, n, args.window,
             f"{gpu}: {report['measured']}, {report['date']}: {' '.join(args.overrides)}")
    print(f"\n{report['measured']}")
    print_table(results, n)
    passed = all("error" not in r and all(r[k]["ok"] for k in CHECKS) for r in results)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
