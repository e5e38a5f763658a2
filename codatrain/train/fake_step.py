"""The cute CODA model on fake tensors, launching nothing: on any machine, GPU or not, each stage
compiles or loads its CuTeDSL kernels for Hopper (`compile_only`) and runs its own Python path.
What tests/fake_job.py (does a precompiled job compile anything?) and scripts/memory_report.py (the
tensors a micro-step holds) run. Use it in a process with a compile process's environment
(`codatrain.kernels.cache.compile_env`), which CuTeDSL reads when first imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from codatrain.kernels.attention import sdpa_attention
from codatrain.kernels.cache import HOPPER_SMS, KernelShapes
from codatrain.kernels.cute import CuteStages, head
from codatrain.kernels.cute.pins import compile_only, skipping_lce_glue
from codatrain.kernels.fp8 import GRAD_FORMATS, Fp8Recipe
from codatrain.kernels.resolve import ResolvedBlock
from codatrain.model.coda import CodaLlama
from codatrain.model.config import LlamaConfig


@contextlib.contextmanager
def fake_cute_model(cfg: LlamaConfig, shapes: KernelShapes) -> Iterator[tuple[CodaLlama, torch.Tensor]]:
    """(the cute CODA model of `cfg` with the FP8 recipe of `shapes`, a micro-batch of `shapes`'
    token ids), both fake, for use inside the block: SDPA attention (FA4 keeps its own cache), bf16
    parameters as FSDP2's policy hands them to the model on a GPU."""
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
        yield model, torch.zeros(shapes.batch, shapes.seq_len, dtype=torch.int64)
