"""Document masking of packed windows (data.keep_document_boundaries): attention within each
document and RoPE positions restarting at its start, for the eager model and the reference CODA
model, and documents travelling from the loader through the trainer to the model. The cute
backend's FA4 varlen path is tested in tests/gpu/test_cute_varlen.py."""

import pytest
import torch
from model_states import documents_of
from test_coda import CONFIGS, assert_close_to, canonical_grads, model_pair

from codatrain.config import load_config, validate
from codatrain.kernels import attention
from codatrain.kernels.attention import documents_from_ids, sdpa_attention
from codatrain.model.llama import IGNORE_INDEX, rope_cos_sin
from codatrain.train.distributed import init_distributed
from codatrain.train.trainer import Trainer

# Two rows of 13 tokens: three documents (5, 1 and 7 tokens: one of a single token) in the first,
# one whole document in the second.
DOC_IDS = torch.tensor([[4] * 5 + [5] + [6] * 7, [0] * 13])


def test_documents_from_ids():
    # The loader's form: int32, counted from 0 in each row.
    loader_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    assert documents_from_ids(loader_ids).cu_seqlens.tolist() == [0, 2, 5, 6, 12]

    docs = documents_from_ids(torch.tensor([[7, 7, 7, 2, 2, 7], [0, 0, 0, 0, 0, 0]]))
    # The third run of the first row is a new document although its id was seen before.
    assert docs.doc_index.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 6, 12] and docs.cu_seqlens.dtype == torch.int32
    assert docs.positions.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5]
    assert docs.max_seqlen == 6 and docs.block_mask is None  # the model adds it, on CUDA only
    mask = docs.dense_mask()
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1, 0].equal(torch.ones(6, 6, dtype=torch.bool).tril())


# flex_attention runs unfused off CUDA, and says so.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block_mask", [False, True], ids=["sdpa-dense-mask", "flex-block-mask"])
def test_attention_within_documents_equals_each_document_alone(block_mask):
    """Both masked paths of `sdpa_attention`: SDPA with a dense mask (CPU) and flex_attention with
    the block mask (CUDA; unfused here). GQA 2:1, fp64."""
    g = torch.Generator().manual_seed(0)
    b, t, h_q, h_kv, d = *DOC_IDS.shape, 4, 2, 8
    qkv = torch.randn(b, t, h_q + 2 * h_kv, d, generator=g, dtype=torch.float64)
    documents = documents_from_ids(DOC_IDS)
    if block_mask:
        documents = documents.with_block_mask()
    assert (documents.block_mask is None) != block_mask
    out = sdpa_attention(qkv, h_kv, documents)
    for row, cols in documents_of(DOC_IDS):
        alone = sdpa_attention(qkv[row:row + 1, cols], h_kv)
        torch.testing.assert_close(out[row:row + 1, cols], alone, rtol=1e-12, atol=1e-12)


def packed_batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, DOC_IDS.shape, generator=g)
    targets = torch.randint(0, cfg.vocab_size, DOC_IDS.shape, generator=g)
    targets[1, 3] = IGNORE_INDEX
    return tokens, targets


@pytest.mark.parametrize("impl", ["eager", "coda"])
@pytest.mark.parametrize("name", ["gqa2-L3", "mqa6-L5"])
def test_packed_window_equals_its_documents_run_one_by_one(name, impl):
    """Loss and every gradient of a packed batch equal those of its documents run alone (the mean
    over the counted targets of all of them), fp64."""
    cfg = CONFIGS[name]
    tokens, targets = packed_batch(cfg)
    # Two copies of the same weights: one runs the packed batch, the other each document.
    packed, alone = (model_pair(cfg, torch.float64, head_chunk_rows=5)[impl == "coda"] for _ in range(2))

    loss = packed(tokens, targets, doc_ids=DOC_IDS)
    loss.backward()

    target_sum = 0
    for row, cols in documents_of(DOC_IDS):
        doc_tokens, doc_targets = tokens[row:row + 1, cols], targets[row:row + 1, cols]
        target_sum = target_sum + alone(doc_tokens, doc_targets) * (doc_targets != IGNORE_INDEX).sum()
    expected = target_sum / (targets != IGNORE_INDEX).sum()
    expected.backward()

    assert loss.dtype == torch.float64
    assert_close_to(loss, expected, 1e-10, "loss")
    expected_grads, grads = canonical_grads(alone), canonical_grads(packed)
    for n, g in expected_grads.items():
        assert_close_to(grads[n], g, 1e-10, n)


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_the_loaders_documents_give_what_doc_ids_give(impl):
    """Documents made on the host (as the loader makes them) and passed as `documents` give the loss
    and gradients that `doc_ids` give; both at once are refused."""
    cfg = CONFIGS["gqa2-L3"]
    tokens, targets = packed_batch(cfg)
    by_ids, by_documents = (model_pair(cfg, torch.float64)[impl == "coda"] for _ in range(2))
    expected = by_ids(tokens, targets, doc_ids=DOC_IDS)
    expected.backward()
    documents = documents_from_ids(DOC_IDS)
    loss = by_documents(tokens, targets, documents=documents)
    loss.backward()
    assert torch.equal(loss, expected)
    for (n, p), q in zip(by_documents.named_parameters(), by_ids.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    with pytest.raises(ValueError, match="^doc_ids and documents give the same thing: pass one of them$"):
        by_documents(tokens, targets, doc_ids=DOC_IDS, documents=documents)


@pytest.mark.parametrize("name", ["gqa2-L3", "gqa4-L2"])
def test_coda_with_documents_equals_eager_with_documents(name):
    cfg = CONFIGS[name]
    eager, coda = model_pair(cfg, torch.float64, head_chunk_rows=5)
    tokens, targets = packed_batch(cfg, seed=1)
    expected, loss = eager(tokens, targets, doc_ids=DOC_IDS), coda(tokens, targets, doc_ids=DOC_IDS)
    assert_close_to(loss, expected, 1e-10, "loss")
    expected.backward()
    loss.backward()
    grads = canonical_grads(coda)
    for n, p in eager.named_parameters():
        assert_close_to(grads[n], p.grad, 1e-10, n)


def test_rope_positions_restart_at_each_document():
    """Positions count from each document's start. (RoPE scores depend on position differences
    only, so the equalities above hold to rounding even with positions running on across
    documents: this checks the positions themselves.)"""
    cfg = CONFIGS["gqa2-L3"]
    eager, coda = model_pair(cfg, torch.float64)
    tokens, targets = packed_batch(cfg)
    expected = torch.tensor([[*range(5), 0, *range(7)], list(range(13))])
    seen = {}

    def record(key, arg):  # a forward pre-hook that keeps one of the module's inputs
        return lambda module, args: seen.update({key: arg(args)})

    eager.layers[0].self_attn.register_forward_pre_hook(record("cos", lambda args: args[1]))
    coda.entry.register_forward_pre_hook(record("positions", lambda args: args[1].positions))
    eager(tokens, targets, doc_ids=DOC_IDS)
    coda(tokens, targets, doc_ids=DOC_IDS)
    assert seen["positions"].tolist() == expected.flatten().tolist()
    cos, _ = rope_cos_sin(expected[:, None], cfg.head_dim, cfg.rope, torch.float64)
    assert torch.equal(seen["cos"], cos)


@pytest.mark.parametrize("impl", ["eager", "coda"])
def test_one_document_per_row_equals_the_unmasked_path_exactly(impl):
    cfg = CONFIGS["gqa2-L3"]
    model = model_pair(cfg, torch.float32)[impl == "coda"]
    tokens, targets = packed_batch(cfg)
    one_document = torch.zeros_like(DOC_IDS)
    unmasked = model(tokens, targets)
    unmasked.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    masked = model(tokens, targets, doc_ids=one_document)
    masked.backward()
    assert torch.equal(masked, unmasked)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain_grads[n]), n


@pytest.mark.parametrize("block", [["block=eager"], ["block=coda", "block.backend=reference"]],
                         ids=["eager", "coda"])
def test_trainer_hands_the_loaders_documents_to_the_model(tmp_path, block, monkeypatch):
    """With data.keep_document_boundaries the loader's documents, made on the host, reach the
    model's forward, in training steps and in evaluation; the model makes none from ids, which
    on a GPU would wait for the device every micro-batch."""
    run = validate(load_config([
        *block, "data.keep_document_boundaries=true", "data.seq_len=64", "train.micro_batch_size=4",
        "train.steps=1", "train.val_batches=1", "model.n_layers=1", f"train.run_dir={tmp_path}",
        "train.progress=false", "checkpoint.at_end=false",
    ]))
    trainer = Trainer(run, init_distributed("cpu"))
    seen = []
    forward = trainer.model.forward

    def recording_forward(tokens, targets=None, doc_ids=None, **options):
        seen.append((doc_ids, options.get("documents")))
        return forward(tokens, targets, doc_ids=doc_ids, **options)

    def made_in_the_model(doc_ids):
        raise AssertionError("the model made documents from ids")

    trainer.model.forward = recording_forward
    # The models make documents through this module's function; the loader has its own reference.
    monkeypatch.setattr(attention, "documents_from_ids", made_in_the_model)
    batches = iter(trainer.train_data)
    expected = next(iter(trainer.train_data)).documents
    loss = trainer.train_step(batches).loss
    assert torch.isfinite(torch.tensor(loss))
    doc_ids, documents = seen[0]
    assert doc_ids is None and documents is not None
    assert torch.equal(documents.doc_index, expected.doc_index)
    assert torch.equal(documents.cu_seqlens, expected.cu_seqlens)
    trainer.evaluate()
    assert len(seen) == 2 and seen[1][0] is None and seen[1][1].doc_index.shape == (4, 64)
    trainer.close()
