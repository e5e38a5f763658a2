"""The logits path (the model called without targets) in bf16, as FSDP2's mixed-precision policy
runs it: its backward in bf16, the CODA reference model against the eager one, with fp64 as the
truth."""

import torch
from test_coda import CONFIGS, batch, canonical_grads, model_pair

CFG = CONFIGS["gqa2-L3"]


def logits_grads(model, tokens, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, canonical parameter gradients of Σ logits ⊙ weights), all in fp64 for comparison."""
    logits = model(tokens)
    (logits.double() * weights).sum().backward()
    return logits, canonical_grads(model)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def test_logits_backward_in_bf16_no_worse_than_eager():
    """DESIGN §5's bar: against fp64, CODA's logits and every gradient are within 2× the error of
    the eager model run the same way."""
    exact, _ = model_pair(CFG, torch.float64)
    eager, coda = model_pair(CFG, torch.bfloat16)
    tokens, _ = batch(CFG, 3, 16, ignore=False)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(3, 16, CFG.vocab_size, dtype=torch.float64, generator=g)
    ref_logits, ref_grads = logits_grads(exact, tokens, weights)
    eager_logits, eager_grads = logits_grads(eager, tokens, weights)
    coda_logits, coda_grads = logits_grads(coda, tokens, weights)
    assert coda_logits.dtype == eager_logits.dtype == torch.bfloat16
    assert rel_err(coda_logits, ref_logits) <= 2 * rel_err(eager_logits, ref_logits)
    for name, ref in ref_grads.items():
        assert coda_grads[name].dtype == torch.bfloat16, name  # gradients reach the parameters in their dtype
        coda_err, eager_err = rel_err(coda_grads[name], ref), rel_err(eager_grads[name], ref)
        assert coda_err <= 2 * eager_err, (name, coda_err, eager_err)
