"""The whole CODA model on the cute backend (FA4 attention) against the eager Llama, and with llama3
RoPE and a tied head against the reference backend, on an sm_90 GPU.

All models are loaded with the same canonical weights. Truth is the eager model (or the reference
backend) in fp32; the same model in bf16 (SDPA attention) gives the error that bf16 itself causes.
Tolerance: the loss within 2 × the bf16 loss error (at least 5e-3 relative), and every parameter
gradient ‖g_cute − g_fp32‖ / ‖g_fp32‖ ≤ 2 × the bf16 gradient's error (at least 1e-2).
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

from codatrain.kernels.resolve import resolve_block  # noqa: E402
from codatrain.model.coda import CodaLlama  # noqa: E402
from codatrain.model.config import LlamaConfig, get_preset  # noqa: E402
from codatrain.model.llama import IGNORE_INDEX, Llama  # noqa: E402

pytestmark = pytest.mark.gpu


def cute_block(attention: str = "fa4"):
    """The CODA block of the cute stages and FA4 (or `attention`), loaded for the GPU."""
    return resolve_block("coda", "cute", attention, DEVICE)


# name: (config, batch, sequence length)
CASES = {
    # Llama-3.2-1B widths with two layers: the LM head's backward runs in two ragged row chunks.
    "llama3_1b-L2": (dataclasses.replace(get_preset("llama3_1b"), n_layers=2), 2, 1024),
    # GQA 4:1, head dim 64, three layers, ragged M, vocab and MLP width.
    "gqa4-small": (LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=704,
                               vocab_size=1000, rope_theta=10000.0), 3, 200),
}


def loss_and_grads(model, tokens, targets) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(tokens, targets)
    loss.backward()
    layout = model.layout()
    grads = {layout[n].name: layout[n].to_canonical(p.grad).double() for n, p in model.named_parameters()}
    return loss.item(), grads


def compare(case: str, cfg: LlamaConfig, batch: int, seq: int, truth, bf16_baseline, under_test,
            head_scale: float = 1.0) -> None:
    """Each of (label, make, dtype) built on the meta device, loaded with the same canonical weights
    and run on one batch; `under_test` must be within the tolerances of the module docstring, with
    `truth` (fp32) as the truth and `bf16_baseline` giving the error bf16 itself causes.
    `head_scale` multiplies the LM head's matrix (the embedding, when tied), and so the logits."""
    state = random_canonical_state(cfg, torch.float32, seed=0)
    head = "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    state[head] = state[head] * head_scale
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets[0, 5:40] = IGNORE_INDEX
    targets = targets.to(DEVICE)

    runs = {}
    for label, make, dtype in (truth, bf16_baseline, under_test):
        # Built on the meta device (no init: every parameter is loaded below), then materialised.
        with torch.device("meta"):
            model = make()
        model = model.to_empty(device=DEVICE).to(dtype)
        load_canonical(model, state)
        runs[label] = loss_and_grads(model, tokens, targets)
        del model

    (loss32, grads32), (loss16, grads16), (loss_c, grads_c) = runs.values()
    failures = model_failures(case, "cute", loss_c, loss16, loss32, grads_c, grads16, grads32)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", list(CASES))
def test_cute_model_matches_eager(case):
    cfg, batch, seq = CASES[case]
    compare(case, cfg, batch, seq,
            ("eager-fp32", lambda: Llama(cfg), torch.float32),
            ("eager-bf16", lambda: Llama(cfg), torch.bfloat16),
            ("coda-cute-bf16", lambda: CodaLlama(cfg, cute_block()), torch.bfloat16))


# Llama 3.2's RoPE scaling (a pretraining context of 64 positions, so the 200-token sequences reach
# well past it) and its tied head, at Llama-3.2-1B widths and a small ragged model.
LLAMA3_TIED = {"rope_type": "llama3", "rope_factor": 32.0, "rope_low_freq_factor": 1.0,
               "rope_high_freq_factor": 4.0, "rope_original_max_positions": 64, "tie_embeddings": True}
LLAMA3_CASES = {
    "llama3_2_1b-L2": (get_preset("llama3_2_1b").replace(n_layers=2, rope_original_max_positions=64),
                       2, 1024),
    "gqa4-small-llama3-tied": (CASES["gqa4-small"][0].replace(**LLAMA3_TIED), 3, 200),
}


@pytest.mark.parametrize("case", list(LLAMA3_CASES))
def test_cute_model_with_llama3_rope_and_tied_head_matches_reference(case):
    """The cute backend against the reference backend (fp32 truth, bf16 baseline): the scaled
    frequency table reaches the RoPE epilogue and its backward, and the tied head's weight
    gradient adds into the embedding's."""
    cfg, batch, seq = LLAMA3_CASES[case]
    assert cfg.tie_embeddings and cfg.rope_type == "llama3" and seq > cfg.rope_original_max_positions
    compare(case, cfg, batch, seq,
            ("reference-fp32", lambda: CodaLlama(cfg), torch.float32),
            ("reference-bf16", lambda: CodaLlama(cfg), torch.bfloat16),
            ("coda-cute-bf16", lambda: CodaLlama(cfg, cute_block()), torch.bfloat16))


def against_reference(case: str, cfg: LlamaConfig, batch: int, seq: int, head_scale: float = 1.0,
                      attention: str = "fa4") -> None:
    """The cute model against the reference backend: fp32 truth, bf16 baseline."""
    compare(case, cfg, batch, seq,
            ("reference-fp32", lambda: CodaLlama(cfg), torch.float32),
            ("reference-bf16", lambda: CodaLlama(cfg), torch.bfloat16),
            ("coda-cute-bf16", lambda: CodaLlama(cfg, cute_block(attention)), torch.bfloat16),
            head_scale)


# Widths that are multiples of 8 but of no tile, head dims other than 64 and 128, vocabularies that
# are not multiples of 8 (GPT-2's, Llama 2's plus three added tokens, a tiny one), and row and
# sequence counts that are odd. name: (config, batch, sequence length, attention)
ODD_CASES = {
    "gpt2-vocab": (LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1368,
                               vocab_size=50257, rope_theta=10000.0), 3, 197, "fa4"),
    "vocab32003-hd96-tied-llama3": (LlamaConfig(dim=480, n_layers=2, n_heads=5, n_kv_heads=1, ffn_dim=1400,
                                                vocab_size=32003, rope_theta=10000.0).replace(**LLAMA3_TIED),
                                    2, 300, "fa4"),
    "hd256": (LlamaConfig(dim=512, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=1024, vocab_size=1000,
                          rope_theta=10000.0), 1, 129, "fa4"),
    "hd160-vocab151": (LlamaConfig(dim=640, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=1712, vocab_size=151,
                                   rope_theta=10000.0), 2, 100, "fa4"),
    # Qwen2's QKV bias: F4's bias epilogue, the RoPE backward's bias term and the bias gradient.
    "qwen2-qkv-bias": (LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1368,
                                   vocab_size=1000, rope_theta=10000.0, family="qwen2", qkv_bias=True),
                       2, 150, "fa4"),
    # Qwen3's QK-norm: F4's QK-norm + RoPE epilogue, its backward and the norm weights' gradients,
    # at head dim 64 with a tied head, and at Qwen3-0.6B's attention widths (head dim 128).
    "qwen3-qk-norm-hd64": (LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=704,
                                       vocab_size=1000, rope_theta=1000000.0, norm_eps=1e-6, family="qwen3",
                                       qk_norm=True, tie_embeddings=True), 2, 150, "fa4"),
    "qwen3_0_6b-L2": (get_preset("qwen3_0_6b").replace(n_layers=2, vocab_size=1000), 2, 256, "fa4"),
    # A head dim FA4 gets wrong (resolve.FA4_HEAD_DIMS): the cute stages with SDPA, as `auto` picks.
    "hd80-sdpa": (LlamaConfig(dim=640, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1712, vocab_size=151,
                              rope_theta=10000.0), 2, 100, "sdpa"),
}


@pytest.mark.parametrize("case", list(ODD_CASES))
def test_cute_model_at_odd_shapes_matches_reference(case):
    cfg, batch, seq, attention = ODD_CASES[case]
    against_reference(case, cfg, batch, seq, attention=attention)


# The head at logits of magnitude 1e2 to 1e4 (losses of hundreds to thousands of nats per token,
# far past the scaled-exp pipeline's exact range): the d 1536 model with head dim 128,
# llama3 RoPE and a 32000 vocabulary (the scaled-exp shape), tied and untied. The random state's
# untied head gives logits of about 1 (×scale); the tied one about d = 1536 at the input token.
LARGE_LOGITS_CFG = LlamaConfig(dim=1536, n_layers=2, n_heads=12, n_kv_heads=4, ffn_dim=4000, vocab_size=32000,
                               rope_type="llama3", rope_factor=32.0, rope_original_max_positions=64)
LARGE_LOGITS = {
    "tied-1e2": (True, 0.1),
    "tied-1e3": (True, 1.0),
    "tied-1e4": (True, 6.5),
    "untied-1e2": (False, 100.0),
    "untied-1e4": (False, 1e4),
}


@pytest.mark.parametrize("case", list(LARGE_LOGITS))
def test_cute_model_at_large_logits_matches_reference(case):
    tied, head_scale = LARGE_LOGITS[case]
    against_reference(case, LARGE_LOGITS_CFG.replace(tie_embeddings=tied), 2, 256, head_scale)
