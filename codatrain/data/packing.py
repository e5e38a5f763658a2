"""Packing: fixed windows of seq_len + 1 tokens over a token stream, and the batch they form.

Window i of a stream is tokens[i·L : i·L + L + 1] for L = seq_len: inputs are its first L tokens,
targets its last L. Consecutive windows share one token, so over all windows of a stream every
token after the first is a target exactly once; the stream's last (N - 1) mod L tokens are unused.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from codatrain.data.token_shards import TokenShards
from codatrain.kernels.attention import Documents, documents_from_ids
from codatrain.kernels.stages import IGNORE_INDEX


class Batch(NamedTuple):
    """inputs and targets: (batch, seq_len) int64; targets are inputs shifted left by one token,
    IGNORE_INDEX where the loss must not count them (fine-tuning: everything but the assistant's
    tokens, and padding).

    documents (when data.keep_document_boundaries): the documents of the input tokens
    (`codatrain.kernels.attention.Documents`; `doc_index` says which document of its row each token
    belongs to). A document starts at its BOS, and its EOS belongs to it. The models take them as
    `documents` and mask attention to each document. `collate` makes them on the host, in the
    loader's workers: made on the device from document ids they would cost a host sync per
    micro-batch.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: Documents | None = None

    def to(self, device: torch.device) -> Batch:
        """Copy to `device`; non-blocking, which overlaps the copy when the batch is in pinned memory
        (the DataLoader pins a NamedTuple field by field, `Documents` by its `pin_memory`)."""
        return Batch(self.inputs.to(device, non_blocking=True), self.targets.to(device, non_blocking=True),
                     None if self.documents is None else self.documents.to(device))


class Window(NamedTuple):
    """One item of a windows dataset: seq_len + 1 tokens and, optionally, per input token document
    ids and per target whether it counts (False: the batch's target is IGNORE_INDEX)."""

    tokens: np.ndarray
    doc_ids: np.ndarray | None = None
    target_mask: np.ndarray | None = None  # (seq_len,) bool; None: every target counts


class PackedWindows(torch.utils.data.Dataset):
    """Map-style dataset of the windows of a token stream (`TokenShards`: a cache entry or a token
    directory, memory-mapped); item i is (window tokens, doc ids)."""

    def __init__(self, stream: TokenShards, seq_len: int, with_doc_ids: bool) -> None:
        self.stream, self.seq_len, self.with_doc_ids = stream, seq_len, with_doc_ids
        self.num_windows = max(0, (stream.num_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> Window:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} of {self.num_windows}")
        start = i * self.seq_len
        window = self.stream.read(start, start + self.seq_len + 1)
        if not self.with_doc_ids:
            return Window(window)
        return Window(window, self.stream.doc_ids(start, start + self.seq_len))


class SyntheticWindows(torch.utils.data.Dataset):
    """Random byte-range tokens with a learnable rule: every odd position is a fixed function of the
    token before it, so the loss of a working model falls towards half the uniform entropy. Window i
    is a pure function of (seed, split, i); no corpus, tokenizer or cache is involved."""

    vocab_size = 256

    def __init__(self, seq_len: int, seed: int, split: int, num_windows: int, with_doc_ids: bool) -> None:
        self.seq_len, self.seed, self.split = seq_len, seed, split  # split: 0 train, 1 validation
        self.num_windows, self.with_doc_ids = num_windows, with_doc_ids

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> Window:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} of {self.num_windows}")
        rng = np.random.default_rng([self.seed, self.split, i])
        window = rng.integers(0, self.vocab_size, self.seq_len + 1)
        window[1::2] = (window[0:-1:2] * 3 + 1) % self.vocab_size
        doc_ids = np.zeros(self.seq_len, dtype=np.int32) if self.with_doc_ids else None
        return Window(window, doc_ids)


def collate(windows: list[Window]) -> Batch:
    windows = [Window(*w) for w in windows]  # plain (tokens, doc_ids[, target_mask]) tuples too
    tokens = torch.from_numpy(np.stack([w.tokens for w in windows]))
    documents = None
    if windows[0].doc_ids is not None:
        documents = documents_from_ids(torch.from_numpy(np.stack([w.doc_ids for w in windows])))
    targets = tokens[:, 1:].clone()
    if any(w.target_mask is not None for w in windows):  # a validation batch's filler has one
        counts = [np.ones(targets.shape[1], dtype=bool) if w.target_mask is None else w.target_mask
                  for w in windows]
        targets[~torch.from_numpy(np.stack(counts))] = IGNORE_INDEX
    return Batch(tokens[:, :-1].contiguous(), targets, documents)
