"""Tokenize a source once and keep the tokens on disk as flat, memory-mapped streams.

A cache entry is a folder named by a hash of everything that decides its content (source identity,
text column, document limit, held-out fraction, tokenizer fingerprint). It holds one stream per
part: `documents` (the kept documents) and, when a fraction is held out for validation, `held_out`.
A stream is the documents' tokens concatenated as [BOS] doc [EOS] [BOS] doc [EOS] ... plus the
offset of every document, so packing is plain slicing and document boundaries stay known.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from tqdm.auto import tqdm

from codatrain.data.sources import Source
from codatrain.data.tokenizer import Tokenizer

FORMAT_VERSION = 1
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class TokenStream:
    """One part of a cache entry. Arrays are opened lazily (memory-mapped), so the object pickles
    cheaply into DataLoader workers whatever the start method."""

    directory: Path
    part: str
    dtype: str
    num_tokens: int
    num_documents: int

    @property
    def tokens(self) -> np.ndarray:
        return np.memmap(self.directory / f"{self.part}.tokens", dtype=self.dtype, mode="r",
                         shape=(self.num_tokens,))

    @property
    def doc_starts(self) -> np.ndarray:
        """int64 (num_documents + 1,): where each document's first token sits, then num_tokens."""
        return np.load(self.directory / f"{self.part}.doc_starts.npy", mmap_mode="r")


def is_held_out(index: int, fraction: float) -> bool:
    """Whether document `index` of a source belongs to the held-out split.

    The golden-ratio sequence frac(k·φ) spreads the held-out documents evenly over the source's order
    and holds out very nearly `fraction` of any prefix, so the split needs neither the source's length
    (streams) nor a random generator, and appending documents leaves earlier assignments unchanged.
    """
    return ((index + 1) * _GOLDEN) % 1.0 < fraction


def tokenize_source(source: Source, tokenizer: Tokenizer, cache_root: Path,
                    held_out_fraction: float) -> dict[str, TokenStream]:
    """The cached streams of `source`, tokenizing it first if no other run or rank has yet.

    Returns {"documents": ...} and, when `held_out_fraction` > 0, {"held_out": ...}.
    """
    spec = {
        "version": FORMAT_VERSION, "source": source.identity, "text_column": source.text_column,
        "max_documents": source.max_documents, "held_out_fraction": held_out_fraction,
        "tokenizer": tokenizer.fingerprint,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]
    directory = cache_root / key
    cache_root.mkdir(parents=True, exist_ok=True)
    # Ranks of one job (and concurrent jobs) share the entry: the first tokenizes, the others wait.
    with FileLock(str(directory) + ".lock"):
        if not (directory / "meta.json").is_file():
            _write_entry(source, tokenizer, directory, spec, held_out_fraction)
    meta = json.loads((directory / "meta.json").read_text())
    return {part: TokenStream(directory, part, meta["dtype"], info["num_tokens"], info["num_documents"])
            for part, info in meta["parts"].items()}


def _write_entry(source: Source, tokenizer: Tokenizer, directory: Path, spec: dict,
                 held_out_fraction: float) -> None:
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    parts = ["documents"] + (["held_out"] if held_out_fraction > 0 else [])
    staging = directory.with_name(f"{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while tokenizing
    staging.mkdir(parents=True)
    starts: dict[str, list[int]] = {p: [0] for p in parts}
    bos = np.array([] if tokenizer.bos_id is None else [tokenizer.bos_id], dtype=dtype)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    batches, total = source.read()
    index = 0
    with ExitStack() as stack:
        files = {p: stack.enter_context(open(staging / f"{p}.tokens", "wb")) for p in parts}
        bar = stack.enter_context(
            tqdm(total=total, unit="doc", desc=f"tokenizing {source.location}"))
        for texts in batches:
            present = [(index + i, t) for i, t in enumerate(texts) if t]  # skip empty and null texts
            encoded = tokenizer.encode_batch([t for _, t in present])
            for (doc_index, _), ids in zip(present, encoded, strict=True):
                held_out = held_out_fraction > 0 and is_held_out(doc_index, held_out_fraction)
                part = "held_out" if held_out else "documents"
                files[part].write(np.concatenate([bos, ids.astype(dtype), eos]).tobytes())
                starts[part].append(starts[part][-1] + len(bos) + len(ids) + len(eos))
            index += len(texts)
            bar.update(len(texts))
    counts = {p: len(s) - 1 for p, s in starts.items()}
    if counts["documents"] == 0:
        shutil.rmtree(staging)
        raise ValueError(f"data source {source.location} has no documents with text "
                         f"({index} rows read, column {source.text_column!r})")
    if held_out_fraction > 0 and counts["held_out"] == 0:
        shutil.rmtree(staging)
        raise ValueError(f"data.val_fraction={held_out_fraction} holds out none of the {index} documents "
                         f"of {source.location}; raise it or give a separate validation source")
    for p in parts:
        np.save(staging / f"{p}.doc_starts.npy", np.asarray(starts[p], dtype=np.int64))
    meta = {"spec": spec, "dtype": dtype.name,
            "parts": {p: {"num_tokens": starts[p][-1], "num_documents": counts[p]} for p in parts}}
    # meta.json is written last and the folder renamed into place, so a half-written entry is never used.
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)  # an entry whose meta.json was lost
    os.replace(staging, directory)
