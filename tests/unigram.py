"""The unigram entropy of a corpus: the loss of the best model that ignores context, a bar that a
model which learns anything goes below (tests/test_data_train.py)."""

import numpy as np

from codatrain.data import prepare_streams
from codatrain.data.config import DataConfig


def unigram_entropy(cfg: DataConfig) -> float:
    """Entropy in nats per token of the training stream's token frequencies (BOS/EOS included)."""
    streams = prepare_streams(cfg)
    vocab_size = streams.tokenizer.vocab_size
    counts = sum(np.bincount(tokens, minlength=vocab_size) for tokens, _ in streams.train.arrays())
    p = counts[counts > 0] / streams.train.num_tokens
    return float(-(p * np.log(p)).sum())
