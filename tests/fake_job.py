"""One training micro-step of block=coda on the cute backend, on fake tensors, launching nothing:
which CuTeDSL kernels would a job of these shapes compile that its cache does not hold?

    python tests/fake_job.py '<KernelShapes as JSON>'   (in the environment of a compile process)

Runs the model's forward and backward (two layers, bf16 parameters as FSDP2's policy hands them
to the model on a GPU, SDPA: FA4 keeps its own cache) under `compile_only`, where every stage takes
its own Python path, compiles or loads its kernels and launches nothing, then prints
`kernel_counts` as JSON. With FP8 (block.precision=fp8) it runs two micro-steps: a run's first,
scaled by the current amaxes, and one of a later step, scaled by the amax history.
`test_precompile.py` runs it against a cache that scripts/precompile.py built: every kernel must
load, none compile.
"""

import json
import sys
import time

from codatrain.kernels.cache import KernelShapes
from codatrain.kernels.cute.pins import kernel_counts
from codatrain.model.config import LlamaConfig
from codatrain.train.fake_step import fake_cute_model


def _family(shapes: KernelShapes) -> str:
    """A model family with the attention epilogues of `shapes`."""
    return "qwen3" if shapes.qk_norm else "qwen2" if shapes.qkv_bias else "llama"


def main(shapes: KernelShapes) -> dict:
    started = time.time()
    cfg = LlamaConfig(dim=shapes.dim, n_layers=2, n_heads=shapes.n_heads, n_kv_heads=shapes.n_kv_heads,
                      ffn_dim=shapes.ffn_dim, vocab_size=shapes.vocab_size,
                      head_dim=shapes.head_dim, family=_family(shapes), qkv_bias=shapes.qkv_bias,
                      qk_norm=shapes.qk_norm)
    with fake_cute_model(cfg, shapes) as (model, tokens):
        model(tokens, tokens).backward()
        if model.fp8_scaling is not None:
            model.fp8_scaling.commit_step()
            model(tokens, tokens).backward()
    loaded, compiled, names = kernel_counts(started)
    return {"loaded": loaded, "compiled": compiled, "names": names}


if __name__ == "__main__":
    print(json.dumps(main(KernelShapes(**json.loads(sys.argv[1])))))
