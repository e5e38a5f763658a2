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
from unittest import mock

import torch

from codatrain.kernels.attention import sdpa_attention
from codatrain.kernels.cache import HOPPER_SMS, KernelShapes
from codatrain.kernels.cute import CuteStages, head
from codatrain.kernels.cute.pins import compile_only, kernel_counts, skipping_lce_glue
from codatrain.kernels.fp8 import GRAD_FORMATS, Fp8Recipe
from codatrain.kernels.resolve import ResolvedBlock
from codatrain.model.coda import CodaLlama
from codatrain.model.config import LlamaConfig


def _family(shapes: KernelShapes) -> str:
    """A model family with the attention epilogues of `shapes`."""
    return "qwen3" if shapes.qk_norm else "qwen2" if shapes.qkv_bias else "llama"


def main(shapes: KernelShapes) -> dict:
    started = time.time()
    cfg = LlamaConfig(dim=shapes.dim, n_layers=2, n_heads=shapes.n_heads, n_kv_heads=shapes.n_kv_heads,
                      ffn_dim=shapes.ffn_dim, vocab_size=shapes.vocab_size,
                      head_dim=shapes.head_dim, family=_family(shapes), qkv_bias=shapes.qkv_bias,
                      qk_norm=shapes.qk_norm)
    # The head's check of its loss is a host sync, which fake tensors cannot answer: the job's
    # usual answer (the rerun's kernels are compiled by the same spec). Its SM count only sizes
    # an output; its scaled-exp glue is Triton's, which a CPU cannot even trace.
    with compile_only(HOPPER_SMS), mock.patch.object(head, "scaled_exp_is_exact", lambda loss: True), \
            mock.patch.object(head, "get_sm_count", lambda *args: HOPPER_SMS), skipping_lce_glue():
        # The cute stages without a device check (there is none), and fake parameters, initialised,
        # in bf16 (fake tensors cannot be converted by `Module.to`).
        torch.set_default_dtype(torch.bfloat16)
        fp8 = (Fp8Recipe(grad_dtype=GRAD_FORMATS[shapes.fp8_grad_format], wgrad_fp8=shapes.fp8_wgrad,
                         fast_accum=shapes.fp8_fast_accum) if shapes.fp8 else None)
        stages = CuteStages() if fp8 is None else CuteStages().for_fp8(fp8)
        model = CodaLlama(cfg, ResolvedBlock("coda", "cute", "sdpa", stages, sdpa_attention), fp8=fp8)
        torch.set_default_dtype(torch.float32)
        tokens = torch.zeros(shapes.batch, shapes.seq_len, dtype=torch.int64)
        model(tokens, tokens).backward()
        if fp8 is not None:
            model.fp8_scaling.commit_step()
            model(tokens, tokens).backward()
    loaded, compiled, names = kernel_counts(started)
    return {"loaded": loaded, "compiled": compiled, "names": names}


if __name__ == "__main__":
    print(json.dumps(main(KernelShapes(**json.loads(sys.argv[1])))))
