"""How deep is each GEMM's A/B pipeline? Compiles the kernels of a job's shapes (every spec but FA4's)
for sm_90a, launching nothing, and prints, as JSON, each QuACK GEMM kernel's CTA tile and the
number of A/B stages (k-tiles in flight) QuACK gave it.

    python tests/gemm_pipelines.py '<KernelShapes as JSON>'   (in the environment of a compile process)

QuACK sizes the pipeline with the shared memory the epilogue leaves (its staged C, TileLoads and
outputs), when it builds a kernel; `test_precompile.py` holds every layer GEMM to a depth that
keeps the mainloop fed (docs/benchmarks.md, "FP8 backward tiles").
"""

import json
import sys

import quack.gemm_sm90

from codatrain.kernels.cache import HOPPER_SMS, KernelShapes
from codatrain.kernels.cute.compile_specs import compile_specs, kernel_specs


def main(shapes: KernelShapes) -> list[dict]:
    pipelines = []
    gemm = quack.gemm_sm90.GemmSm90
    compute_stages = gemm._compute_stages.__func__

    def recording(cls, cta_tile_shape_mnk, *args, **kwargs):
        ab_stages, epi_stages, epi_c_stages = compute_stages(cls, cta_tile_shape_mnk, *args, **kwargs)
        pipelines.append({"kernel": cls.__name__, "cta_tile": list(cta_tile_shape_mnk),
                          "ab_stages": ab_stages})
        return ab_stages, epi_stages, epi_c_stages

    gemm._compute_stages = classmethod(recording)
    specs = [spec for spec in kernel_specs(shapes) if not spec.name.startswith("FA4")]
    compile_specs(specs, HOPPER_SMS, log=lambda line: print(line, file=sys.stderr))
    return pipelines


if __name__ == "__main__":
    print(json.dumps(main(KernelShapes(**json.loads(sys.argv[1])))))
