"""Tokenize a source once and keep the tokens on disk as a token directory of one shard.

A cache entry is a folder named by a hash of everything that decides its content (source identity,
text column, document limit, held-out fraction, tokenizer fingerprint). It is a token directory
(`token_shards.py`) with one shard and the parts `train` (the kept documents) and, when a fraction
is held out for validation, `val`: the documents' tokens concatenated as [BOS] doc [EOS] ... plus
the offset of every document, so packing is plain slicing and document boundaries stay known.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from codatrain.data.sources import Source, held_out_by_content
from codatrain.data.token_shards import ShardWriter, TokenShards, frame_document, open_token_dir, token_dtype
from codatrain.data.tokenizer import Tokenizer

# 3: documents held out by content (`held_out_by_content`); version 2 entries held out by index and
# are not read (their key differs, so they are rebuilt). 4: a special token written in a document's
# text is encoded as text (HFTokenizer); version 3 entries may hold it as the special id, so they are
# rebuilt too.
FORMAT_VERSION = 4


def tokenize_source(source: Source, tokenizer: Tokenizer, cache_root: Path,
                    held_out_fraction: float) -> dict[str, TokenShards]:
    """The cached parts of `source`, tokenizing it first if no other run or rank has yet.

    Returns {"train": ...} and, when `held_out_fraction` > 0, {"val": ...}.
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
        if not any(directory.glob("shard-*.json")):
            _write_entry(source, tokenizer, directory, spec, held_out_fraction)
    return open_token_dir(directory)[0]


def _write_entry(source: Source, tokenizer: Tokenizer, directory: Path, spec: dict,
                 held_out_fraction: float) -> None:
    parts = ("train", "val") if held_out_fraction > 0 else ("train",)
    staging = directory.with_name(f"{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while tokenizing
    dtype = token_dtype(tokenizer.vocab_size)
    writer = ShardWriter(staging, 0, 1, parts, dtype)
    batches, total = source.read()
    index = 0
    with tqdm(total=total, unit="doc", desc=f"tokenizing {source.location}") as bar:
        for texts in batches:
            present = [t for t in texts if t]  # skip empty and null texts
            encoded = tokenizer.encode_batch(present)
            for text, ids in zip(present, encoded, strict=True):
                held_out = held_out_fraction > 0 and held_out_by_content(text, held_out_fraction)
                writer.add("val" if held_out else "train", frame_document(tokenizer, ids, dtype))
            index += len(texts)
            bar.update(len(texts))
    if writer.num_documents["train"] == 0:
        writer.discard()
        held = writer.num_documents["val"] if held_out_fraction > 0 else 0
        if held:
            raise ValueError(f"data.val_fraction={held_out_fraction} holds out all {held} documents of "
                             f"{source.location}, leaving none to train on; lower it or give a separate "
                             "validation source (data.val_path)")
        raise ValueError(f"data source {source.location} has no documents with text "
                         f"({index} rows read, column {source.text_column!r})")
    if held_out_fraction > 0 and writer.num_documents["val"] == 0:
        writer.discard()
        raise ValueError(f"data.val_fraction={held_out_fraction} holds out none of the {index} documents "
                         f"of {source.location}; raise it or give a separate validation source")
    # The marker is written last and the folder renamed into place, so a half-written entry is never used.
    writer.commit(spec, skipped=0)
    shutil.rmtree(directory, ignore_errors=True)  # an entry whose marker was lost
    os.replace(staging, directory)
