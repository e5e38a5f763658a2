"""What each QuACK GEMM kernel of a training config compiles to for Hopper (sm_90a), on any machine,
GPU or not: its CTA tile, the depth of its A/B pipeline (k-tiles in flight: QuACK gives the pipeline
the shared memory its epilogue leaves), the register spills in its SASS (local-memory stores and
loads, STL / LDL instructions per thread) and a digest of that SASS. For choosing tile configs
(codatrain/kernels/cute/configs.py) before a GPU run: docs/benchmarks.md, "FP8 backward tiles".

    python scripts/kernel_report.py model=llama3_8b block.precision=fp8 [--json report.json]

The digest hashes the kernel's instructions alone, not its name (which carries QuACK's fingerprint
of the epilogue's source): a change that should leave a kernel's machine code as it was (a refactor
of an epilogue, a helper moved) keeps its digest, which two trees' reports of the same config show
without a GPU.

Takes the overrides of scripts/train.py (block defaults to coda). Compiles the config's stage
kernels (FA4's are not QuACK GEMMs) in a process of its own, into a fresh temporary cache so that
every kernel is built rather than loaded, launching nothing (a minute or two on two cores).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra.errors import ConfigCompositionException

from codatrain.kernels.cache import HOPPER_SMS, KernelShapes, compile_env
from codatrain.train.plan import target_plan

# One SASS line per instruction; a spill is a store to or a load from local memory.
_SPILL_STORE, _SPILL_LOAD = re.compile(r"\bSTL(\.\w+)*\s"), re.compile(r"\bLDL(\.\w+)*\s")


# An instruction line: its address as a comment, then the instruction.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.+?)\s*$", re.MULTILINE)


def spills(sass: str) -> tuple[int, int]:
    """(local-memory store instructions, load instructions) in a kernel's SASS."""
    return len(_SPILL_STORE.findall(sass)), len(_SPILL_LOAD.findall(sass))


def sass_digest(sass: str) -> str:
    """The first 12 hex digits of the SHA-256 of a kernel's SASS instructions, in order (section,
    symbol and kernel names left out)."""
    return hashlib.sha256("\n".join(_INSTRUCTION.findall(sass)).encode()).hexdigest()[:12]


def compile_and_report(shapes: KernelShapes, dump_dir: Path) -> list[dict]:
    """In a compile process (`compile_env`, plus CuTeDSL keeping each kernel's SASS in `dump_dir`):
    compile the stage kernels of `shapes`, spec by spec, and describe each QuACK GEMM it builds."""
    import quack.gemm_sm90

    from codatrain.kernels.cute.compile_specs import compile_specs, kernel_specs

    # QuACK picks the stage counts when it builds a kernel (a private classmethod): recorded here.
    gemm = quack.gemm_sm90.GemmSm90
    compute_stages = gemm._compute_stages.__func__
    built: list[dict] = []

    def recording(cls, cta_tile_shape_mnk, *args, **kwargs):  # noqa: ANN001, ANN202 (QuACK's signature)
        ab_stages, epi_stages, epi_c_stages = compute_stages(cls, cta_tile_shape_mnk, *args, **kwargs)
        built.append({"kernel": cls.__name__, "cta_tile": list(cta_tile_shape_mnk), "ab_stages": ab_stages,
                      "epilogue_stages": epi_stages, "epilogue_load_stages": epi_c_stages})
        return ab_stages, epi_stages, epi_c_stages

    gemm._compute_stages = classmethod(recording)
    report = []
    for spec in kernel_specs(shapes):
        if spec.name.startswith("FA4"):
            continue
        for old in dump_dir.glob("*.sass"):  # CuTeDSL names the files by kernel, not by tile
            old.unlink()
        built.clear()
        compile_specs([spec], HOPPER_SMS, log=lambda line: print(line, file=sys.stderr, flush=True))
        for kernel in built:
            # A kernel's files are named after its module path and class: ...frontend<class>_...
            sass = "".join(path.read_text() for path in sorted(dump_dir.glob("*.sass"))
                           if kernel["kernel"] in path.name)
            stores, loads = spills(sass) if sass else (None, None)
            report.append({"spec": spec.name, **kernel, "spill_stores": stores, "spill_loads": loads,
                           "sass_digest": sass_digest(sass) if sass else None})
    return report


def main(argv: list[str]) -> int | str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides, as for scripts/train.py")
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument("--shapes", help=argparse.SUPPRESS)  # the compile process's own argument
    args = parser.parse_intermixed_args(argv)
    if args.shapes:
        shapes = KernelShapes(**json.loads(args.shapes))
        print(json.dumps(compile_and_report(shapes, Path(os.environ["CUTE_DSL_DUMP_DIR"]))))
        return 0

    try:
        plan = target_plan(args.overrides)
    except (ValueError, ConfigCompositionException) as error:
        return f"error: {error}"
    shapes = plan.kernel_shapes
    if not shapes.stages:
        return f"error: block={plan.block.describe()} runs no CuTeDSL GEMM stages"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**compile_env(Path(tmp) / "cache", HOPPER_SMS), "CUTE_DSL_KEEP": "sass",
               "CUTE_DSL_DUMP_DIR": str(Path(tmp))}
        proc = subprocess.run([sys.executable, __file__, "--shapes", json.dumps(dataclasses.asdict(shapes))],
                              env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"error: the compile process failed:\n{proc.stderr[-5000:]}"
    report = json.loads(proc.stdout.splitlines()[-1])
    print(f"{'kernel (the first kernel spec that builds it)':<60} {'CTA tile':>12} {'A/B stages':>10} "
          f"{'spill st/ld':>12} {'SASS digest':>12}")
    for row in report:
        name = f"{row['kernel'].removeprefix('GemmMod_')[:28]} ({row['spec'][:28]})"
        tile = "×".join(str(n) for n in row["cta_tile"])
        spilled = "?" if row["spill_stores"] is None else f"{row['spill_stores']}/{row['spill_loads']}"
        print(f"{name:<60} {tile:>12} {row['ab_stages']:>10} {spilled:>12} {row['sass_digest'] or '?':>12}")
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "kernels": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
