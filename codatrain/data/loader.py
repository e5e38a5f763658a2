"""Training and validation loaders: sharding, epoch order, background workers and exact resume.

Order. Epoch e visits the windows in the permutation `order(e)`, a pure function of (seed, e)
computed index by index (order.py), so the order takes no memory that grows with the data.
Every step consumes the next `batch_size · world_size` entries of it, rank r taking the r-th slice
of `batch_size`: the ranks' batches are disjoint, together they cover the permutation, and an
epoch ends when fewer than one global batch of windows is left (the leftover differs per epoch).
Validation instead reads every window once, the last global batch partial: its missing rows are
filler windows without targets, so every rank runs the same batches of the same shape.

State. Where training stands is `Position(epoch, offset)`: the windows consumed by all ranks in the
epoch so far. The main process advances it as batches are handed out, not when workers read them,
so the state is exact whatever the number of workers and their prefetching; resuming rebuilds the
same order and continues from the offset. Because the offset counts global windows, a resume with
another world size or micro-batch size continues the same sequence of windows, split differently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

from codatrain.data.config import DataConfig, DataFormat, DataSource, OnBadData
from codatrain.data.order import ORDER_VERSION, WindowOrder
from codatrain.data.packing import (
    Batch,
    PackedWindows,
    SyntheticWindows,
    Window,
    collate,
)
from codatrain.data.sft import SFTWindows, build_sft_datasets
from codatrain.data.sources import SPLIT_VERSION, Source, embedded_source, files_source, hub_source
from codatrain.data.streaming import BoundedValidation, StreamLoader, StreamWindows
from codatrain.data.token_cache import tokenize_source
from codatrain.data.token_shards import TokenShards, open_token_dir
from codatrain.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from codatrain.data.workers import worker_init_fn

# Windows in each split of the synthetic source: far more than any benchmark reads in an epoch.
SYNTHETIC_WINDOWS = 1 << 20


@dataclass(frozen=True)
class Position:
    epoch: int
    offset: int  # windows of this epoch consumed by all ranks together


class PaddedWindows(torch.utils.data.Dataset):
    """The windows of `dataset`, then filler: an index at or past its end reads window 0 with no
    target, so a partial last batch keeps its shape and adds nothing to the loss."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, i: int) -> Window:
        if i < len(self.dataset):
            return self.dataset[i]
        return Window(*self.dataset[0])._replace(target_mask=np.zeros(self.dataset.seq_len, dtype=bool))


class PackedLoader:
    """Batches of one rank, as `Batch(inputs, targets, documents)` on `device`.

    With `repeat` (training) iteration is endless, continues from the current position, and
    `state_dict()` records where it stands. Without (validation) every `iter()` makes one pass over
    all windows of epoch 0 from its first batch, so each evaluation sees the same batches; the last
    global batch may be partial (filled up with `PaddedWindows`' filler); its state is unused.
    `len()` is the number of batches per epoch.
    """

    skipped_rows = (0, None)  # stored data has no bad rows: they stop its tokenization

    def __init__(self, dataset: PackedWindows | SyntheticWindows | SFTWindows, *, name: str,
                 vocab_size: int, batch_size: int, rank: int, world_size: int, seed: int,
                 device: torch.device, shuffle: bool, repeat: bool, num_workers: int,
                 report: str | None = None, checks_split: bool = False) -> None:
        self.dataset, self.name, self.vocab_size = dataset, name, vocab_size
        # Its documents are what data.val_fraction left of the token cache or SFT records, which held
        # out by document index before SPLIT_VERSION 2: a state must be of the same split.
        self.checks_split = checks_split
        self.report = report  # a line for the run's log about how the data was made, if any
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.device, self.shuffle, self.repeat = seed, device, shuffle, repeat
        self.num_workers = num_workers
        self.global_batch = batch_size * world_size
        if len(dataset) < (self.global_batch if repeat else 1):
            raise ValueError(
                f"the {name} data has {len(dataset)} sequences of seq_len+1 tokens, fewer than one global "
                f"batch ({batch_size} per rank x {world_size} ranks); use more data or smaller batches"
                if repeat else f"the {name} data has no sequence of seq_len+1 tokens; use more data"
            )
        self.position = Position(0, 0)
        self._generation = 0  # bumped by load_state_dict, which invalidates running iterators

    def __len__(self) -> int:
        if self.repeat:
            return len(self.dataset) // self.global_batch
        return -(-len(self.dataset) // self.global_batch)

    def order(self, epoch: int) -> WindowOrder:
        """The permutation of window indices that epoch `epoch` visits, computed per index (order.py)."""
        return WindowOrder(len(self.dataset), (self.seed, epoch) if self.shuffle else None)

    def advance(self, position: Position) -> Position:
        """The position after one global batch from `position`."""
        offset = position.offset + self.global_batch
        if offset + (self.global_batch if self.repeat else 1) > len(self.dataset):
            return Position(position.epoch + 1, 0)
        return Position(position.epoch, offset)

    def _index_batches(self, start: Position) -> Iterator[list[int]]:
        """This rank's window indices, batch after batch, from `start` (the DataLoader's batch sampler)."""
        position, epoch, order = start, start.epoch, self.order(start.epoch)
        while self.repeat or position.epoch == start.epoch:
            if position.epoch != epoch:
                epoch, order = position.epoch, self.order(position.epoch)
            first = position.offset + self.rank * self.batch_size
            indices = order[first:first + self.batch_size].tolist()
            # Past the end (validation's last batch): PaddedWindows' filler.
            yield indices + [len(self.dataset)] * (self.batch_size - len(indices))
            position = self.advance(position)

    def __iter__(self) -> Iterator[Batch]:
        generation = self._generation
        position = self.position if self.repeat else Position(0, 0)
        # The batch sampler runs in this process; workers only read and collate the windows it names.
        dataset = self.dataset if self.repeat else PaddedWindows(self.dataset)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self._index_batches(position), collate_fn=collate,
            num_workers=self.num_workers, pin_memory=self.device.type == "cuda",
            worker_init_fn=worker_init_fn(),
        )
        for batch in loader:
            if generation != self._generation:
                raise RuntimeError(f"the {self.name} loader's state was loaded during iteration; "
                                   "call iter() on it again")
            position = self.advance(position)
            if self.repeat:
                self.position = position
            yield batch.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "offset": self.position.offset, "seed": self.seed,
                "num_windows": len(self.dataset), "seq_len": self.dataset.seq_len, "order": ORDER_VERSION,
                "split": SPLIT_VERSION}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; iterators created before this call stop with an error."""
        split = int(state.get("split", 1))  # states without the key predate the split by content
        if self.checks_split and split != SPLIT_VERSION:
            raise ValueError(f"the {self.name} data state was saved when data.val_fraction held out "
                             f"documents by their index (split version {split}); they are now held out by "
                             f"content (version {SPLIT_VERSION}), so the {self.name} documents changed and "
                             "it cannot continue exactly; start a new run with checkpoint.init_from=<the "
                             "checkpoint> to keep its weights")
        checks = [("num_windows", len(self.dataset)), ("seq_len", self.dataset.seq_len), ("seed", self.seed)]
        if self.shuffle:  # the unshuffled order is the same in every version
            state = {"order": 1, **state}  # states without the key predate order.py
            checks.append(("order", ORDER_VERSION))
        for key, current in checks:
            if int(state[key]) != current:
                raise ValueError(f"the {self.name} data state was saved with {key}={state[key]}, but this "
                                 f"run has {key}={current}: the data or its order changed, so it cannot "
                                 "continue exactly")
        position = Position(int(state["epoch"]), int(state["offset"]))
        if position.offset + self.global_batch > len(self.dataset):  # possible after a batch-size change
            position = Position(position.epoch + 1, 0)
        self.position = position
        self._generation += 1


@dataclass(frozen=True)
class Streams:
    """The tokenized data of a config: training stream, validation stream (if any), and tokenizer."""

    tokenizer: Tokenizer
    train: TokenShards
    val: TokenShards | None


def build_loaders(
    cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int, device: torch.device | str,
    max_seq_len: int, model_vocab_size: int,
) -> tuple[PackedLoader | StreamLoader, PackedLoader | BoundedValidation | None]:
    """(train, val) loaders of this rank; val is None when no validation data is configured
    (val_fraction 0 and neither val_path nor val_split).

    Tokenizes the source on first use (cached on disk, shared by ranks and runs), opens a token
    directory (data.source=tokens), or streams it (data.streaming). Raises ValueError or
    FileNotFoundError naming the problem for bad settings, paths, columns or sizes.
    """
    if cfg.seq_len > max_seq_len:
        raise ValueError(f"data.seq_len={cfg.seq_len} exceeds model.max_seq_len={max_seq_len}")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if seed < 0:
        raise ValueError(f"the data seed must be non-negative, got {seed}")
    device = torch.device(device)

    if cfg.source == "synthetic":
        vocab_size = SyntheticWindows.vocab_size
        check_vocab(vocab_size, model_vocab_size, "data.tokenizer=synthetic")
        train_set = SyntheticWindows(cfg.seq_len, seed, 0, SYNTHETIC_WINDOWS, cfg.keep_document_boundaries)
        val_set = SyntheticWindows(cfg.seq_len, seed, 1, SYNTHETIC_WINDOWS, cfg.keep_document_boundaries)
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
        vocab_size = tokenizer.vocab_size
        check_vocab(vocab_size, model_vocab_size, f"data.tokenizer={cfg.tokenizer or 'byte'}")
    common = dict(vocab_size=vocab_size, batch_size=batch_size, rank=rank, world_size=world_size,
                  seed=seed, device=device)
    reports: list[str | None] = [None, None]
    checks_split = False
    if cfg.format == DataFormat.sft:
        train_set, val_set, reports = build_sft_datasets(cfg, tokenizer)
        checks_split = cfg.held_out_fraction > 0
    elif cfg.streaming:
        return _stream_loaders(cfg, common)
    elif cfg.source == DataSource.tokens:
        train_set, val_set, reports[0] = _token_dir_datasets(cfg, tokenizer)
    elif cfg.source != DataSource.synthetic:
        streams = prepare_streams(cfg, tokenizer)
        checks_split = cfg.held_out_fraction > 0
        train_set = PackedWindows(streams.train, cfg.seq_len, cfg.keep_document_boundaries)
        val_set = None if streams.val is None else PackedWindows(streams.val, cfg.seq_len,
                                                                 cfg.keep_document_boundaries)

    train = PackedLoader(train_set, name="training", shuffle=cfg.shuffle, repeat=True,
                         num_workers=cfg.num_workers, report=reports[0], checks_split=checks_split, **common)
    # Validation reads a few batches every val_every steps: starting worker processes for each
    # evaluation would cost more than reading them in the main process.
    val = None if val_set is None else PackedLoader(val_set, name="validation", shuffle=False, repeat=False,
                                                    num_workers=0, report=reports[1], **common)
    return train, val


def _token_dir_datasets(cfg: DataConfig,
                        tokenizer: Tokenizer) -> tuple[PackedWindows, PackedWindows | None, str]:
    """The windows of a token directory (scripts/tokenize_corpus.py) and a line for the run's log."""
    if not cfg.path:
        raise ValueError("data.source=tokens needs data.path (a directory written by "
                         "scripts/tokenize_corpus.py)")
    if cfg.val_path:
        raise ValueError("data.source=tokens validates on the documents scripts/tokenize_corpus.py held out "
                         "(its data.val_fraction); data.val_path is not read")
    parts, spec = open_token_dir(cfg.path)
    if spec["tokenizer"] != tokenizer.fingerprint:
        raise ValueError(f"{cfg.path} was tokenized with another tokenizer ({spec['tokenizer']}) than "
                         f"data.tokenizer={cfg.tokenizer!r} ({tokenizer.fingerprint}); set data.tokenizer to "
                         "the one scripts/tokenize_corpus.py used")
    train = PackedWindows(parts["train"], cfg.seq_len, cfg.keep_document_boundaries)
    val = parts.get("val")
    shards = parts["train"]
    report = (f"training data: {cfg.path}: {shards.num_tokens:,} tokens in {shards.num_documents:,} "
              f"documents, {len(shards.stems)} shards, memory-mapped"
              + (f"; validation: {val.num_tokens:,} held-out tokens" if val is not None else ""))
    val_set = None if val is None else PackedWindows(val, cfg.seq_len, cfg.keep_document_boundaries)
    return train, val_set, report


def _stream_loaders(cfg: DataConfig, common: dict) -> tuple[StreamLoader, BoundedValidation | None]:
    """The training stream of this rank and its bounded validation set (streaming.py; its readers
    load `cfg.tokenizer` themselves)."""
    main, val_source = data_sources(cfg)
    held_out = cfg.held_out_fraction
    skip_bad = cfg.on_bad_data == OnBadData.skip
    readers = max(1, cfg.num_workers)
    rank, world_size = common["rank"], common["world_size"]
    windows = StreamWindows(main, cfg.tokenizer, seq_len=cfg.seq_len, batch_size=common["batch_size"],
                            with_doc_ids=cfg.keep_document_boundaries, rank=rank, world_size=world_size,
                            readers=readers, skip_bad=skip_bad, held_out_fraction=held_out,
                            seed=common["seed"], shuffle_buffer=cfg.shuffle_buffer if cfg.shuffle else 0)
    shards = main.stream().num_shards
    by_shard = shards % (world_size * readers) == 0
    split = "by shard" if by_shard else "by document (every reader reads all rows)"
    report = (f"training data: streaming {main.location}: {shards} shards over {world_size} ranks × "
              f"{readers} readers, {split}, tokenized in the DataLoader workers")
    train = StreamLoader(windows, name="training", vocab_size=common["vocab_size"],
                         device=common["device"], num_workers=cfg.num_workers, report=report)
    if val_source is None and held_out == 0:
        return train, None
    validation = val_source or main

    def make_loader(dataset: PackedWindows) -> PackedLoader:
        return PackedLoader(dataset, name="validation", shuffle=False, repeat=False, num_workers=0, **common)

    val = BoundedValidation(validation, cfg.tokenizer, held_out, cfg.val_tokens, skip_bad, cfg.seq_len,
                            cfg.keep_document_boundaries, make_loader)
    return train, val


def prepare_streams(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Streams:
    """The tokenized training and validation streams of a (non-synthetic) data config."""
    if cfg.source == "synthetic":
        raise ValueError("data.source=synthetic has no corpus to tokenize")
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    main, val_source = data_sources(cfg)
    cache_root = Path(cfg.cache_dir or datasets.config.HF_DATASETS_CACHE) / "codatrain-tokens"
    streams = tokenize_source(main, tokenizer, cache_root, cfg.held_out_fraction)
    if val_source is not None:
        val = tokenize_source(val_source, tokenizer, cache_root, 0.0)["train"]
    else:
        val = streams.get("val")
    return Streams(tokenizer, streams["train"], val)


def data_sources(cfg: DataConfig) -> tuple[Source, Source | None]:
    """The training source and, when configured, a separate validation source."""
    if cfg.source == "embedded":
        main = embedded_source(cfg.max_documents, cfg.cache_dir)
    elif cfg.source == "files":
        if not cfg.path:
            raise ValueError("data.source=files needs data.path (a file, folder or glob)")
        main = files_source(cfg.path, cfg.text_column, cfg.text_sample_by, cfg.max_documents, cfg.cache_dir)
    elif cfg.source == "hub":
        if not cfg.path:
            raise ValueError("data.source=hub needs data.path (the dataset name on the Hub)")
        main = hub_source(cfg.path, cfg.name, cfg.split, cfg.streaming, cfg.text_column, cfg.max_documents,
                          cfg.cache_dir)
    else:
        raise ValueError(f"data.source={cfg.source!r} is not one of embedded, synthetic, files, hub")
    if cfg.val_path:
        val = files_source(cfg.val_path, cfg.text_column, cfg.text_sample_by, None, cfg.cache_dir)
    elif cfg.source == "hub" and cfg.val_split:
        val = hub_source(cfg.path, cfg.name, cfg.val_split, cfg.streaming, cfg.text_column, None,
                         cfg.cache_dir)
    else:
        val = None
    return main, val
