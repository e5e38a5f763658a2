"""Streaming: documents read and tokenized inside the DataLoader workers while training runs, so
the first step comes at once whatever the corpus size, and a checkpoint resumes the stream exactly.

Readers. A rank runs K = max(1, data.num_workers) readers, one per worker. Reader j of rank r reads
`split_dataset_by_node(stream, r·K + j, world_size·K)` of the source's `datasets.IterableDataset`
(`Source.stream()`): whole shards (files, or the Hub dataset's shards) where their number is a
multiple of world_size·K, else every (world_size·K)-th document. It tokenizes rows in chunks and
packs the documents into windows of seq_len + 1 tokens exactly as `PackedWindows` packs a stored
stream (consecutive windows share one token; document ids kept), and yields whole batches. When its
part ends it starts the next epoch (`set_epoch`, which reorders the shards from epoch 1 on).

Shuffle. A reader reads ahead into a pool of more than data.shuffle_buffer documents (tokenized)
and packs them in a random order: each document packed is drawn from the pool, which is then
refilled, and the pool is emptied at the end of the reader's part, so an epoch still has every
document once. The draw's generator is seeded by (run seed, rank, reader, epoch), and the pool and
the generator's state are part of the reader's state, so a resume continues the same order. It is
a local shuffle (a document moves at most the pool's size ahead); data.shuffle=false or
data.shuffle_buffer=0 keeps the source's order.

Order and state. Batch b of a rank comes from reader b mod K (the DataLoader takes its workers in
turn). With every batch a reader hands over its state: its epoch, the `datasets` state of its
part (shard and row, `IterableDataset.state_dict`), its shuffle pool and generator, and its packing
buffer (the tokens drawn but not yet in a batch). The main process keeps the state of the batches
it has handed out, not of those prefetched, so a checkpoint holds exactly where each reader stands;
on resume each reader loads its state and the workers are rotated so that the next batch comes
from the reader whose turn it is.

Validation reads a bounded set: the first data.val_tokens tokens of the validation source, or of
the documents that `held_out_by_content` holds out of the training stream (training skips them). It
is built in memory at the first evaluation, so it does not delay the first step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from datasets.distributed import split_dataset_by_node

from codatrain.data.packing import Batch, PackedWindows, Window, collate
from codatrain.data.sources import DataFileError, Source, held_out_by_content, stream_texts
from codatrain.data.token_shards import TokenShards, frame_document
from codatrain.data.tokenizer import load_tokenizer
from codatrain.data.workers import raised_in_worker, worker_init_fn

# Rows tokenized at once: enough for encode_batch to be efficient, few enough that the packing
# buffer a checkpoint holds (the rest of the last chunk) stays small.
CHUNK_ROWS = 16

ReaderState = dict[str, Any]


class StreamWindows(torch.utils.data.IterableDataset):
    """The batches of one rank's readers (module docstring); each item is (Batch, reader, state)."""

    def __init__(self, source: Source, tokenizer: str, *, seq_len: int, batch_size: int,
                 with_doc_ids: bool, rank: int, world_size: int, readers: int, skip_bad: bool,
                 held_out_fraction: float, seed: int, shuffle_buffer: int) -> None:
        self.source, self.tokenizer, self.seq_len, self.batch_size = source, tokenizer, seq_len, batch_size
        self.with_doc_ids, self.rank, self.world_size, self.readers = with_doc_ids, rank, world_size, readers
        self.skip_bad, self.held_out_fraction = skip_bad, held_out_fraction
        self.seed, self.shuffle_buffer = seed, shuffle_buffer  # shuffle_buffer 0: the source's order
        # Where iteration starts: batches handed out so far, and each reader's state (None: its start).
        self.start_batches, self.start_states = 0, [None] * readers

    def __iter__(self) -> Iterator[tuple[Batch, int, ReaderState]]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        # The DataLoader starts with worker 0: it plays the reader whose turn is next.
        yield from self._reader((self.start_batches + worker) % self.readers)

    def _part(self, reader: int, epoch: int, hf_state: dict | None):
        part = split_dataset_by_node(self.source.stream(), self.rank * self.readers + reader,
                                     self.world_size * self.readers)
        part.set_epoch(epoch)
        if hf_state is not None:
            part.load_state_dict(hf_state)
        return part

    def _reader(self, reader: int) -> Iterator[tuple[Batch, int, ReaderState]]:
        tokenizer = load_tokenizer(self.tokenizer)
        fresh = {"epoch": 0, "hf": None, "tokens": [], "starts": [], "skipped": 0, "last_skip": None}
        # States saved before the shuffle pool existed have none: theirs was empty.
        state = {"pool": [], "pool_lengths": [], "rng": None, **(self.start_states[reader] or fresh)}
        epoch, skipped, last_skip = state["epoch"], state["skipped"], state["last_skip"]
        tokens = np.asarray(state["tokens"], dtype=np.int64)
        starts = np.zeros(len(tokens), dtype=bool)
        starts[np.asarray(state["starts"], dtype=np.int64)] = True
        # Documents read ahead and not yet packed, in the order read.
        lengths = np.asarray(state["pool_lengths"], dtype=np.int64)
        pool = list(np.split(np.asarray(state["pool"], dtype=np.int64), np.cumsum(lengths)[:-1]))
        pool = pool if len(lengths) else []  # (split makes one empty piece of nothing)
        step, need = self.batch_size * self.seq_len, self.batch_size * self.seq_len + 1
        hf_state, rng_state = state["hf"], state["rng"]
        while True:
            part = self._part(reader, epoch, hf_state)
            rng = np.random.default_rng([self.seed, self.rank, reader, epoch])
            if rng_state is not None:
                rng.bit_generator.state = rng_state
            rows, read_any, ended = part.iter(batch_size=CHUNK_ROWS), False, False
            while True:
                pieces, have = [], len(tokens)
                while have < need:
                    # Read ahead until the pool holds more than shuffle_buffer documents (one at least).
                    while not ended and len(pool) <= self.shuffle_buffer:
                        chunk = next(rows, None)
                        if chunk is None:
                            ended = True
                            break
                        texts, errors = stream_texts(chunk, self.skip_bad)
                        skipped, last_skip = skipped + len(errors), errors[-1] if errors else last_skip
                        if self.held_out_fraction > 0:
                            texts = [t for t in texts if not held_out_by_content(t, self.held_out_fraction)]
                        pool += [frame_document(tokenizer, ids, np.int64)
                                 for ids in tokenizer.encode_batch(texts)]
                        read_any = read_any or bool(texts)
                    if not pool:
                        break
                    pieces.append(pool.pop(int(rng.integers(len(pool))) if self.shuffle_buffer else 0))
                    have += len(pieces[-1])
                if pieces:
                    first = np.zeros(have - len(tokens), dtype=bool)
                    first[np.cumsum([0] + [len(p) for p in pieces[:-1]])] = True
                    tokens, starts = np.concatenate([tokens, *pieces]), np.concatenate([starts, first])
                if len(tokens) < need:
                    break  # this epoch of the reader's part is used up
                windows = [Window(tokens[i:i + self.seq_len + 1],
                                  _doc_ids(starts[i + 1:i + self.seq_len]) if self.with_doc_ids else None)
                           for i in range(0, step, self.seq_len)]
                tokens, starts = tokens[step:], starts[step:]
                yield collate(windows), reader, {
                    "epoch": epoch, "hf": part.state_dict(), "tokens": tokens,
                    "starts": np.flatnonzero(starts),
                    "pool": np.concatenate(pool) if pool else np.zeros(0, dtype=np.int64),
                    "pool_lengths": np.array([len(d) for d in pool], dtype=np.int64),
                    "rng": rng.bit_generator.state, "skipped": skipped, "last_skip": last_skip}
            if not read_any and hf_state is None:  # (a resumed epoch may have had nothing left)
                share = f"1/{self.world_size * self.readers}"
                held = (f", or data.val_fraction={self.held_out_fraction} holds them out"
                        if self.held_out_fraction > 0 else "")
                raise ValueError(f"{self.source.location}: reader {reader} of rank {self.rank} found no "
                                 f"documents in epoch {epoch} of its part ({share} of the stream); the "
                                 "source has too few documents or shards for the ranks × data.num_workers"
                                 + held)
            epoch, hf_state, rng_state = epoch + 1, None, None


def _doc_ids(later_starts: np.ndarray) -> np.ndarray:
    """Document ids of a window's inputs from where documents start after its first token."""
    return np.concatenate([[0], np.cumsum(later_starts)]).astype(np.int32)


def _as_is(item: Any) -> Any:
    """The DataLoader's collate for already-made batches (its default would turn numpy into tensors)."""
    return item


class StreamLoader:
    """Training batches of one rank from a stream, as `Batch` on `device`; endless, and its
    `state_dict()` says exactly where each reader stands (module docstring)."""

    def __init__(self, dataset: StreamWindows, *, name: str, vocab_size: int, device: torch.device,
                 num_workers: int, report: str) -> None:
        self.dataset, self.name, self.vocab_size, self.device = dataset, name, vocab_size, device
        self.num_workers, self.report = num_workers, report
        self.batches, self.states = 0, [None] * dataset.readers
        self._generation = 0

    @property
    def skipped_rows(self) -> tuple[int, str | None]:
        """Bad rows skipped so far by this rank's readers (data.on_bad_data=skip) and the last one."""
        states = [s for s in self.states if s is not None]
        last = next((s["last_skip"] for s in states if s["last_skip"]), None)
        return sum(s["skipped"] for s in states), last

    def __iter__(self) -> Iterator[Batch]:
        generation = self._generation
        self.dataset.start_batches, self.dataset.start_states = self.batches, list(self.states)
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, collate_fn=_as_is,
                                             num_workers=self.num_workers,
                                             pin_memory=self.device.type == "cuda",
                                             worker_init_fn=worker_init_fn())
        try:
            for batch, reader, state in loader:
                if generation != self._generation:
                    raise RuntimeError(f"the {self.name} loader's state was loaded during iteration; "
                                       "call iter() on it again")
                self.batches += 1
                self.states[reader] = state
                yield batch.to(self.device)
        # A bad row (on_bad_data=fail), a reader without documents: one line, not a worker's traceback.
        except ValueError as error:
            raise (DataFileError if isinstance(error, DataFileError) else ValueError)(
                raised_in_worker(error)) from None

    def state_dict(self) -> dict[str, Any]:
        arrays = ("tokens", "starts", "pool", "pool_lengths")
        readers = [None if s is None else {**s, **{key: np.asarray(s[key]).tolist() for key in arrays}}
                   for s in self.states]
        return {"stream": self.dataset.source.location, "seq_len": self.dataset.seq_len,
                "world_size": self.dataset.world_size, "readers": self.dataset.readers,
                "batches": self.batches, "reader_states": readers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; iterators created before this call stop with an error."""
        if "reader_states" not in state:
            raise ValueError(f"the {self.name} data state was saved by a loader of stored windows, not a "
                             "stream (data.streaming changed); it cannot continue exactly")
        for key, current in (("seq_len", self.dataset.seq_len), ("world_size", self.dataset.world_size),
                             ("readers", self.dataset.readers)):
            if int(state[key]) != current:
                what = "data.num_workers (its readers)" if key == "readers" else key
                raise ValueError(f"the {self.name} stream state was saved with {key}={state[key]}, but "
                                 f"this run has {current}: each reader's place in the stream cannot be "
                                 f"mapped; resume with the same {what}")
        self.batches, self.states = int(state["batches"]), list(state["reader_states"])
        self._generation += 1


class BoundedValidation:
    """Validation batches from a stream: the first `max_tokens` tokens of `source` (or of the
    documents it holds out, `held_out_fraction` > 0), packed like training data. Built in memory at
    the first iteration; each iteration is then one pass over the same batches (`PackedLoader`)."""

    def __init__(self, source: Source, tokenizer: str, held_out_fraction: float, max_tokens: int,
                 skip_bad: bool, seq_len: int, with_doc_ids: bool, make_loader) -> None:
        self.source, self.tokenizer, self.held_out_fraction = source, tokenizer, held_out_fraction
        self.max_tokens, self.skip_bad = max_tokens, skip_bad
        self.seq_len, self.with_doc_ids = seq_len, with_doc_ids
        self.make_loader = make_loader  # PackedWindows -> PackedLoader
        self.report = None
        self._loader = None

    def __iter__(self) -> Iterator[Batch]:
        if self._loader is None:
            self._loader = self.make_loader(PackedWindows(self._read(), self.seq_len, self.with_doc_ids))
        return iter(self._loader)

    def _read(self) -> TokenShards:
        tokenizer, pieces, total = load_tokenizer(self.tokenizer), [], 0
        for chunk in self.source.stream().iter(batch_size=CHUNK_ROWS):
            texts, _ = stream_texts(chunk, self.skip_bad)
            if self.held_out_fraction > 0:
                texts = [t for t in texts if held_out_by_content(t, self.held_out_fraction)]
            for ids in tokenizer.encode_batch(texts):
                pieces.append(frame_document(tokenizer, ids, np.int64))
                total += len(pieces[-1])
            if total > self.max_tokens:
                break
        if not pieces:
            raise ValueError(f"the validation data of {self.source.location} has no documents"
                             + (f" held out (data.val_fraction={self.held_out_fraction})"
                                if self.held_out_fraction > 0 else ""))
        tokens = np.concatenate(pieces)[:self.max_tokens + 1]
        doc_starts = np.cumsum([0] + [len(p) for p in pieces])
        doc_starts = np.append(doc_starts[doc_starts < len(tokens)], len(tokens))
        return TokenShards.in_memory(tokens, doc_starts)
