"""Lazy loading of stage backends through the registry: a provider module is imported on first use
only, and a name nobody provides, or a provider that fails, gives a clear error."""

import sys

import pytest
import torch

from codatrain.kernels import stages
from codatrain.kernels.stages import BackendUnavailableError, StageBackend, get_backend, load_registered

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
    with pytest.raises(BackendUnavailableError, match="a_module_that_is_not_installed.*cuda extras"):
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

