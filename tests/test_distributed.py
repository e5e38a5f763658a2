"""Process-group setup and teardown (codatrain/train/distributed.py) on one CPU process."""

from codatrain.train import distributed


def test_a_gloo_process_lets_the_workers_finish_at_exit(monkeypatch):
    """A process that made a gloo group sleeps at exit before the interpreter finalizes: gloo's
    worker threads free finished collectives' Python tensors after their waiters return, and one
    asking for the GIL during finalization aborts the process (`_let_gloo_workers_finish`)."""
    registered = []
    monkeypatch.setattr(distributed.atexit, "register", registered.append)
    monkeypatch.setattr(distributed, "_gloo_drain_registered", False)
    info = distributed.init_distributed("cpu")
    assert info.world_size == 1 and distributed.torch.distributed.get_backend() == "gloo"
    assert registered == [distributed._let_gloo_workers_finish]
    distributed.shutdown_distributed()
    distributed.init_distributed("cpu")  # a second group in the same process: registered once
    assert registered == [distributed._let_gloo_workers_finish]
