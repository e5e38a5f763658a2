"""What build_loaders checks and hands on: its refusals and their messages, the loaders it makes
for synthetic data, token directories and streams, the sources a config names, and the edges of
PackedLoader's epochs, state and iteration that tests/test_data_loader.py leaves out."""

import json
import math
import os
import re
import warnings

import numpy as np
import pytest
import torch
from test_data_loader import IndexWindows, make, take
from test_data_sources import word_tokenizer, write_jsonl
from test_data_streaming import corpus, stream_config
from unigram import unigram_entropy

from codatrain.data import build_loaders, prepare_streams
from codatrain.data.config import DataConfig, DataSource, OnBadData
from codatrain.data.loader import SYNTHETIC_WINDOWS, PackedLoader, data_sources
from codatrain.data.order import ORDER_VERSION
from codatrain.data.packing import SyntheticWindows
from codatrain.data.pretokenize import tokenize_to_dir
from codatrain.data.sources import SPLIT_VERSION


def build(cfg, batch_size=2, rank=0, world_size=1, seed=0, max_seq_len=64, model_vocab_size=512):
    return build_loaders(cfg, batch_size, rank, world_size, seed, "cpu", max_seq_len=max_seq_len,
                         model_vocab_size=model_vocab_size)


def exactly(message):
    return f"^{re.escape(message)}$"


# ---- PackedLoader ----------------------------------------------------------------------------------
def test_an_epoch_whose_windows_fill_its_last_batch_exactly_keeps_that_batch():
    loader = make(12, batch_size=4)  # three steps use every window of the epoch
    epoch0 = take(loader, 3)
    assert sum(epoch0, []) == loader.order(0)[:].tolist()
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 0
    assert take(loader, 1) == [loader.order(1)[0:4].tolist()]


def test_a_single_pass_loader_that_shuffles_visits_epoch_0s_order_from_its_start():
    loader = make(12, batch_size=4, repeat=False, shuffle=True)
    order = loader.order(0)[:].tolist()
    assert order != sorted(order)
    assert take(loader, 10) == [order[0:4], order[4:8], order[8:12]]
    moved = make(12, batch_size=4, repeat=False, shuffle=True)
    moved.load_state_dict({**loader.state_dict(), "offset": 4})
    assert take(moved, 10) == [order[0:4], order[4:8], order[8:12]]  # a loaded position does not move it


def test_batches_are_moved_to_the_loaders_device():
    loader = PackedLoader(IndexWindows(8), name="training", vocab_size=8, batch_size=2, rank=0, world_size=1,
                          seed=0, device=torch.device("meta"), shuffle=True, repeat=True, num_workers=0)
    batch = next(iter(loader))
    assert batch.inputs.device.type == batch.targets.device.type == "meta"


class PidWindows(IndexWindows):
    def __getitem__(self, i: int):
        return np.full(self.seq_len + 1, os.getpid(), dtype=np.int64), None


def test_workers_read_the_windows_in_other_processes_without_warnings_on_the_cpu():
    for workers in (0, 1):
        loader = PackedLoader(PidWindows(8), name="training", vocab_size=8, batch_size=2, rank=0,
                              world_size=1, seed=0, device=torch.device("cpu"), shuffle=True, repeat=True,
                              num_workers=workers)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. pinning memory on a machine without an accelerator
            readers = set(next(iter(loader)).inputs.flatten().tolist())
        assert (readers == {os.getpid()}) == (workers == 0)


def test_state_records_the_position_seed_data_and_order_version():
    loader = make(30, batch_size=2, seed=5)
    take(loader, 2)
    assert loader.state_dict() == {"epoch": 0, "offset": 4, "seed": 5, "num_windows": 30, "seq_len": 3,
                                   "order": ORDER_VERSION, "split": SPLIT_VERSION}


def test_state_of_another_window_length_is_rejected_naming_both_values():
    state = {**make(40).state_dict(), "seq_len": 4}
    with pytest.raises(ValueError, match=exactly(
            "the training data state was saved with seq_len=4, but this run has seq_len=3: the data or its "
            "order changed, so it cannot continue exactly")):
        make(40).load_state_dict(state)


def test_every_load_of_a_state_stops_the_iterators_made_before_it():
    loader = make(40)
    state = make(40).state_dict()
    loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    loader.load_state_dict(state)  # a second load invalidates an iterator made after the first
    with pytest.raises(RuntimeError, match=exactly(
            "the training loader's state was loaded during iteration; call iter() on it again")):
        next(it)


def test_too_little_data_names_the_windows_and_the_global_batch():
    with pytest.raises(ValueError, match=exactly(
            "the training data has 7 sequences of seq_len+1 tokens, fewer than one global batch (4 per rank "
            "x 2 ranks); use more data or smaller batches")):
        make(7, batch_size=4, world_size=2)


# ---- build_loaders: its checks and the synthetic source ----------------------------------------------
def test_bad_sizes_ranks_seeds_fractions_and_worker_counts_are_refused_with_their_values():
    synthetic = DataConfig(source="synthetic", seq_len=1)
    refused = [
        (dict(batch_size=0), "batch_size=0 must be positive"),
        (dict(rank=1), "rank 1 is not in a world of size 1"),
        (dict(rank=-1, world_size=2), "rank -1 is not in a world of size 2"),
        (dict(seed=-1), "the data seed must be non-negative, got -1"),
    ]
    for args, message in refused:
        with pytest.raises(ValueError, match=exactly(message)):
            build(synthetic, **args)
    # The data config's own values are checked where it is built (codatrain/data/config.py).
    for overrides, message in [(dict(val_fraction=1.0), "data.val_fraction=1.0 is not in [0, 1)"),
                               (dict(val_fraction=-0.1), "data.val_fraction=-0.1 is not in [0, 1)"),
                               (dict(num_workers=-1), "data.num_workers must be 0 or more, got -1"),
                               (dict(seq_len=0), "data.seq_len must be positive, got 0")]:
        with pytest.raises(ValueError, match=exactly(message)):
            DataConfig(source="synthetic", **{"seq_len": 1, **overrides})
    # The smallest accepted values of each.
    train, val = build(DataConfig(source="synthetic", seq_len=1, val_fraction=0.0, num_workers=0),
                       batch_size=1, rank=1, world_size=2, seed=0, max_seq_len=1)
    assert next(iter(train)).inputs.shape == next(iter(val)).inputs.shape == (1, 1)


def test_synthetic_vocabulary_larger_than_the_model_is_refused():
    with pytest.raises(ValueError, match=exactly(
            "data.tokenizer=synthetic has 256 token ids, more than model.vocab_size=255; use the tokenizer "
            "the model was trained with")):
        build(DataConfig(source="synthetic", seq_len=4), model_vocab_size=255)


def test_tokenizer_larger_than_the_model_is_named_with_both_sizes(tmp_path):
    unused = str(tmp_path / "unused.jsonl")  # the sizes are checked before any data is read
    with pytest.raises(ValueError, match=exactly(
            "data.tokenizer=byte has 258 token ids, more than model.vocab_size=257; use the tokenizer the "
            "model was trained with")):
        build(DataConfig(source="files", path=unused, seq_len=4), model_vocab_size=257)
    word_tokenizer(["<s>", "</s>"])[0].save(str(tmp_path / "tokenizer.json"))
    tokenizer = str(tmp_path / "tokenizer.json")
    message = f"^data.tokenizer={re.escape(tokenizer)} has 13 token ids, more than model.vocab_size=12;"
    with pytest.raises(ValueError, match=message):
        build(DataConfig(source="files", path=unused, seq_len=4, tokenizer=tokenizer), model_vocab_size=12)


def test_sft_loaders_report_their_training_and_validation_examples(tmp_path):
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(6)]
    train_path, val_path = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    val_path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    cfg = DataConfig(source="files", format="sft", path=str(train_path), val_path=str(val_path), seq_len=48,
                     shuffle=False, num_workers=0)
    train, val = build(cfg, batch_size=1)
    assert train.report.startswith("training data: 6 examples (the plain template)")
    assert val.report.startswith("validation data: 2 examples (the plain template)")
    text = bytes(t for t in next(iter(train)).inputs[0].tolist() if t < 256)
    assert text.startswith(b"<|user|>\nquestion 0")


@pytest.mark.parametrize("shuffle", [True, False])
def test_synthetic_loaders_train_on_split_0_and_validate_once_over_split_1(shuffle):
    cfg = DataConfig(source="synthetic", seq_len=4, keep_document_boundaries=True, shuffle=shuffle,
                     num_workers=0)
    train, val = build(cfg, batch_size=2, rank=1, world_size=2, seed=3)
    windows = [SyntheticWindows(4, 3, split, SYNTHETIC_WINDOWS, True) for split in (0, 1)]
    assert len(train) == len(val) == SYNTHETIC_WINDOWS // 4
    assert (train.name, train.repeat, train.shuffle, train.num_workers) == ("training", True, shuffle, 0)
    assert (val.name, val.repeat, val.shuffle, val.num_workers) == ("validation", False, False, 0)
    for loader in (train, val):
        assert (loader.vocab_size, loader.batch_size, loader.rank, loader.world_size, loader.seed) == \
            (256, 2, 1, 2, 3)
        assert loader.device == torch.device("cpu") and loader.report is None
    first = train.order(0)[2:4].tolist()  # rank 1's slice of the first step
    batch = next(iter(train))
    assert batch.inputs.tolist() == [windows[0][i].tokens[:-1].tolist() for i in first]
    assert batch.documents is not None
    batch = next(iter(val))
    assert batch.inputs.tolist() == [windows[1][i].tokens[:-1].tolist() for i in (2, 3)]
    assert batch.documents is not None


def test_validation_of_stored_data_keeps_document_boundaries(tmp_path):
    docs = [f"document number {i} " * (1 + i % 3) for i in range(40)]
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "d.jsonl", docs)), seq_len=8,
                     val_fraction=0.25, keep_document_boundaries=True, num_workers=0,
                     cache_dir=str(tmp_path / "cache"))
    _, val = build(cfg)
    assert next(iter(val)).documents is not None


# ---- token directories -----------------------------------------------------------------------------
def test_token_directory_needs_its_path_and_validates_on_its_held_out_documents():
    with pytest.raises(ValueError, match=exactly(
            "data.source=tokens needs data.path (a directory written by scripts/tokenize_corpus.py)")):
        build(DataConfig(source=DataSource.tokens, seq_len=8))
    with pytest.raises(ValueError, match=exactly(
            "data.source=tokens validates on the documents scripts/tokenize_corpus.py held out (its "
            "data.val_fraction); data.val_path is not read")):
        build(DataConfig(source=DataSource.tokens, path="tokens", val_path="val.jsonl", seq_len=8))


def test_token_directory_report_counts_tokens_documents_shards_and_held_out_tokens(tmp_path):
    corpus(tmp_path / "c")
    for fraction in (0.2, 0.0):
        out = tmp_path / f"tokens{fraction}"
        tokenize_to_dir(DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=fraction),
                        out, shards=2, processes=1)
        cfg = DataConfig(source=DataSource.tokens, path=str(out), seq_len=8, keep_document_boundaries=True,
                         num_workers=0)
        train, val = build(cfg)
        shards = train.dataset.stream
        expected = (f"training data: {out}: {shards.num_tokens:,} tokens in {shards.num_documents:,} "
                    "documents, 2 shards, memory-mapped")
        if fraction:
            assert shards.num_tokens > 1000
            expected += f"; validation: {val.dataset.stream.num_tokens:,} held-out tokens"
            assert next(iter(val)).documents is not None
        else:
            assert val is None
        assert train.report == expected


def test_token_directory_of_another_tokenizer_names_both(tmp_path):
    corpus(tmp_path / "c")
    out = tmp_path / "tokens"
    tokenize_to_dir(DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=0.0), out,
                    shards=1, processes=1)
    word_tokenizer(["<s>", "</s>"])[0].save(str(tmp_path / "tokenizer.json"))
    cfg = DataConfig(source=DataSource.tokens, path=str(out), tokenizer=str(tmp_path), seq_len=8)
    with pytest.raises(ValueError, match=r"; set data.tokenizer to the one scripts/tokenize_corpus.py used$"):
        build(cfg)


# ---- streams ---------------------------------------------------------------------------------------
def test_stream_report_says_how_the_shards_split_over_ranks_and_readers(tmp_path):
    corpus(tmp_path / "c")  # four files: four shards
    expected = {0: "1 readers, by shard", 2: "2 readers, by shard",
                3: "3 readers, by document (every reader reads all rows)"}
    for workers, split in expected.items():
        train, _ = build(stream_config(tmp_path / "c", num_workers=workers))
        assert train.report == (f"training data: streaming {tmp_path / 'c'}: 4 shards over 1 ranks × "
                                f"{split}, tokenized in the DataLoader workers")
    train, _ = build(stream_config(tmp_path / "c", num_workers=4), rank=1, world_size=2)
    assert "4 shards over 2 ranks × 4 readers, by document" in train.report  # 8 readers in all


def test_stream_configuration_reaches_its_readers_and_loader(tmp_path):
    corpus(tmp_path / "c")
    cfg = stream_config(tmp_path / "c", num_workers=2, seq_len=8, shuffle_buffer=5,
                        on_bad_data=OnBadData.skip, tokenizer="byte")
    train, val = build(cfg, batch_size=3, rank=1, world_size=2, seed=7, model_vocab_size=300)
    windows = train.dataset
    assert (windows.tokenizer, windows.seq_len, windows.batch_size, windows.with_doc_ids) == \
        ("byte", 8, 3, True)
    assert (windows.rank, windows.world_size, windows.readers, windows.seed) == (1, 2, 2, 7)
    assert (windows.skip_bad, windows.held_out_fraction, windows.shuffle_buffer) == (True, 0.0, 5)
    assert (train.name, train.vocab_size, train.device, train.num_workers) == \
        ("training", 258, torch.device("cpu"), 2)
    assert val is None  # no val_fraction, val_path or val_split
    unshuffled, _ = build(stream_config(tmp_path / "c", shuffle=False, shuffle_buffer=5))
    assert unshuffled.dataset.shuffle_buffer == 0 and not unshuffled.dataset.skip_bad


def test_stream_validation_holds_out_documents_or_reads_the_validation_path(tmp_path):
    texts = corpus(tmp_path / "c")
    cfg = stream_config(tmp_path / "c", val_fraction=0.25, val_tokens=64, seq_len=4, num_workers=1,
                        tokenizer="byte")
    train, val = build(cfg, batch_size=1, rank=1, world_size=2)
    assert train.dataset.held_out_fraction == 0.25
    assert (val.source.location, val.tokenizer, val.held_out_fraction, val.max_tokens) == \
        (str(tmp_path / "c"), "byte", 0.25, 64)
    assert (val.skip_bad, val.seq_len, val.with_doc_ids) == (False, 4, True)
    batches = list(val)
    loader = val._loader
    assert (loader.name, loader.repeat, loader.shuffle, loader.num_workers) == ("validation", False, False, 0)
    assert (loader.batch_size, loader.rank, loader.world_size) == (1, 1, 2)
    assert len(batches) == len(loader) > 0 and batches[0].documents is not None

    val_path = write_jsonl(tmp_path / "val.jsonl", texts[:3])
    train, val = build(stream_config(tmp_path / "c", val_fraction=0.25, val_path=str(val_path)))
    assert train.dataset.held_out_fraction == val.held_out_fraction == 0.0
    assert val.source.location == str(val_path)


# ---- sources and the token cache -------------------------------------------------------------------
def test_hub_config_names_its_dataset_splits_and_cache():
    cfg = DataConfig(source="hub", path="org/set", name="en", split="train", val_split="dev", streaming=True,
                     text_column="body", max_documents=7, cache_dir="/cache")
    main, val = data_sources(cfg)
    assert (main.location, main.text_column, main.max_documents) == ("org/set[train]", "body", 7)
    assert main.load_args == {"path": "org/set", "name": "en", "split": "train", "streaming": True,
                              "cache_dir": "/cache"}
    assert (val.location, val.text_column, val.max_documents) == ("org/set[dev]", "body", None)
    assert val.load_args == {**main.load_args, "split": "dev"}
    assert data_sources(DataConfig(source="hub", path="org/set"))[1] is None


def test_files_config_with_a_validation_path_reads_all_of_it(tmp_path):
    train_path = write_jsonl(tmp_path / "t.jsonl", ["a b"] * 3, column="body")
    val_path = write_jsonl(tmp_path / "v.jsonl", ["c d"] * 3, column="body")
    main, val = data_sources(DataConfig(source="files", path=str(train_path), val_path=str(val_path),
                                        text_column="body", max_documents=2, cache_dir=str(tmp_path)))
    assert (main.location, main.text_column, main.max_documents) == (str(train_path), "body", 2)
    assert (val.location, val.text_column, val.max_documents) == (str(val_path), "body", None)
    assert main.load_args["cache_dir"] == val.load_args["cache_dir"] == str(tmp_path)
    (tmp_path / "v.txt").write_text("one\n\ntwo\n")
    _, val = data_sources(DataConfig(source="files", path=str(train_path), val_path=str(tmp_path / "v.txt"),
                                     text_sample_by="paragraph", val_split="ignored"))
    assert val.load_args["sample_by"] == "paragraph"
    # val_split names a split of a Hub dataset; files have none.
    assert data_sources(DataConfig(source="files", path=str(train_path), val_split="dev"))[1] is None
    main, _ = data_sources(DataConfig(source="embedded", max_documents=3, cache_dir=str(tmp_path)))
    assert (main.kind, main.max_documents, main.load_args["cache_dir"]) == ("embedded", 3, str(tmp_path))


def test_configs_without_a_corpus_are_refused_by_name():
    for cfg, message in [
        (DataConfig(source="files"), "data.source=files needs data.path (a file, folder or glob)"),
        (DataConfig(source="hub"), "data.source=hub needs data.path (the dataset name on the Hub)"),
        (DataConfig(source="tokens", path="x"),
         "data.source='tokens' is not one of embedded, synthetic, files, hub"),
    ]:
        with pytest.raises(ValueError, match=exactly(message)):
            data_sources(cfg)
    with pytest.raises(ValueError, match=exactly("data.source=synthetic has no corpus to tokenize")):
        prepare_streams(DataConfig(source="synthetic"))


def test_token_cache_lies_under_the_configured_cache_dir(tmp_path):
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "d.jsonl", ["ab"] * 4)),
                     val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    streams = prepare_streams(cfg)
    assert streams.train.stems[0].is_relative_to(tmp_path / "cache" / "codatrain-tokens")


def test_unigram_entropy_counts_tokens_seen_once(tmp_path):
    cfg = DataConfig(source="files", path=str(write_jsonl(tmp_path / "d.jsonl", ["aab"])), val_fraction=0.0,
                     cache_dir=str(tmp_path / "cache"))
    # BOS a a b EOS: a is two fifths of the stream, each other token one fifth.
    assert unigram_entropy(cfg) == pytest.approx(-3 * 0.2 * math.log(0.2) - 0.4 * math.log(0.4))
