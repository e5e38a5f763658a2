import pytest
import torch


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def use_compile(request) -> bool:
    """Run a stage directly and under torch.compile (cute_check.staged), as QuACK's tests do."""
    if request.param:
        torch._dynamo.reset()  # every test compiles afresh, below Dynamo's recompile limit
    return request.param
