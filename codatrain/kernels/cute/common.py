"""Helpers shared by the cute stages: output allocation, 16-byte alignment, and the tiling of the
row kernels (entry.py, rowwise.py), which give one row to one CTA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor

from codatrain.kernels.resolve import ROW_MULTIPLE


def empty(*shape: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised output on `like`'s device, in `dtype` (default: `like`'s)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def padded_width(n: int) -> int:
    """`n` rounded up to whole 16-byte units of a 16-bit dtype."""
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def rows_of_whole_vectors(t: Tensor) -> Tensor:
    """`t` (M, N) itself when its row stride is whole 16-byte units, else a copy as the (M, N) view
    of zero-padded rows of `padded_width(N)` elements (TMA reads the view; the padding is 0)."""
    if t.stride(1) == 1 and t.stride(0) % ROW_MULTIPLE == 0:
        return t
    padded = t.new_zeros(t.shape[0], padded_width(t.shape[1]))
    padded[:, : t.shape[1]] = t
    return padded[:, : t.shape[1]]


def aligned16(t: Tensor) -> Tensor:
    """`t`, copied if it does not start on a 16-byte boundary. The kernels load 16-byte vectors
    (QuACK's row/column vector loads too), and views need not start there: a parameter inside a
    flat buffer, or the row slices of per-row statistics the LM-head backward passes."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@dataclass(frozen=True)
class RowTiling:
    """How a row kernel covers a row of `n` elements with one CTA.

    The row is split into `vec`-element vectors; thread t owns vectors t, t + num_threads, …
    (`steps` of them). `tile_n` rounds the row up to a whole number of such sweeps; vectors past
    `n` are masked off (`copy_masked`).
    """

    n: int
    vec: int
    num_threads: int
    steps: int
    tile_n: int

    @classmethod
    def of(cls, n: int, vec: int, max_threads: int) -> RowTiling:
        """Vectors of gcd(n, vec) elements, in whole warps of at most `max_threads` threads."""
        vec = math.gcd(n, vec)
        vectors = n // vec
        num_threads = min(max_threads, 32 * math.ceil(vectors / 32))
        steps = math.ceil(vectors / num_threads)
        return cls(n, vec, num_threads, steps, steps * num_threads * vec)


@cute.jit
def copy_masked(
    atom: cute.CopyAtom,
    src: cute.Tensor,
    dst: cute.Tensor,
    columns: cute.Tensor,
    n: cutlass.Constexpr[int],
    steps: cutlass.Constexpr[int],
) -> None:
    """Copy this thread's vectors (step by step) from `src` to `dst`, skipping those whose first
    column (`columns`, the identity tensor partitioned like them) lies past the row's `n`."""
    for step in cutlass.range_constexpr(steps):
        if columns[0, step] < n:
            cute.copy(atom, src[None, step], dst[None, step])
