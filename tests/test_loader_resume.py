"""Resume at the edges of an epoch: one batch left, and a saved position that a larger global
batch overruns (the run continues with the next epoch and repeats no window)."""

from test_data_loader import make, take


def test_resume_with_exactly_one_batch_left_in_the_epoch():
    # 11 windows, 2 a step: 5 steps an epoch (window order(0)[10] is left over).
    reference = take(make(11, 2), 8)
    first = make(11, 2)
    take(first, 4)
    assert first.state_dict()["epoch"] == 0 and first.state_dict()["offset"] == 8
    resumed = make(11, 2)
    resumed.load_state_dict(first.state_dict())
    after = take(resumed, 4)
    assert after == reference[4:]
    assert after[0] == resumed.order(0)[8:10].tolist()  # the epoch's last batch, then epoch 1
    assert after[1] == resumed.order(1)[0:2].tolist()


def test_resume_with_a_global_batch_that_exactly_fills_the_epoch_stays_in_it():
    first = make(12, 2)
    take(first, 4)  # offset 8: 4 windows left
    resumed = make(12, 4)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 1) == [first.order(0)[8:12].tolist()]


def test_resume_after_the_global_batch_grew_past_the_epoch_starts_the_next_epoch():
    first = make(12, 2)
    seen = sum(take(first, 5), [])  # offset 10: 2 windows left, fewer than the new global batch
    assert first.state_dict()["offset"] == 10
    halves = [make(12, 2, rank=rank, world_size=2) for rank in range(2)]  # global batch 4
    for loader in halves:
        loader.load_state_dict(first.state_dict())
        assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 0
    steps = [take(loader, 3) for loader in halves]
    epoch1 = sum((steps[0][s] + steps[1][s] for s in range(3)), [])
    assert epoch1 == halves[0].order(1)[:].tolist()  # the whole next epoch, from its start
    assert sorted(epoch1) == list(range(12)) and len(set(seen)) == 10  # nothing repeated within an epoch
