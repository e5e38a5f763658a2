"""The CODA model with FP8 layer GEMMs (block.precision=fp8) on the cute backend (FA4 attention)
against the reference backend's FP8 twin, on an sm_90 GPU.

Truth is the reference FP8 model in fp32 (FP8 operands quantized from fp32 values, fp32 GEMMs of
the FP8 values); the same model in bf16 gives the error that bf16 activations cause under the same
recipe (values that round to another FP8 neighbour, then everything downstream of them). The cute
FP8 model in bf16 must be within the cute_check model criterion of the truth with that baseline:
the loss within 2× the baseline's distance (floor 5e-3 relative), every gradient within 2× the
baseline's error (floor 1e-2). Two steps of the recipe: a run's first (current scaling: no
history yet) and a later one (delayed scaling: every model loads the same amax history).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")
pytest.importorskip("flash_attn.cute")

from cute_check import DEVICE, load_canonical, model_failures  # noqa: E402
from model_states import random_canonical_state  # noqa: E402
from test_cute_model import loss_and_grads  # noqa: E402

from codatrain.kernels.fp8 import Fp8Recipe  # noqa: E402
from codatrain.kernels.resolve import resolve_block  # noqa: E402
from codatrain.model.coda import CodaLlama  # noqa: E402
from codatrain.model.config import LlamaConfig, get_preset  # noqa: E402
from codatrain.model.llama import IGNORE_INDEX  # noqa: E402

pytestmark = pytest.mark.gpu

# name: (config, batch, sequence length); tokens per micro-batch a multiple of 16 (FP8 rows).
CASES = {
    "llama3_1b-L2": (dataclasses.replace(get_preset("llama3_1b"), n_layers=2), 2, 1024),
    "gqa4-small-L3": (LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=704, vocab_size=1000,
                                  rope_theta=10000.0), 2, 200),
    # Qwen2's QKV bias (F4's FP8 bias epilogue; its gradient from the unrounded dz) and Qwen3's
    # QK-norm (F4's FP8 QK-norm epilogue; dz quantized after its backward), tied heads.
    "qwen2-bias-L3": (LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=704,
                                  vocab_size=1000, rope_theta=1000000.0, family="qwen2", qkv_bias=True,
                                  tie_embeddings=True), 2, 200),
    "qwen3-qknorm-L3": (LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=704,
                                    vocab_size=1000, rope_theta=1000000.0, norm_eps=1e-6, family="qwen3",
                                    qk_norm=True, tie_embeddings=True), 2, 200),
}


@pytest.mark.parametrize("wgrad_fp8", [True, False], ids=["wgrad_fp8", "wgrad_bf16"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("case", list(CASES))
def test_cute_fp8_model_matches_the_reference_fp8_twin(case, scaling, wgrad_fp8):
    cfg, batch, seq = CASES[case]
    recipe = Fp8Recipe(wgrad_fp8=wgrad_fp8)
    state = random_canonical_state(cfg, torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets[0, 5:40] = IGNORE_INDEX
    targets = targets.to(DEVICE)
    reference = resolve_block("coda", "reference", "sdpa", DEVICE)
    cute = resolve_block("coda", "cute", "fa4", DEVICE)

    history = None
    runs = {}
    for label, block, dtype in (("reference-fp8-fp32", reference, torch.float32),
                                ("reference-fp8-bf16", reference, torch.bfloat16),
                                ("coda-cute-fp8-bf16", cute, torch.bfloat16)):
        with torch.device("meta"):
            model = CodaLlama(cfg, block, fp8=recipe)
        model = model.to_empty(device=DEVICE).to(dtype)
        load_canonical(model, state)
        if scaling == "delayed":
            if history is None:
                # The truth's first step gives the history all three models then scale by.
                model(tokens, targets).backward()
                model.fp8_scaling.commit_step()
                history = {k: v.clone() for k, v in model.fp8_scaling.state_dict().items()}
                model.zero_grad()
            model.fp8_scaling.load_state_dict(history)
            assert model.fp8_scaling.scales is not None
        runs[label] = loss_and_grads(model, tokens, targets)
        step_amax = model.fp8_scaling.step_amax[:, recipe.operands()]
        assert torch.isfinite(step_amax).all() and (step_amax > 0).all()
        del model

    (loss32, grads32), (loss16, grads16), (loss_c, grads_c) = runs.values()
    failures = model_failures(f"{case}-{scaling}", "cute-fp8", loss_c, loss16, loss32,
                              grads_c, grads16, grads32)
    assert not failures, "\n".join(failures)
