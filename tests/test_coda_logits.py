"""The logits path (the model called without targets) in low precision: its backward in bf16 and
under bf16 autocast, the CODA reference model against the eager one, with fp64 as the truth."""

import pytest
import torch
from test_coda import CONFIGS, batch, canonical_grads, model_pair

CFG = CONFIGS["gqa2-L3"]


def logits_grads(model, tokens, weights, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, canonical parameter gradients of Σ logits ⊙ weights), all in fp64 for comparison."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
        (logits.double() * weights).sum().backward()  # inside the region, as a training step may
    return logits, canonical_grads(model)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_logits_backward_in_low_precision_no_worse_than_eager(mode):
    """DESIGN §5's bar: against fp64, CODA's logits and every gradient are within 2× the error of
    the eager model run the same way."""
    exact, _ = model_pair(CFG, torch.float64)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    eager, coda = model_pair(CFG, dtype)
    tokens, _ = batch(CFG, 3, 16, ignore=False)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(3, 16, CFG.vocab_size, dtype=torch.float64, generator=g)
    ref_logits, ref_grads = logits_grads(exact, tokens, weights, autocast=False)
    eager_logits, eager_grads = logits_grads(eager, tokens, weights, autocast=mode == "autocast")
    coda_logits, coda_grads = logits_grads(coda, tokens, weights, autocast=mode == "autocast")
    assert coda_logits.dtype == eager_logits.dtype == torch.bfloat16
    assert rel_err(coda_logits, ref_logits) <= 2 * rel_err(eager_logits, ref_logits)
    for name, ref in ref_grads.items():
        assert coda_grads[name].dtype == dtype, name  # gradients reach the parameters in their dtype
        coda_err, eager_err = rel_err(coda_grads[name], ref), rel_err(eager_grads[name], ref)
        assert coda_err <= 2 * eager_err, (name, coda_err, eager_err)
