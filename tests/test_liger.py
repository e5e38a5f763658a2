"""block=liger on CPU: what can be checked without liger-kernel's Triton kernels. It fails at build,
with the requirement named, where it cannot run, and it is the eager model's parameters under the
eager model's names (so layout, checkpoints, FSDP2, init and HF export carry over). Its numerics
against the eager model are tests/gpu/test_liger_model.py."""

import importlib.metadata

import pytest
import torch

from codatrain.kernels.resolve import ResolvedBlock
from codatrain.kernels.stages import BackendUnavailableError
from codatrain.model import build_model
from codatrain.model.config import get_preset
from codatrain.model.liger import (
    REQUIREMENT,
    LigerAttention,
    LigerLlama,
    LigerMLP,
    LigerRMSNorm,
    _unavailable_reason,
    check_liger,
)
from codatrain.model.llama import MLP, Attention, Llama, RMSNorm

CFG = get_preset("tiny").replace(n_layers=2)


def test_build_on_cpu_names_the_requirement():
    with pytest.raises(BackendUnavailableError) as info:
        build_model(CFG, ResolvedBlock("liger", None, None), device=torch.device("cpu"))
    assert str(info.value) == f"{REQUIREMENT}; here the model is on cpu"
    assert "liger-kernel 0.8.5" in REQUIREMENT and "pip install 'codatrain[liger]'" in REQUIREMENT


@pytest.fixture
def fresh_reasons():
    _unavailable_reason.cache_clear()
    yield
    _unavailable_reason.cache_clear()


def test_each_missing_piece_is_named(monkeypatch, fresh_reasons):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="here CUDA is not available"):
        check_liger("cuda")
    _unavailable_reason.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(BackendUnavailableError, match="here liger-kernel is not installed"):
        check_liger(torch.device("cuda", 0))
    _unavailable_reason.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0")
    with pytest.raises(BackendUnavailableError, match="here liger-kernel 0.6.0 is installed"):
        check_liger("cuda")


def test_same_parameters_names_and_init_as_eager():
    eager, liger = Llama(CFG), build_model(CFG, ResolvedBlock("liger", None, None))  # no device: not checked
    assert isinstance(liger, LigerLlama)
    eager_state, liger_state = eager.state_dict(), liger.state_dict()
    assert list(liger_state) == list(eager_state)
    for name, value in eager_state.items():
        torch.testing.assert_close(liger_state[name], value, rtol=0, atol=0, msg=name)
    assert liger.layout() == eager.layout()
    assert len(liger.blocks()) == CFG.n_layers
    # Every norm, MLP and attention runs Liger's forward, and is still the eager module to
    # isinstance checks (HF export, init, generation).
    swapped = {RMSNorm: LigerRMSNorm, MLP: LigerMLP, Attention: LigerAttention}
    kinds = [type(m) for m in liger.modules() if isinstance(m, tuple(swapped))]
    assert kinds.count(LigerRMSNorm) == 2 * CFG.n_layers + 1
    assert kinds.count(LigerMLP) == kinds.count(LigerAttention) == CFG.n_layers
    assert set(kinds) == set(swapped.values())


def test_head_refuses_reduction_none():
    with torch.device("meta"):
        model = LigerLlama(CFG)
    h = torch.zeros(1, 4, CFG.dim)
    with pytest.raises(ValueError, match="reduction='none' is not one of mean, sum"):
        model.head(h, torch.zeros(1, 4, dtype=torch.long), "none")
