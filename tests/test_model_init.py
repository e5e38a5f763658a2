"""Fresh models are reproducible from their seed, every block keeps the model contract the train
layer relies on, and the LM-head chunking policy stays in bounds."""

import pytest
import torch

from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.stages import HEAD_CHUNK_ELEMENTS, HEAD_CHUNK_MULTIPLE
from codatrain.model.coda import CodaLlama
from codatrain.model.config import get_preset
from codatrain.model.layout import CanonicalModel
from codatrain.model.liger import LigerLlama
from codatrain.model.llama import Llama

CFG = get_preset("tiny").replace(n_layers=2)


@pytest.mark.parametrize("make", [Llama, CodaLlama, LigerLlama], ids=["eager", "coda", "liger"])
def test_every_block_keeps_the_model_contract(make):
    model = make(CFG)
    assert isinstance(model, CanonicalModel)
    assert set(model.layout()) == {name for name, _ in model.named_parameters()}
    owned = [id(p) for block in model.blocks() for p in block.parameters()]
    assert len(owned) == len(set(owned))  # no parameter in two blocks


@pytest.mark.parametrize("make", [Llama, lambda cfg: CodaLlama(cfg)],
                         ids=["eager", "coda"])
def test_two_fresh_models_from_one_seed_are_equal(make):
    a, b = make(CFG), make(CFG)
    for model in (a, b):
        model.init_weights(seed=5)
    state_b = b.state_dict()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, state_b[name]), name
    b.init_weights(seed=6)
    state_b = b.state_dict()
    assert all(not torch.equal(t, state_b[n]) for n, t in a.state_dict().items() if t.dim() == 2)


@pytest.mark.parametrize("vocab_size", [2, 256, 258, 1000, 32000, 50257, 128256, 151936, 1 << 21, 1 << 24])
def test_head_chunk_rows_are_whole_tiles_within_the_memory_budget(vocab_size):
    rows = ReferenceStages().head_chunk_rows(vocab_size)
    assert rows % HEAD_CHUNK_MULTIPLE == 0 and rows >= HEAD_CHUNK_MULTIPLE == 256
    # Within the budget, unless even the smallest chunk exceeds it; and no smaller than it must be.
    assert rows * vocab_size <= HEAD_CHUNK_ELEMENTS or rows == HEAD_CHUNK_MULTIPLE
    assert (rows + HEAD_CHUNK_MULTIPLE) * vocab_size > HEAD_CHUNK_ELEMENTS


def test_head_chunk_rows_of_llama3():
    assert HEAD_CHUNK_ELEMENTS == 1 << 29  # 1 GiB of bf16 dlogits
    assert ReferenceStages().head_chunk_rows(128256) == 4096
