"""The package's layering (docs/layout.md) as a test: the import graph of its modules, read from their source, has no
cycle, between modules or between sub-packages, and no module imports one of a higher layer. Imports under
``if TYPE_CHECKING:`` are types only and do not count; imports inside functions (lazy ones) do. A name taken from a
package whose ``__init__`` loads it on first use (``_EXPORTS``) counts as an import of the module that defines it.
Also: every ``raise`` of the package raises a member of its error family."""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
from pathlib import Path

import pytest

import lightning_gaudi_ds

ROOT = Path(lightning_gaudi_ds.__file__).parent
PACKAGE = "lightning_gaudi_ds"

# Lowest first. A module belongs to the first layer with a prefix matching its name (relative to the package); it
# may import modules of its own layer or of lower ones.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations: the standard library only", (
        "errors", "_base_errors", "precisions", "_environ", "core.options", "config.keys", "launch.envvars", "launch.hostfile",
        "launch._proc", "planning.units", "planning.buckets",
    )),
    ("the libraries' private names, the devices", ("_lightning_errors", "_compat", "_classes", "hpu", "devices")),
    ("services that know no strategy or config", ("jit_ops", "launch", "checkpoint", "planning", "sequence")),
    ("DeepSpeed configs", ("config",)),
    ("what DeepSpeed's engines are given, Hugging Face models", ("engine", "hf")),
    ("the core under both strategies", ("core",)),
    ("the strategies and the accelerator", ("serving", "strategy", "fabric", "accelerator")),
    ("entry points", ("lightning_cli", "fabric_cli", "report", "cli", "__main__", "")),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


MODULES = _modules()


@functools.cache
def _tree(name: str) -> ast.Module:
    """Module ``name``'s syntax tree, parsed once for all the checks below."""
    return ast.parse(MODULES[name].read_text())


def _lazy_exports(package: str) -> dict[str, str]:
    """``name -> defining module`` of a package ``__init__`` that loads its names on first use."""
    module = importlib.import_module(package)
    exports = getattr(module, "_EXPORTS", {})
    return {name: target if target.startswith(PACKAGE) else f"{package}.{target}" for name, target in exports.items()}


def _import_nodes(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _imports(name: str) -> set[str]:
    """The package's modules that module ``name`` imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(_tree(name)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in MODULES:
                targets.add(full)  # a submodule
            elif base in MODULES and alias.name in _lazy_exports(base):
                targets.add(_lazy_exports(base)[alias.name])
            else:
                targets.add(base)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    relative = name[len(PACKAGE) + 1:] if name != PACKAGE else ""
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if relative == prefix or (prefix and relative.startswith(prefix + ".")):
                return index
    raise AssertionError(f"{name} is in no layer of tests/test_layering.py: add it to LAYERS (and docs/layout.md)")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def connect(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_no_module_imports_one_of_a_higher_layer() -> None:
    wrong = [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
        for name, targets in sorted(GRAPH.items()) for target in sorted(targets) if _layer(target) > _layer(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_cycle_between_sub_packages() -> None:
    def group(name: str) -> str:
        return ".".join(name.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(group(name), set()).update(group(t) for t in targets if group(t) != group(name))
    packages.pop(PACKAGE, None)  # the root: the entry point that registers everything, imported by nothing
    for targets in packages.values():
        targets.discard(PACKAGE)
    assert _cycles(packages) == []


def test_the_fabric_strategy_does_not_depend_on_the_trainers() -> None:
    reached, todo = set(), [f"{PACKAGE}.fabric"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(GRAPH[name])
    assert not reached & {f"{PACKAGE}.strategy", f"{PACKAGE}.serving", f"{PACKAGE}.lightning_cli"}


def test_the_foundations_import_no_third_party_module() -> None:
    import sys

    foundations = [name for name in MODULES if _layer(name) == 0]
    for name in foundations:
        for node in _import_nodes(_tree(name)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                top = module.split(".")[0]
                assert top in sys.stdlib_module_names or top == PACKAGE or (not module and node.level), (
                    f"{name} imports {module}: a foundation module imports the standard library only")


# What the language's and the CLI libraries' own protocols require: a module's __getattr__ raises AttributeError, an
# abstract member NotImplementedError, a command line SystemExit (argparse) or click's BadParameter (`fabric run`).
_PROTOCOL_RAISES = {"AttributeError", "NotImplementedError", "SystemExit", "BadParameter"}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_raise_is_of_the_error_family(name: str) -> None:
    from lightning_gaudi_ds import errors

    wrong = []
    for node in ast.walk(_tree(name)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue  # a bare `raise` re-raises what was caught
        call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        raised = call.attr if isinstance(call, ast.Attribute) else call.id if isinstance(call, ast.Name) else None
        if raised is None or raised.lstrip("_")[0].islower() or raised in _PROTOCOL_RAISES:
            continue  # a variable (an error built elsewhere and re-raised), or what a protocol requires
        # the class by its name in the module (imported only now: __main__ runs the CLI), else in the family's module
        cls = getattr(errors, raised, None) or getattr(importlib.import_module(name), raised, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.LightningGaudiDSError)):
            wrong.append(f"line {node.lineno}: raise {raised}")
    assert not wrong, f"{name}: " + "; ".join(wrong)
