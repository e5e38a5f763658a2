"""Packing of tokenized documents into windows, document boundaries, and the embedded corpus."""

import gzip
import hashlib
import json
import math
import pickle
from itertools import islice

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory
from unigram import unigram_entropy

from codatrain.config import DataConfig
from codatrain.data import build_loaders, prepare_streams
from codatrain.data.packing import Batch, PackedWindows, collate
from codatrain.data.sources import EMBEDDED_PATH, EMBEDDED_SHA256, held_out_by_content
from codatrain.kernels.attention import Documents, documents_from_ids

BOS, EOS = 256, 257
DOCS = ["hello world", "", "ab", "the quick brown fox jumps over the lazy dog", "é ü", "x" * 30]


def write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d}) + "\n" for d in docs))
    return path


def expected_stream(docs):
    out = []
    for d in docs:
        if d:
            out += [BOS, *d.encode(), EOS]
    return np.array(out)


def loaders(tmp_path, docs=DOCS, seq_len=5, **overrides):
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "docs.jsonl", docs)), seq_len=seq_len,
                     val_fraction=0.0, shuffle=False, num_workers=0, cache_dir=str(tmp_path / "cache"),
                     **overrides)
    return cfg, build_loaders(cfg, 1, 0, 1, 0, "cpu", max_seq_len=64, model_vocab_size=512)


def test_stream_is_documents_with_bos_and_eos(tmp_path):
    cfg, _ = loaders(tmp_path)
    stream = prepare_streams(cfg).train
    tokens = stream.read(0, stream.num_tokens)
    assert (tokens == expected_stream(DOCS)).all()
    assert stream.num_documents == 5  # the empty document is skipped
    ((_, starts),) = stream.arrays()
    assert (tokens[starts[:-1]] == BOS).all() and starts[-1] == stream.num_tokens


def test_windows_are_exact_and_targets_shift_by_one(tmp_path):
    _, (train, _) = loaders(tmp_path, seq_len=5)
    stream = expected_stream(DOCS)
    n = (len(stream) - 1) // 5
    assert len(train) == n
    batches = list(islice(train, n))
    for i, batch in enumerate(batches):
        assert batch.inputs.shape == batch.targets.shape == (1, 5)
        assert batch.inputs.dtype == batch.targets.dtype == torch.int64
        assert batch.inputs[0].tolist() == stream[5 * i:5 * i + 5].tolist()
        assert batch.targets[0].tolist() == stream[5 * i + 1:5 * i + 6].tolist()
        assert batch.documents is None
    # Every token after the first is a target exactly once; only the tail that fills no window is unused.
    targets = torch.cat([b.targets[0] for b in batches]).tolist()
    assert targets == stream[1:1 + 5 * n].tolist()
    assert len(stream) - 1 - 5 * n < 5


def assert_same_documents(documents, expected):
    for name in ("doc_index", "cu_seqlens", "positions"):
        got, want = getattr(documents, name), getattr(expected, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert documents.max_seqlen == expected.max_seqlen and documents.block_mask is None


def test_document_ids_follow_boundaries(tmp_path):
    """The loader's batches carry the documents of their windows' ids, made on the host."""
    _, (train, _) = loaders(tmp_path, seq_len=7, keep_document_boundaries=True)
    stream = expected_stream(DOCS)
    doc_of_token = np.cumsum(stream == BOS) - 1
    for i, batch in enumerate(islice(train, len(train))):
        expected = doc_of_token[7 * i:7 * i + 7]
        assert batch.documents.doc_index[0].tolist() == (expected - expected[0]).tolist()
        assert_same_documents(batch.documents, documents_from_ids(torch.from_numpy(expected)[None]))


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_carry_the_documents_of_their_windows(tmp_path, workers):
    """Whatever the number of workers (with some, batches cross processes pickled): each batch's
    documents are `documents_from_ids` of its windows' ids."""
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "docs.jsonl", DOCS)), seq_len=6,
                     val_fraction=0.0, shuffle=False, num_workers=workers, cache_dir=str(tmp_path / "cache"),
                     keep_document_boundaries=True)
    train, _ = build_loaders(cfg, 3, 0, 1, 0, "cpu", max_seq_len=64, model_vocab_size=512)
    windows = train.dataset
    assert len(train) >= 4
    for b, batch in enumerate(islice(train, 4)):
        indices = range(3 * b, 3 * b + 3)
        ids = torch.from_numpy(np.stack([windows[i].doc_ids for i in indices]))
        assert batch.inputs.tolist() == [windows[i].tokens[:-1].tolist() for i in indices]
        assert_same_documents(batch.documents, documents_from_ids(ids))


def test_windows_pickle_without_their_memory_maps(tmp_path):
    """A spawned DataLoader worker receives the dataset pickled: it reopens the maps, not a copy."""
    cfg, _ = loaders(tmp_path)
    packed = PackedWindows(prepare_streams(cfg).train, 5, with_doc_ids=True)
    first = packed[0]
    clone = pickle.loads(pickle.dumps(packed))
    assert clone.stream._arrays is None and packed.stream._arrays is not None
    assert first.target_mask is None and clone[0].target_mask is None
    assert (clone[0].tokens == first.tokens).all() and (clone[0].doc_ids == first.doc_ids).all()


def test_batch_moves_every_tensor_to_the_device():
    window = np.arange(6)
    batch = collate([(window, np.zeros(5, dtype=np.int32)), (window + 1, np.ones(5, dtype=np.int32))])
    assert batch.inputs.tolist() == [[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
    moved = batch.to(torch.device("meta"))
    documents = moved.documents
    tensors = (moved.inputs, moved.targets, documents.doc_index, documents.cu_seqlens, documents.positions)
    assert {t.device.type for t in tensors} == {"meta"} and documents.max_seqlen == 5
    assert collate([(window, None)]).to(torch.device("meta")).documents is None


def test_the_dataloaders_pinning_reaches_every_tensor_of_a_batch(monkeypatch):
    """The DataLoader pins a batch with its own `pin_memory` function (on CUDA): field by field, and
    its documents by their `pin_memory`. (Pinning needs an accelerator: here a copy stands in.)"""
    window = np.arange(6)
    ids = np.array([0, 0, 1, 1, 1], dtype=np.int32)
    batch = collate([(window, ids), (window + 1, np.zeros(5, np.int32))])
    pinned = []

    def pin(t):
        pinned.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    out = pin_memory(batch)
    documents = batch.documents
    assert {id(t) for t in pinned} == {id(t) for t in (batch.inputs, batch.targets, documents.doc_index,
                                                        documents.cu_seqlens, documents.positions)}
    assert type(out) is Batch and type(out.documents) is Documents
    assert_same_documents(out.documents, documents)
    with pytest.raises(ValueError, match="^documents with a block mask stay on their device$"):
        documents.with_block_mask().to(torch.device("meta"))


def test_unigram_entropy_is_that_of_the_token_counts(tmp_path):
    cfg, _ = loaders(tmp_path, docs=["ab", "ab"], seq_len=2)
    # stream BOS a b EOS BOS a b EOS: four tokens, each a quarter of the stream.
    assert unigram_entropy(cfg) == pytest.approx(math.log(4))


def test_held_out_documents_are_a_stable_fraction(tmp_path):
    held = [i for i in range(1000) if held_out_by_content(f"document {i}", 0.1)]
    assert abs(len(held) - 100) <= 20  # the hash spreads them: about the fraction, 2 sigma
    docs = [f"document number {i}" for i in range(40)]
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "d.jsonl", docs)), val_fraction=0.25,
                     cache_dir=str(tmp_path / "cache"))
    streams = prepare_streams(cfg)
    assert streams.train.num_documents + streams.val.num_documents == 40
    assert 5 <= streams.val.num_documents <= 15
    val_text = bytes(t for t in streams.val.read(0, streams.val.num_tokens) if t < 256).decode()
    assert val_text == "".join(d for d in docs if held_out_by_content(d, 0.25))


def test_synthetic_source_follows_its_rule():
    cfg = DataConfig(source="synthetic", seq_len=16, keep_document_boundaries=True)
    train, val = build_loaders(cfg, 4, 0, 1, 3, "cpu", max_seq_len=64, model_vocab_size=256)
    assert train.vocab_size == 256
    batch = next(iter(train))
    tokens = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    assert (tokens[:, 1::2] == (tokens[:, 0:-1:2] * 3 + 1) % 256).all()
    assert (batch.documents.doc_index == 0).all()
    again, _ = build_loaders(cfg, 4, 0, 1, 3, "cpu", max_seq_len=64, model_vocab_size=256)
    assert torch.equal(next(iter(again)).inputs, batch.inputs)
    assert not torch.equal(next(iter(val)).inputs, batch.inputs)


def test_embedded_corpus_is_the_shipped_file():
    data = EMBEDDED_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == EMBEDDED_SHA256
    records = [json.loads(line) for line in gzip.decompress(data).decode().splitlines()]
    assert len(records) == 385 and all(r["text"] for r in records)
    assert (EMBEDDED_PATH.parent / "README.md").is_file()
    assert (EMBEDDED_PATH.parent / "LICENSE-PSF.txt").is_file()


def test_default_config_reads_the_embedded_corpus(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    train, val = build_loaders(cfg, 8, 0, 1, 0, "cpu", max_seq_len=1024, model_vocab_size=512)
    assert train.vocab_size == 258
    batch = next(iter(train))
    assert batch.inputs.shape == (8, 128) and int(batch.inputs.max()) < 258
    text = bytes(t for t in batch.inputs[0].tolist() if t < 256).decode(errors="replace")
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.6 * len(text)  # prose, not noise
    assert len(val) >= 4  # enough held-out documents for the default val_batches
