"""Order, sharding and exact resume of PackedLoader, on a dataset whose window i is all i's."""

import re
import tracemalloc
from itertools import islice

import numpy as np
import pytest
import torch

from codatrain.data.loader import PackedLoader
from codatrain.kernels.stages import IGNORE_INDEX


class IndexWindows(torch.utils.data.Dataset):
    seq_len = 3

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.seq_len + 1, i, dtype=np.int64), None


def make(n, batch_size=2, rank=0, world_size=1, workers=0, seed=0, repeat=True, shuffle=True):
    return PackedLoader(IndexWindows(n), name="training", vocab_size=n, batch_size=batch_size, rank=rank,
                        world_size=world_size, seed=seed, device=torch.device("cpu"), shuffle=shuffle,
                        repeat=repeat, num_workers=workers)


def take(loader, k):
    return [b.inputs[:, 0].tolist() for b in islice(loader, k)]


def test_ranks_are_disjoint_and_cover_the_epoch():
    n, world, batch = 50, 3, 4  # 12 windows a step: 4 steps an epoch, 2 windows left over
    loaders = [make(n, batch, rank, world) for rank in range(world)]
    assert len(loaders[0]) == 4
    per_rank = [take(loader, 8) for loader in loaders]  # two epochs
    for epoch in range(2):
        seen = [sum(batches[4 * epoch:4 * epoch + 4], []) for batches in per_rank]
        flat = sum(seen, [])
        assert len(flat) == len(set(flat)) == 48  # disjoint across ranks and steps
        # Step by step, rank r holds the r-th slice of the epoch's permutation.
        assert flat != sorted(flat)
        order = loaders[0].order(epoch)
        for step in range(4):
            step_indices = sum((per_rank[r][4 * epoch + step] for r in range(world)), [])
            assert step_indices == order[12 * step:12 * step + 12].tolist()
    assert per_rank[0][:4] != per_rank[0][4:]  # a new order in the second epoch


def test_order_is_seeded_and_changes_every_epoch():
    a, b, c = make(40, seed=1), make(40, seed=1), make(40, seed=2)
    assert (a.order(0)[:] == b.order(0)[:]).all() and (a.order(3)[:] == b.order(3)[:]).all()
    assert not (a.order(0)[:] == a.order(1)[:]).all()
    assert not (a.order(0)[:] == c.order(0)[:]).all()
    assert sorted(a.order(5)[:].tolist()) == list(range(40))
    assert (make(40, shuffle=False).order(2)[:] == np.arange(40)).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 65, 1000, 4097])
def test_order_is_a_permutation_of_every_size(n):
    for epoch in range(3):
        order = make(n, batch_size=1, seed=7).order(epoch)
        visited = order[:]
        assert sorted(visited.tolist()) == list(range(n))
        assert [order[i] for i in (0, n // 2, -1)] == visited[[0, n // 2, -1]].tolist()
        assert (order[n // 3:n // 3 + 5] == visited[n // 3:n // 3 + 5]).all()  # a rank's slice
    if n >= 64:  # shuffled, not merely rotated or reflected
        visited = make(n, seed=7).order(0)[:]
        assert len(set(np.diff(visited).tolist())) > n // 4


def test_order_memory_does_not_grow_with_the_windows():
    """Stored data's loader builds each batch's indices from the permutation without materializing
    it: a few kilobytes for 10^4 windows, 10^7 (an 80 MB permutation as an array) and 2^62."""
    peaks = []
    for n in (10**4, 10**7, 2**62):
        tracemalloc.start()
        batches = take(make(n, batch_size=4), 3)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        indices = sum(batches, [])
        assert len(set(indices)) == 12 and all(0 <= i < n for i in indices)
    assert max(peaks) < 2**20


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_resume_of_resume_gives_the_uninterrupted_batches(rank, world_size):
    # 23 windows, 3 per rank per step: an epoch is 7 steps alone and 3 steps for two ranks.
    n, batch, total = 23, 3, 20
    uninterrupted = make(n, batch, rank, world_size)
    reference = take(uninterrupted, total)
    first = make(n, batch, rank, world_size, workers=0)
    got = take(first, 7)  # stops exactly at an epoch boundary (alone)
    second = make(n, batch, rank, world_size, workers=2)
    second.load_state_dict(first.state_dict())
    got += take(second, 5)
    third = make(n, batch, rank, world_size, workers=1)
    third.load_state_dict(second.state_dict())
    got += take(third, total - 12)
    assert got == reference
    assert third.state_dict() == uninterrupted.state_dict()


def test_state_counts_batches_handed_out_not_prefetched():
    loader = make(30, batch_size=2, workers=2)
    it = iter(loader)
    next(it)
    next(it)  # the workers have read further ahead than this
    assert loader.state_dict()["offset"] == 4 and loader.state_dict()["epoch"] == 0


def test_resume_with_another_world_size_continues_the_same_windows():
    reference = take(make(40, batch_size=4), 6)  # one rank, 4 windows a step
    alone = make(40, batch_size=4)
    take(alone, 3)
    halves = []
    for rank in range(2):  # two ranks of 2 windows each take over after step 3
        loader = make(40, batch_size=2, rank=rank, world_size=2)
        loader.load_state_dict(alone.state_dict())
        halves.append(take(loader, 3))
    assert [halves[0][s] + halves[1][s] for s in range(3)] == reference[3:]


def test_state_of_other_data_is_rejected():
    state = make(40).state_dict()
    with pytest.raises(ValueError, match="num_windows=40"):
        make(41).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make(40, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="order=1"):  # a checkpoint of the materialized permutation
        make(40).load_state_dict({k: v for k, v in state.items() if k != "order"})
    make(40, shuffle=False).load_state_dict({k: v for k, v in state.items() if k != "order"})


def test_loading_state_while_iterating_is_an_error():
    loader = make(40)
    it = iter(loader)
    next(it)
    loader.load_state_dict(make(40).state_dict())
    with pytest.raises(RuntimeError, match="iter"):
        next(it)


def test_validation_loader_makes_the_same_finite_pass_each_time():
    val = make(21, batch_size=2, rank=1, world_size=2, repeat=False, shuffle=False)
    assert len(val) == 6  # 5 full global batches and window 20 with filler
    first, second = take(val, 100), take(val, 100)
    assert first == second and len(first) == 6
    assert first[0] == [2, 3] and first[1] == [6, 7]  # rank 1's slice of each unshuffled step


def test_validation_smaller_than_a_global_batch_is_read_whole_and_padded_without_targets():
    # 3 windows, 2 per rank x 2 ranks: rank 0 reads windows 0 and 1, rank 1 window 2 and one filler.
    ranks = [list(make(3, batch_size=2, rank=r, world_size=2, repeat=False, shuffle=False)) for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [1, 1]
    (first,), (second,) = ranks
    assert first.inputs[:, 0].tolist() == [0, 1] and (first.targets != IGNORE_INDEX).all()
    assert second.inputs[:, 0].tolist() == [2, 0]
    assert (second.targets[0] == 2).all() and (second.targets[1] == IGNORE_INDEX).all()
    counted = sum(int((b.targets != IGNORE_INDEX).sum()) for b in (first, second))
    assert counted == 3 * IndexWindows.seq_len
    with pytest.raises(ValueError, match=re.escape(
            "the validation data has no sequence of seq_len+1 tokens; use more data")):
        PackedLoader(IndexWindows(0), name="validation", vocab_size=1, batch_size=2, rank=0, world_size=1,
                     seed=0, device=torch.device("cpu"), shuffle=False, repeat=False, num_workers=0)


def test_too_little_data_for_one_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make(7, batch_size=4, world_size=2)
