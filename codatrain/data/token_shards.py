"""Token directories: documents' tokens in shards on disk, memory-mapped, with their offsets.

A token directory holds shards `shard-<i>-of-<n>`, written independently of one another (by
`scripts/tokenize_corpus.py` on any number of processes and machines, or by the token cache as one
shard), so no writer waits for or locks another. Per part (`train`, and `val` when documents are
held out) a shard has two flat files:

    <part>-<i>-of-<n>.tokens   the documents' tokens, [BOS] doc [EOS] [BOS] doc [EOS] ... (uint16/32)
    <part>-<i>-of-<n>.docs     int64: where each document starts, then the part's end

and the shard's marker `shard-<i>-of-<n>.json` (counts, dtype, what made it) is written last, after
its data files are renamed into place: a shard without a marker is not there. The parts read as
one stream, the shards' tokens in index order, so packing slices windows across shard boundaries
and the result does not depend on how many processes wrote the shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from datasets.distributed import split_dataset_by_node

from codatrain.data.sources import Source, held_out_by_content, stream_texts
from codatrain.data.tokenizer import Tokenizer

FORMAT = "codatrain-tokens"
FORMAT_VERSION = 1
_FLUSH_DOCUMENTS = 1 << 14  # document offsets buffered before they are appended to the .docs file


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def frame_document(tokenizer: Tokenizer, ids: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A document's tokens as packing lays them out: [BOS] ids [EOS] (no BOS if the tokenizer has none)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [tokenizer.eos_id]
    return np.concatenate([np.asarray(bos, dtype=dtype), ids.astype(dtype), np.asarray(eos, dtype=dtype)])


def shard_name(index: int, count: int) -> str:
    return f"{index:05d}-of-{count:05d}"


class TokenShards:
    """The tokens of one part of a token directory as one stream: `read` slices it and `doc_ids`
    numbers the documents of a slice, across shard boundaries. Memory maps are opened lazily, once
    per process (a pickled copy for a DataLoader worker carries only the paths)."""

    def __init__(self, stems: list[Path], num_tokens: list[int], num_documents: list[int],
                 dtype: str) -> None:
        kept = [i for i, n in enumerate(num_tokens) if n > 0]  # an empty file cannot be memory-mapped
        self.stems, self.dtype = [stems[i] for i in kept], dtype
        self._token_offsets = np.cumsum([0] + [num_tokens[i] for i in kept])
        self._doc_offsets = np.cumsum([0] + [num_documents[i] for i in kept])
        self.num_tokens = int(self._token_offsets[-1])
        self.num_documents = int(self._doc_offsets[-1])
        self._arrays: list[tuple[np.ndarray, np.ndarray]] | None = None

    @classmethod
    def in_memory(cls, tokens: np.ndarray, doc_starts: np.ndarray) -> TokenShards:
        """One shard held in memory: `doc_starts` as in a .docs file (starts, then the end)."""
        shards = cls([Path()], [len(tokens)], [len(doc_starts) - 1], str(tokens.dtype))
        shards._arrays = [(tokens, doc_starts)]
        return shards

    def __getstate__(self) -> dict[str, Any]:
        if self.stems == [Path()]:  # in memory: the arrays are the data
            return self.__dict__
        return {**self.__dict__, "_arrays": None}

    def arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, document starts) of every non-empty shard, memory-mapped."""
        if self._arrays is None:
            self._arrays = [
                (np.memmap(f"{stem}.tokens", dtype=self.dtype, mode="r", shape=(n,)),
                 np.memmap(f"{stem}.docs", dtype=np.int64, mode="r", shape=(d + 1,)))
                for stem, n, d in zip(self.stems, np.diff(self._token_offsets), np.diff(self._doc_offsets),
                                      strict=True)
            ]
        return self._arrays

    def _pieces(self, start: int, stop: int):
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) of {self.num_tokens}")
        shard = int(np.searchsorted(self._token_offsets, start, side="right")) - 1
        while start < stop:
            base = int(self._token_offsets[shard])
            end = min(stop, int(self._token_offsets[shard + 1]))
            yield shard, start - base, end - base
            start, shard = end, shard + 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream as int64."""
        arrays = self.arrays()
        return np.concatenate([arrays[s][0][a:b] for s, a, b in self._pieces(start, stop)]).astype(np.int64)

    def doc_ids(self, start: int, stop: int) -> np.ndarray:
        """For positions [start, stop), the index of the document each belongs to, counted from 0 at
        `start` (int32; a document starts at its first token)."""
        arrays = self.arrays()
        docs = np.concatenate([
            self._doc_offsets[s] + np.searchsorted(arrays[s][1], np.arange(a, b), side="right") - 1
            for s, a, b in self._pieces(start, stop)
        ])
        return (docs - docs[0]).astype(np.int32)


class ShardWriter:
    """Writes one shard of a token directory. Tokens and document offsets are appended to their
    files as documents come, so memory stays bounded whatever the shard's size; `commit` moves the
    files into place and writes the marker last."""

    def __init__(self, directory: Path, index: int, count: int, parts: tuple[str, ...],
                 dtype: np.dtype) -> None:
        self.directory, self.name, self.dtype = Path(directory), shard_name(index, count), dtype
        self.index, self.count, self.parts = index, count, parts
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files = {}
        for part in parts:
            self._files[part] = (open(self._staging(part, "tokens"), "wb"),
                                 open(self._staging(part, "docs"), "wb"))
        self.num_tokens = dict.fromkeys(parts, 0)
        self.num_documents = dict.fromkeys(parts, 0)
        self._ends: dict[str, list[int]] = {part: [0] for part in parts}

    def _staging(self, part: str, kind: str) -> Path:
        return self.directory / f".{part}-{self.name}.{kind}.partial"

    def add(self, part: str, tokens: np.ndarray) -> None:
        """Append one framed document (`frame_document`) to `part`."""
        self._files[part][0].write(tokens.astype(self.dtype, copy=False).tobytes())
        self.num_tokens[part] += len(tokens)
        self.num_documents[part] += 1
        self._ends[part].append(self.num_tokens[part])
        if len(self._ends[part]) >= _FLUSH_DOCUMENTS:
            self._flush(part)

    def _flush(self, part: str) -> None:
        self._files[part][1].write(np.asarray(self._ends[part], dtype=np.int64).tobytes())
        self._ends[part] = []

    def commit(self, spec: dict[str, Any], skipped: int) -> dict[str, Any]:
        """Finish the shard: its files renamed into place, then its marker; returns the marker."""
        for part in self.parts:
            self._flush(part)
            for handle in self._files[part]:
                handle.close()
            for kind in ("tokens", "docs"):
                os.replace(self._staging(part, kind), self.directory / f"{part}-{self.name}.{kind}")
        marker = {"format": FORMAT, "version": FORMAT_VERSION, "index": self.index, "count": self.count,
                  "dtype": self.dtype.name, "spec": spec, "skipped_rows": skipped,
                  "parts": {p: {"num_tokens": self.num_tokens[p], "num_documents": self.num_documents[p]}
                            for p in self.parts}}
        staging = self.directory / f".shard-{self.name}.json.partial"
        staging.write_text(json.dumps(marker, indent=1))
        os.replace(staging, self.directory / f"shard-{self.name}.json")
        return marker

    def discard(self) -> None:
        for part in self.parts:
            for handle, kind in zip(self._files[part], ("tokens", "docs"), strict=True):
                handle.close()
                self._staging(part, kind).unlink(missing_ok=True)


def open_token_dir(path: str | Path) -> tuple[dict[str, TokenShards], dict[str, Any]]:
    """The parts of a complete token directory ({"train": ..., "val": ... if held out}) and what made
    it (source, tokenizer, held-out fraction); raises ValueError naming what is missing or
    inconsistent."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"token directory {str(path)!r} does not exist "
                                "(scripts/tokenize_corpus.py writes one)")
    markers = [json.loads(p.read_text()) for p in sorted(directory.glob("shard-*-of-*.json"))]
    if not markers:
        raise ValueError(f"{path} has no token shards (shard-*.json); write them with "
                         "scripts/tokenize_corpus.py")
    counts = {m["count"] for m in markers}
    if len(counts) > 1:
        raise ValueError(f"{path} mixes shards of different runs (shard counts {sorted(counts)}); "
                         "tokenize into an empty directory")
    count = counts.pop()
    by_index = {m["index"]: m for m in markers}
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        raise ValueError(f"{path} is incomplete: {len(missing)} of {count} shards missing "
                         f"({', '.join(map(str, missing[:10]))}{', ...' if len(missing) > 10 else ''}); "
                         "run scripts/tokenize_corpus.py for them (it skips finished shards)")
    first = by_index[0]
    for marker in by_index.values():
        if marker["spec"] != first["spec"] or marker["dtype"] != first["dtype"]:
            raise ValueError(f"{path}: shard {marker['index']} was made from another source or tokenizer "
                             "than shard 0; tokenize into an empty directory")
    ordered = [by_index[i] for i in range(count)]
    parts = {
        part: TokenShards([directory / f"{part}-{shard_name(i, count)}" for i in range(count)],
                          [m["parts"][part]["num_tokens"] for m in ordered],
                          [m["parts"][part]["num_documents"] for m in ordered], first["dtype"])
        for part in first["parts"]
    }
    return parts, first["spec"]


def shard_spec(source: Source, tokenizer: Tokenizer, val_fraction: float) -> dict[str, Any]:
    """What a shard is made from, as its marker records it: shards of one directory share it."""
    # text_encoding: shards written before a special token in a document's text was encoded as text
    # (HFTokenizer) have none, and new shards do not join them.
    return {"source": source.identity, "text_column": source.text_column,
            "max_documents": source.max_documents, "tokenizer": tokenizer.fingerprint,
            "val_fraction": val_fraction, "text_encoding": "special tokens as text"}


def check_joins(directory: Path, spec: dict[str, Any], count: int) -> None:
    """ValueError when `directory` holds shards of another tokenization than `count` shards of
    `spec`: new ones would join a directory no reader can use (or one whose finished shards are
    skipped though made from another source or tokenizer)."""
    for path in sorted(directory.glob("shard-*-of-*.json")):
        marker = json.loads(path.read_text())
        there = {"shards": marker["count"], **marker["spec"]}
        here = json.loads(json.dumps({"shards": count, **spec}))  # as a marker holds it
        differ = ["source: other files, or the same files changed since" if key == "source" else
                  f"{key}: {there.get(key)!r} there, {here[key]!r} here"
                  for key in here if there.get(key) != here[key]]
        if differ:
            raise ValueError(f"{directory} holds shards of another tokenization ({path.name}: "
                             f"{'; '.join(differ)}); tokenize into an empty directory, or rerun with "
                             "the settings that made it (finished shards are skipped)")


def tokenize_shard(source: Source, tokenizer: Tokenizer, directory: Path, index: int, count: int,
                   val_fraction: float, skip_bad: bool) -> dict[str, Any]:
    """Write shard `index` of `count` of `source` into `directory`: the stream's part
    `split_dataset_by_node(index, count)` (whole input shards where `count` divides their number,
    else every count-th document). Documents held out by content (`held_out_by_content`) go to the
    `val` part. Returns the shard's marker."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = ("train", "val") if val_fraction > 0 else ("train",)
    spec = shard_spec(source, tokenizer, val_fraction)
    writer = ShardWriter(directory, index, count, parts, dtype)
    skipped = 0
    try:
        for batch in split_dataset_by_node(source.stream(), index, count).iter(batch_size=256):
            texts, errors = stream_texts(batch, skip_bad)
            skipped += len(errors)
            for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True):
                held_out = val_fraction > 0 and held_out_by_content(text, val_fraction)
                writer.add("val" if held_out else "train", frame_document(tokenizer, ids, dtype))
    except BaseException:
        writer.discard()
        raise
    return writer.commit(spec, skipped)
