"""The package's import structure: every module imports, no import cycle, and the layers import
downwards only, ``train → config → data → model → kernels`` (kernels know nothing above them;
data owns its config and imports neither Hydra nor the run schema).

The graph is read from the source (every import statement, also those inside functions and
under TYPE_CHECKING), so an import that runs only on some path still counts.
"""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "codatrain"
# Lowest first; a module may import its own layer and those below it.
LAYERS = ("kernels", "model", "data", "config", "train")
# The cute backend needs the cuda extras; without them its modules are checked in the graph only.
CUDA_EXTRAS = ("cutlass", "quack", "flash_attn")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def imports(module: str) -> set[str]:
    """The codatrain modules `module` imports: `from codatrain.a import b` names codatrain.a.b
    when that is a module, else codatrain.a."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: codatrain imports itself by absolute names"
            base = node.module
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [name if name in MODULES else base for name in names]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    found.discard(module)
    return found


GRAPH = {module: imports(module) for module in MODULES}


@pytest.mark.parametrize("module", list(MODULES))
def test_every_module_imports(module):
    if module.startswith("codatrain.kernels.cute") and not all(
        importlib.util.find_spec(name) for name in CUDA_EXTRAS
    ):
        pytest.skip("needs the cuda extras")
    importlib.import_module(module)


def test_layers_import_downwards_only():
    upward = [
        f"{module} ({LAYERS[layer(module)]}) imports {target} ({LAYERS[layer(target)]})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            raise AssertionError("import cycle: " + " → ".join(cycle))
        if module in done:
            return
        path.append(module)
        for target in sorted(GRAPH[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in MODULES:
        visit(module)


def test_data_imports_neither_hydra_nor_the_run_schema():
    found = []
    for module, path in MODULES.items():
        if not module.startswith("codatrain.data"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            found += [f"{module} imports {name}" for name in names
                      if name.split(".")[0] in ("hydra", "omegaconf") or name == "codatrain.config"]
    assert not found, "\n".join(found)


PRIVATE_OWNERS = ("quack", "flash_attn", "torch", "cutlass")


def private_uses(path: Path) -> list[str]:
    """The private names of QuACK, FA4, CuTeDSL and torch that a module imports or reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in PRIVATE_OWNERS:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] in PRIVATE_OWNERS]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            names = [] if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "ctx") \
                else [f"….{node.attr}"]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {name}" for name in names
                  if any(part.startswith("_") and not part.startswith("__") for part in name.split("."))]
    return found


def test_private_library_names_are_used_only_in_pins():
    """codatrain/kernels/cute/pins.py is the one module that reaches into QuACK's, FA4's and
    torch's internals, so a version bump fails in one place, naming the pin."""
    found = [use for module, path in MODULES.items() if module.startswith("codatrain.kernels.cute")
             and module != "codatrain.kernels.cute.pins"
             for use in private_uses(path)]
    assert not found, "\n".join(found)
    assert private_uses(MODULES["codatrain.kernels.cute.pins"])  # the check sees them


def test_a_private_name_that_is_gone_names_the_pin():
    if not all(importlib.util.find_spec(name) for name in CUDA_EXTRAS):
        pytest.skip("needs the cuda extras")
    from codatrain.kernels.cute.pins import installed, private_name

    with pytest.raises(ImportError, match=(
            r"^quack\.rmsnorm\._gone, a private name of quack-kernels that codatrain uses, is gone .*; "
            rf"codatrain pins quack-kernels==\S+, and quack-kernels {re.escape(installed('quack-kernels'))} "
            "is installed$")):
        private_name("quack.rmsnorm", "_gone", "quack-kernels")


def test_layout_tables_are_applied_in_one_place():
    """Outside the models, only CanonicalMapping reads a layout table: checkpoints, HF import and
    export and weight init all go through it."""
    readers = sorted(
        module for module, path in MODULES.items() if not module.startswith("codatrain.model")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "layout"
    )
    assert readers == ["codatrain.train.canonical_state"]


def test_the_graph_sees_imports():
    # The checks above pass on an empty graph too: make sure it holds the edges it should.
    assert "codatrain.kernels.stages" in GRAPH["codatrain.model.coda"]
    assert "codatrain.kernels.cute.entry" in GRAPH["codatrain.kernels.cute.compile_specs"]
    assert "codatrain.train.kernel_cache" in GRAPH["codatrain.train.trainer"]
    assert "codatrain.data.config" in GRAPH["codatrain.config"]
