"""The loader contract the trainer relies on.

`build_loaders` returns (train, val): iterables of (inputs, targets) LongTensor pairs of shape
(micro_batch_size, seq_len), already on the training device, with `state_dict()` /
`load_state_dict()` for exact resume and `vocab_size` for the model check.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from codatrain.config import DataConfig


class TokenBatches:
    """Random tokens with a learnable rule (each target is a fixed function of its input), seeded
    per rank; used for benchmarks and until a real corpus is configured."""

    vocab_size = 256

    def __init__(self, batch_size: int, seq_len: int, rank: int, seed: int, device: torch.device) -> None:
        self.batch_size, self.seq_len, self.device = batch_size, seq_len, device
        self.rank, self.seed = rank, seed
        self.step = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.rank * 7919 + self.step)
            seq = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
            seq[:, 1::2] = (seq[:, 0:-1:2] * 3 + 1) % self.vocab_size
            self.step += 1
            yield seq[:, :-1].to(self.device), seq[:, 1:].to(self.device)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def build_loaders(
    cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int, device: torch.device,
    max_seq_len: int,
) -> tuple[TokenBatches, TokenBatches]:
    if cfg.seq_len > max_seq_len:
        raise ValueError(f"data.seq_len={cfg.seq_len} exceeds model.max_seq_len={max_seq_len}")
    train = TokenBatches(batch_size, cfg.seq_len, rank, seed, device)
    val = TokenBatches(batch_size, cfg.seq_len, rank + world_size, seed + 1, device)
    return train, val
