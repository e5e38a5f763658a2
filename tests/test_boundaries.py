"""Sizes exactly at their limits: seq_len == max_seq_len, one global batch of data, the number of
packed windows of N tokens, and the window length of the synthetic source."""

import numpy as np
import pytest
import torch
from test_data_loader import make, take

from codatrain.config import DataConfig
from codatrain.data import build_loaders
from codatrain.data.packing import PackedWindows, SyntheticWindows
from codatrain.data.token_shards import TokenShards
from codatrain.model.coda import CodaLlama
from codatrain.model.config import LlamaConfig
from codatrain.model.llama import Llama

CFG = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=256, max_seq_len=12)


@pytest.mark.parametrize("make", [Llama, lambda cfg: CodaLlama(cfg)],
                         ids=["eager", "coda"])
def test_model_accepts_a_sequence_of_exactly_max_seq_len(make):
    model = make(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len))
    with torch.no_grad():
        assert model(tokens).shape == (2, CFG.max_seq_len, CFG.vocab_size)
        assert torch.isfinite(model(tokens, tokens)).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, CFG.max_seq_len + 1, dtype=torch.long))


def test_loader_accepts_seq_len_equal_to_max_seq_len():
    cfg = DataConfig(source="synthetic", seq_len=CFG.max_seq_len)
    train, _ = build_loaders(cfg, 2, 0, 1, 0, "cpu", max_seq_len=CFG.max_seq_len, model_vocab_size=256)
    assert next(iter(train)).inputs.shape == (2, CFG.max_seq_len)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        build_loaders(cfg, 2, 0, 1, 0, "cpu", max_seq_len=CFG.max_seq_len - 1, model_vocab_size=256)


def test_data_of_exactly_one_global_batch_is_one_step_an_epoch():
    # 2 ranks x 3 windows: the 6 windows are the whole epoch, every epoch.
    loaders = [make(6, batch_size=3, rank=rank, world_size=2) for rank in range(2)]
    assert len(loaders[0]) == 1
    steps = [take(loader, 3) for loader in loaders]
    for epoch in range(3):
        assert sorted(steps[0][epoch] + steps[1][epoch]) == list(range(6))
    assert loaders[0].state_dict()["epoch"] == 3 and loaders[0].state_dict()["offset"] == 0


def stream_of(tmp_path, num_tokens: int, doc_starts: tuple[int, ...] = (0,)) -> TokenShards:
    np.arange(num_tokens, dtype=np.uint16).tofile(tmp_path / "train.tokens")
    np.array([*doc_starts, num_tokens], dtype=np.int64).tofile(tmp_path / "train.docs")
    return TokenShards([tmp_path / "train"], [num_tokens], [len(doc_starts)], "uint16")


@pytest.mark.parametrize("num_tokens,windows", [(0, 0), (1, 0), (5, 0), (6, 1), (10, 1), (11, 2), (12, 2)])
def test_number_of_packed_windows_of_n_tokens(tmp_path, num_tokens, windows):
    """seq_len 5: a window needs 6 tokens and the next one 5 more (neighbours share one token)."""
    packed = PackedWindows(stream_of(tmp_path, num_tokens), seq_len=5, with_doc_ids=True)
    assert len(packed) == windows
    if windows:
        last, doc_ids, _ = packed[windows - 1]
        assert last.tolist() == list(range(5 * (windows - 1), 5 * windows + 1))
        assert doc_ids.shape == (5,)
    with pytest.raises(IndexError, match=f"window {windows} of {windows}"):
        packed[windows]


def test_document_ids_count_from_the_windows_first_token(tmp_path):
    """Window 1 (tokens 5..10) starts on the last token of document 0; document 1 starts at token 6."""
    packed = PackedWindows(stream_of(tmp_path, 16, doc_starts=(0, 6, 9)), seq_len=5, with_doc_ids=True)
    assert packed[1][1].tolist() == [0, 1, 1, 1, 2]
    assert packed[0][1].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("seq_len", [1, 6, 7])
def test_every_synthetic_window_is_seq_len_plus_one_tokens(seq_len):
    windows = SyntheticWindows(seq_len, seed=0, split=0, num_windows=4, with_doc_ids=True)
    for i in range(4):
        tokens, doc_ids, _ = windows[i]
        assert tokens.shape == (seq_len + 1,) and doc_ids.shape == (seq_len,) and doc_ids.dtype == np.int32
    with pytest.raises(IndexError, match="window 4 of 4"):
        windows[4]
    assert SyntheticWindows(seq_len, seed=0, split=0, num_windows=4, with_doc_ids=False)[0][1] is None
    cfg = DataConfig(source="synthetic", seq_len=seq_len)
    train, val = build_loaders(cfg, 2, 0, 1, 0, "cpu", max_seq_len=16, model_vocab_size=256)
    for loader in (train, val):
        batch = next(iter(loader))
        assert batch.inputs.shape == batch.targets.shape == (2, seq_len)
        assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_synthetic_tokens_cover_the_whole_vocabulary():
    windows = SyntheticWindows(255, seed=0, split=0, num_windows=64, with_doc_ids=False)
    drawn = np.concatenate([windows[i][0][0::2] for i in range(64)])  # 8192 draws of 256 values
    assert set(drawn.tolist()) == set(range(SyntheticWindows.vocab_size))
