"""Document masking on an sm_90 GPU: FA4's variable-length attention (`fa4_attention` with
`Documents`), and the whole CODA model on the cute backend with doc_ids, against each document
run alone.

Truth is every document run alone in fp32 (plain causal attention, no mask); the same in bf16
gives the error that bf16 itself causes. Tolerance as in test_cute_model.py: outputs and every
gradient within 2 × the bf16 error (relative norms, with floors), the loss within 2 × the bf16
loss error (at least 5e-3 relative). The eager model's masked path on CUDA (flex_attention,
compiled) is held to the same bound.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the cute kernels need an sm_90 GPU", allow_module_level=True)
pytest.importorskip("quack")
pytest.importorskip("flash_attn.cute")

from model_states import documents_of, random_canonical_state  # noqa: E402

from codatrain.kernels.attention import documents_from_ids, sdpa_attention  # noqa: E402
from codatrain.kernels.cute.attention import fa4_attention  # noqa: E402
from codatrain.kernels.resolve import resolve_block  # noqa: E402
from codatrain.model.coda import CodaLlama  # noqa: E402
from codatrain.model.config import get_preset  # noqa: E402
from codatrain.model.llama import IGNORE_INDEX, Llama  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
OUT_RTOL_FLOOR = 1e-2
LOSS_RTOL_FLOOR = 5e-3
GRAD_RTOL_FLOOR = 1e-2


def cute_block():
    """The CODA block of the cute stages and FA4, loaded for the GPU."""
    return resolve_block("coda", "cute", "fa4", DEVICE)


def doc_ids_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """(rows, T) document ids from each row's document lengths (every row sums to T)."""
    rows = [
        torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths)) for lengths in lengths_per_row
    ]
    return torch.stack(rows).to(DEVICE)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


# name: document lengths of each row
ATTENTION_CASES = {
    # A one-token document, one crossing several 128-row tiles, and a row that is one document.
    "mixed": [[300, 1, 200, 523], [1024]],
    # 410 documents: more than FA4's BIN_BATCH_SEARCH_THRESH (256), its batch-lookup variant.
    "many-short": [[5] * 204 + [4], [5] * 204 + [4]],
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_fa4_varlen_equals_each_document_alone(case, compiled):
    doc_ids = doc_ids_of(ATTENTION_CASES[case])
    batch, seq = doc_ids.shape
    h_q, h_kv, d = 32, 8, 64  # Llama-3.2-1B heads
    g = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = torch.randn(batch, seq, h_q + 2 * h_kv, d, generator=g, device=DEVICE)
    dout = torch.randn(batch, seq, h_q, d, generator=g, device=DEVICE)
    documents = documents_from_ids(doc_ids)
    if compiled:
        torch._dynamo.reset()  # compiles afresh, below Dynamo's recompile limit
    attention = torch.compile(fa4_attention, fullgraph=True) if compiled else fa4_attention

    leaf = qkv.to(torch.bfloat16).requires_grad_()
    out = attention(leaf, h_kv, documents)
    out.backward(dout.to(torch.bfloat16))

    def alone(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and dqkv, each document through plain causal SDPA on its own."""
        leaf = qkv.to(dtype).detach().requires_grad_()  # its own leaf: qkv.to(fp32) is qkv itself
        outs = torch.zeros(batch, seq, h_q, d, dtype=dtype, device=DEVICE)
        for row, cols in documents_of(doc_ids):
            outs[row:row + 1, cols] = sdpa_attention(leaf[row:row + 1, cols], h_kv)
        outs.backward(dout.to(dtype))
        return outs.detach(), leaf.grad

    (ref_out, ref_grad), (bf16_out, bf16_grad) = alone(torch.float32), alone(torch.bfloat16)
    for name, got, bf16, ref, floor in [("out", out, bf16_out, ref_out, OUT_RTOL_FLOOR),
                                        ("dqkv", leaf.grad, bf16_grad, ref_grad, GRAD_RTOL_FLOOR)]:
        err, bf16_err = rel_err(got, ref), rel_err(bf16, ref)
        assert err <= max(2 * bf16_err, floor), f"{name}: fa4 varlen {err:.3e}, sdpa bf16 {bf16_err:.3e}"


@torch.no_grad()
def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    layout = model.layout()
    for name, param in model.named_parameters():
        param.copy_(layout[name].to_native(state[layout[name].name].to(DEVICE, param.dtype)))


def canonical_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    layout = model.layout()
    return {layout[n].name: layout[n].to_canonical(p.grad).double() for n, p in model.named_parameters()}


def test_cute_model_packed_equals_documents_alone():
    """Llama-3.2-1B widths, two layers, 2 × 1024 tokens in five documents (one a single token)."""
    cfg = dataclasses.replace(get_preset("llama3_1b"), n_layers=2)
    doc_ids = doc_ids_of([[300, 1, 200, 523], [1024]])
    state = random_canonical_state(cfg, torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, doc_ids.shape, generator=g).to(DEVICE)
    targets = torch.randint(0, cfg.vocab_size, doc_ids.shape, generator=g)
    targets[0, 5:40] = IGNORE_INDEX
    targets = targets.to(DEVICE)
    counted = (targets != IGNORE_INDEX).sum()

    def build(make, dtype):
        with torch.device("meta"):  # no init: every parameter is loaded
            model = make()
        model = model.to_empty(device=DEVICE).to(dtype)
        load(model, state)
        return model

    def packed(make, dtype):
        model = build(make, dtype)
        loss = model(tokens, targets, doc_ids=doc_ids)
        loss.backward()
        return loss.item(), canonical_grads(model)

    def alone(make, dtype):
        model = build(make, dtype)
        target_sum = 0
        for row, cols in documents_of(doc_ids):
            doc_targets = targets[row:row + 1, cols]
            n = (doc_targets != IGNORE_INDEX).sum()
            if n:
                target_sum = target_sum + model(tokens[row:row + 1, cols], doc_targets) * n
        loss = target_sum / counted
        loss.backward()
        return loss.item(), canonical_grads(model)

    loss32, grads32 = alone(lambda: Llama(cfg), torch.float32)
    loss16, grads16 = alone(lambda: Llama(cfg), torch.bfloat16)
    candidates = {
        "coda-cute": packed(lambda: CodaLlama(cfg, cute_block()), torch.bfloat16),
        "eager-flex": packed(lambda: Llama(cfg), torch.bfloat16),
    }
    loss_tol = max(2 * abs(loss16 - loss32), LOSS_RTOL_FLOOR * abs(loss32))
    failures = []
    for label, (loss, grads) in candidates.items():
        print(f"{label}: loss {loss:.6f}, fp32 alone {loss32:.6f}, bf16 alone {loss16:.6f}")
        if not abs(loss - loss32) <= loss_tol:
            failures.append(f"{label} loss {loss:.6f} vs fp32 {loss32:.6f} (tolerance {loss_tol:.2e})")
        for name, ref in grads32.items():
            err, bf16_err = rel_err(grads[name], ref), rel_err(grads16[name], ref)
            if not err <= max(2 * bf16_err, GRAD_RTOL_FLOOR):
                failures.append(f"{label} grad {name}: {err:.3e} (bf16 alone {bf16_err:.3e})")
    assert not failures, "\n".join(failures)
