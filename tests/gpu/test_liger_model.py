"""block=liger (the eager Llama on liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear
cross-entropy) against the eager Llama, on a CUDA GPU with liger-kernel 0.8.5.

Both models are loaded with the same canonical weights. Truth is the eager model in fp32; the eager
model in bf16 gives the error that bf16 itself causes. Tolerance as in test_cute_model.py: the loss
within 2 × the eager bf16 loss error (at least 5e-3 relative), every parameter gradient
‖g_liger − g_fp32‖ / ‖g_fp32‖ ≤ 2 × the eager bf16 gradient's error (at least 1e-2), and the logits
of the no-targets path likewise. Both reductions, with and without document masking (the attention
is the eager model's; Liger's RoPE takes per-document positions as per-row cos/sin).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from codatrain.kernels.stages import BackendUnavailableError
from codatrain.model.liger import LigerLlama, check_liger

try:
    check_liger("cuda")
except BackendUnavailableError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from cute_check import DEVICE, load_canonical, model_failures, rel_err  # noqa: E402
from model_states import random_canonical_state  # noqa: E402

from codatrain.model.config import LlamaConfig, get_preset  # noqa: E402
from codatrain.model.llama import IGNORE_INDEX, Llama  # noqa: E402

pytestmark = pytest.mark.gpu
OUT_RTOL_FLOOR = 1e-2

# name: (config, document lengths of each row, which also give batch and sequence length)
CASES = {
    # Llama-3.2-1B widths with two layers: the fused head + loss runs in many row chunks.
    "llama3_1b-L2": (dataclasses.replace(get_preset("llama3_1b"), n_layers=2), [[300, 1, 200, 523], [1024]]),
    # GQA 4:1, head dim 64, three layers, ragged M, vocab and MLP width.
    "gqa4-small": (LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=1, ffn_dim=704,
                               vocab_size=1000, rope_theta=10000.0), [[50, 1, 149], [200], [120, 80]]),
}


def doc_ids_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.arange(len(ls)).repeat_interleave(torch.tensor(ls)) for ls in lengths_per_row]
    return torch.stack(rows).to(DEVICE)


def run(model, tokens, targets, doc_ids, reduction) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """Loss and canonical gradients of one forward + backward, and the logits of the no-targets path."""
    loss = model(tokens, targets, doc_ids=doc_ids, reduction=reduction)
    loss.backward()
    layout = model.layout()
    grads = {layout[n].name: layout[n].to_canonical(p.grad).double() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids).float()
    return loss.item(), grads, logits


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_liger_model_matches_eager(case, reduction, documents):
    cfg, lengths = CASES[case]
    batch, seq = len(lengths), sum(lengths[0])
    state = random_canonical_state(cfg, torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets[0, 5:40] = IGNORE_INDEX
    targets = targets.to(DEVICE)
    doc_ids = doc_ids_of(lengths) if documents else None

    runs = {}
    for label, make, dtype in [
        ("eager-fp32", lambda: Llama(cfg), torch.float32),
        ("eager-bf16", lambda: Llama(cfg), torch.bfloat16),
        ("liger-bf16", lambda: LigerLlama(cfg, device=DEVICE), torch.bfloat16),
    ]:
        with torch.device("meta"):  # no init: every parameter is loaded below
            model = make()
        model = model.to_empty(device=DEVICE).to(dtype)
        load_canonical(model, state)
        runs[label] = run(model, tokens, targets, doc_ids, reduction)
        del model

    (loss32, grads32, logits32), (loss16, grads16, logits16), (loss_l, grads_l, logits_l) = runs.values()
    name = f"{case}/{reduction}/{'documents' if documents else 'causal'}"
    failures = model_failures(name, "liger", loss_l, loss16, loss32, grads_l, grads16, grads32)
    err, bf16_err = rel_err(logits_l, logits32), rel_err(logits16, logits32)
    if not err <= max(2 * bf16_err, OUT_RTOL_FLOOR):
        failures.append(f"logits: liger {err:.3e} > 2 × eager-bf16 {bf16_err:.3e}")
    assert not failures, "\n".join(failures)
