"""Compile the CuTeDSL kernels of a training config ahead of time, for Hopper (sm_90a), into the
cache directory the training job then loads them from.

    python scripts/precompile.py model=llama3_1b data.seq_len=4096 train.micro_batch_size=4 \\
        kernels.cache_dir=/shared/kernels
    torchrun --nproc_per_node=8 scripts/train.py model=llama3_1b block=coda data.seq_len=4096 \\
        train.micro_batch_size=4 kernels.cache_dir=/shared/kernels

Takes the overrides of scripts/train.py: the kernels depend on the model widths, data.seq_len,
train.micro_batch_size and block.* (block defaults to coda here). Runs on any machine with the
cuda extras, GPU or not: the kernels compile in processes that see no GPU. The cache only serves
jobs that run the same Python minor version and the same CUDA-side package versions.

Options: --jobs N compile processes (default: one per core, at most 8); --sms N SMs of the target
GPU (default 132: H100 SXM, H200); --check only reports whether the cache fits (exit status 1 if not).
"""

import argparse
import sys

from hydra.errors import ConfigCompositionException

from codatrain.kernels.cache import HOPPER_SMS, KernelCacheError, cache_problems, precompile
from codatrain.train.plan import target_plan


def main(argv: list[str]) -> int | str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, as for scripts/train.py")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes")
    parser.add_argument("--sms", type=int, default=HOPPER_SMS, help="SMs of the target GPU")
    parser.add_argument("--check", action="store_true", help="only check the cache")
    args = parser.parse_intermixed_args(argv)
    # No compile process at all would record the config as built, kernels none: `--check` and
    # kernels.on_stale=fail would then pass a cache that holds nothing.
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"argument --jobs: must be 1 or more, got {args.jobs}")
    if args.sms < 1:
        parser.error(f"argument --sms: must be 1 or more, got {args.sms}")

    try:
        # The training job's plan, for the target: a Hopper GPU with the cuda extras.
        plan = target_plan(args.overrides)
    except (ValueError, ConfigCompositionException) as error:
        return f"error: {error}"
    run = plan.run
    if run.kernels.cache_dir is None:
        return "error: say where the kernels go: kernels.cache_dir=<dir> (the training job takes the same)"
    print("\n".join(plan.header()))
    shapes = plan.kernel_shapes
    if not shapes.any:
        print(f"block={plan.block.describe()} launches no CuTeDSL kernels: nothing to compile")
        return 0

    if args.check:
        problems = cache_problems(run.kernels.cache_dir, shapes, args.sms)
        for problem in problems:
            print(f"stale: {problem}")
        print("kernel cache: " + ("does not fit" if problems else "fits") + f" {shapes.key}")
        return 1 if problems else 0
    try:
        report = precompile(shapes, run.kernels.cache_dir, num_sms=args.sms, jobs=args.jobs)
    except KernelCacheError as error:
        return f"error: {error}"
    width = max(len(name) for name in report.kernels)
    for name, seconds in report.kernels.items():
        print(f"  {name:<{width}}  {seconds:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
