"""The order in which an epoch visits the windows of stored data: a permutation of [0, n) that is
computed index by index, so it takes O(1) memory whatever n (a 100B-token corpus at seq 2048 has
49M windows: a materialized int64 permutation would be 390 MB per rank and epoch).

The permutation is a keyed Feistel network over the 2^b values of b = ceil(log2 n) bits, split in
a high and a low half: every half-round XORs one half with a keyed hash of the other, which is its
own inverse, so the network is a bijection of [0, 2^b). Cycle-walking makes it one of [0, n): an
image at or past n is permuted again until it falls below n, which it does (its cycle contains the
start), after fewer than 2 steps on average since 2^b < 2n. The keys come from the run's seed and
the epoch, so `WindowOrder(n, (seed, epoch))[i]` is a pure function and a checkpoint needs only
the position in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Luby-Rackoff: 4 rounds make a pseudorandom permutation from pseudorandom round functions; 2 more
# make up for the round function being a fast mixer, not a cryptographic one.
ROUNDS = 6
# Recorded in the loader's state: a checkpoint made with another order cannot continue its epoch
# exactly (1: the materialized numpy permutation of earlier versions).
ORDER_VERSION = 2
_U64 = np.uint64


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of values + key: every output bit depends on every input bit."""
    z = (values + key) * _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


class WindowOrder:
    """The permutation of [0, n) that an epoch visits: `order[i]` is the i-th window visited, and
    `order[a:b]` the windows a..b-1 as an int64 array. `key=None` is the identity (no shuffle)."""

    def __init__(self, n: int, key: Sequence[int] | None) -> None:
        self.n = n
        self._keys = None
        if key is not None:
            bits = max(2, (n - 1).bit_length())  # both halves at least one bit
            self._low_bits = _U64(bits // 2)
            self._low_mask, self._high_mask = _U64((1 << bits // 2) - 1), _U64((1 << bits - bits // 2) - 1)
            self._keys = np.random.default_rng(list(key)).integers(0, 2**64, 2 * ROUNDS, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int | slice) -> int | np.ndarray:
        if isinstance(index, slice):
            positions = range(self.n)[index]
            return self._permute(np.arange(positions.start, positions.stop, positions.step, dtype=np.int64))
        if not -self.n <= index < self.n:
            raise IndexError(f"position {index} of a permutation of {self.n}")
        return int(self._permute(np.array([index % self.n], dtype=np.int64))[0])

    def _permute(self, positions: np.ndarray) -> np.ndarray:
        if self._keys is None:
            return positions
        values = self._feistel(positions.astype(np.uint64))
        outside = values >= self.n
        while outside.any():  # cycle-walking
            values[outside] = self._feistel(values[outside])
            outside = values >= self.n
        return values.astype(np.int64)

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        high, low = values >> self._low_bits, values & self._low_mask
        for r in range(ROUNDS):
            high = high ^ (_mix(low, self._keys[2 * r]) & self._high_mask)
            low = low ^ (_mix(high, self._keys[2 * r + 1]) & self._low_mask)
        return (high << self._low_bits) | low
