"""Lazy loading of stage backends through the registry: a provider module is imported on first use
only, and a name nobody provides, or a provider that fails, gives a clear error."""

import sys

import pytest
import torch

from codatrain.kernels import stages
from codatrain.kernels.reference import ReferenceStages
from codatrain.kernels.stages import (
    BackendUnavailableError,
    StageBackend,
    get_backend,
    is_sm90,
    load_registered,
)

PROVIDER = "lazy_test_provider"


@pytest.fixture
def provider(tmp_path, monkeypatch):
    """A provider module on sys.path, registered in _PROVIDERS as "lazy", not imported yet.
    Returns a function that writes the module's source."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(stages._PROVIDERS, "lazy", PROVIDER)
    monkeypatch.delitem(sys.modules, PROVIDER, raising=False)
    yield lambda source: (tmp_path / f"{PROVIDER}.py").write_text(source)
    stages._BACKENDS.pop("lazy", None)
    sys.modules.pop(PROVIDER, None)


def test_provider_module_is_imported_on_first_use_only(provider):
    provider("from codatrain.kernels.reference import ReferenceStages\n"
             "from codatrain.kernels.stages import register_backend\n"
             "IMPORTS = [1]\n"
             "register_backend('lazy', ReferenceStages())\n")
    assert PROVIDER not in sys.modules and "lazy" not in stages._BACKENDS
    backend = get_backend("lazy", "cpu")
    assert PROVIDER in sys.modules
    assert isinstance(backend, StageBackend) and backend.name == "lazy"
    assert get_backend("lazy", torch.device("cpu")) is backend
    assert sys.modules[PROVIDER].IMPORTS == [1]  # imported once, not once per call


def test_provider_that_does_not_register_is_unavailable(provider):
    provider("VALUE = 1\n")
    message = f"'lazy' is unavailable: {PROVIDER} did not register it"
    with pytest.raises(BackendUnavailableError, match=message):
        get_backend("lazy", "cpu")


def test_provider_that_fails_to_import_is_unavailable_with_the_reason_and_hint(provider):
    provider("import a_module_that_is_not_installed\n")
    hint = (r"It needs an sm_90 GPU and the cuda extras \(pip install 'codatrain\[cuda\]'\); "
            r"block\.backend=reference runs anywhere\.")
    with pytest.raises(BackendUnavailableError, match=rf"a_module_that_is_not_installed'\. {hint}$"):
        get_backend("lazy", "cpu")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown stage backend 'nope'; known: cute, reference"):
        get_backend("nope", "cpu")


def test_load_registered_serves_any_registry():
    registry = {"ready": 7}
    assert load_registered("widget", "ready", registry, {}, hint="") == 7
    with pytest.raises(ValueError, match=r"unknown widget 'other'; known: .*ready, spare"):
        load_registered("widget", "other", registry, {"spare": "no.such.module"}, hint="")
    message = r"widget 'spare' is unavailable: No module named 'no'\. Try X\."
    with pytest.raises(BackendUnavailableError, match=message):
        load_registered("widget", "spare", registry, {"spare": "no.such.module"}, hint="Try X.")



def test_get_backend_checks_the_device_it_will_run_on_and_names_it_when_refused(monkeypatch):
    """A bare "cuda" means the current CUDA device (as tensors placed there); an index is kept."""
    asked = []

    class Probe(ReferenceStages):
        def unsupported_reason(self, device):
            asked.append(device)
            return "not this one" if device.index == 1 else None

    probe = Probe()
    monkeypatch.setitem(stages._BACKENDS, "probe", probe)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert get_backend("probe", "cuda") is probe
    assert get_backend("probe", torch.device("cuda", 0)) is probe
    message = r"^stage backend 'probe' cannot run on cuda:1: not this one$"
    with pytest.raises(BackendUnavailableError, match=message):
        get_backend("probe", "cuda:1")
    assert asked == [torch.device("cuda", 2), torch.device("cuda", 0), torch.device("cuda", 1)]


def test_is_sm90_asks_the_capability_of_the_device_it_is_given(monkeypatch):
    capabilities = {0: (8, 0), 1: (9, 0), 2: (10, 0)}
    asked = []

    def capability(device):
        asked.append(device)
        return capabilities[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert [is_sm90(torch.device("cuda", i)) for i in range(3)] == [False, True, False]
    assert asked == [torch.device("cuda", i) for i in range(3)]
    assert not is_sm90(torch.device("cpu"))
    assert len(asked) == 3  # a CPU device asks no CUDA question
