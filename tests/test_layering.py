"""DESIGN's import layering, checked on the source: layers import downward only, the rollout side never imports
Megatron, the train side imports neither the engine nor rollout/, types.py / rl_math.py import nothing of the
project, and the package has no module cycles (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "slime_lite"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


def imports(path: Path, main_block: bool = True) -> set[str]:
    """Every name imported anywhere in the file (at any depth), relative imports resolved to absolute names.

    ``main_block=False`` leaves out the ``if __name__ == "__main__":`` block: it runs only when the file is the
    program, which then is the top of the stack whatever its layer.
    """
    names = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    if not main_block:
        tree.body = [node for node in tree.body if not _is_main_block(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def project_deps(path: Path, main_block: bool = True) -> set[str]:
    """The project modules a file imports: each imported name cut back to the longest name that is a module."""
    deps = set()
    for name in imports(path, main_block):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            deps.add(name)
    deps.discard(module_name(path))
    return deps


def files(*parts: str) -> list[Path]:
    return sorted((PKG.joinpath(*parts)).glob("*.py"))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# Layers, top to bottom (DESIGN "The shape"): a module imports only modules of its own layer or below.
# Within a layer, sideways imports are allowed; cycles are caught by test_no_module_cycles.
# The longest matching prefix names a module's layer.
LAYERS = [
    ("CLI and user tools", ["slime_lite.cli", "slime_lite.debug", "slime_lite.plot", "slime_lite.tiny_model",
                            "slime_lite.tasks"]),
    ("driver", ["slime_lite.train", "slime_lite.train_async", "slime_lite.args", "slime_lite.args_check",
                "slime_lite.args_train", "slime_lite.args_layout", "slime_lite.args_async", "slime_lite.args_observe",
                "slime_lite.slime_flags", "slime_lite.preflight"]),
    ("rollout, trainer, placement", ["slime_lite.rollout", "slime_lite.backends", "slime_lite.placement"]),
    ("embedded engine", ["slime_lite.engine"]),
    ("run checks", ["slime_lite.checks"]),
    ("shared helpers", ["slime_lite.engine_client", "slime_lite.weight_transport", "slime_lite.weight_wire",
                        "slime_lite.weight_reader",
                        "slime_lite.weight_checksum", "slime_lite.lora_wire", "slime_lite.rollout_correction", "slime_lite.triton_build",
                        "slime_lite.swiglu",
                        "slime_lite.metrics",
                        "slime_lite.hooks", "slime_lite.tokenizer", "slime_lite.io", "slime_lite.logging_setup",
                        "slime_lite.profiling", "slime_lite.determinism"]),
    ("leaves", ["slime_lite.types", "slime_lite.rl_math", "slime_lite.errors", "slime_lite.config",
                "slime_lite.flag_types",
                "slime_lite.model_families", "slime_lite"]),
]


def layer_of(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    assert best is not None, f"{module} is in no layer of test_layering.LAYERS: add it"
    return best[0]



@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_downward_only(module):
    rank = layer_of(module)
    bad = [dep for dep in project_deps(MODULES[module], main_block=False) if layer_of(dep) < rank]
    assert not bad, f"{module} ({LAYERS[rank][0]}) imports upward: " + ", ".join(
        f"{d} ({LAYERS[layer_of(d)][0]})" for d in bad)


def test_no_module_cycles():
    graph = {name: project_deps(path) for name, path in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", files("rollout") + files("engine") + [PKG / "engine_client.py",
                                                                        PKG / "weight_transport.py",
                                                                        PKG / "weight_wire.py",
                                                                        PKG / "weight_reader.py"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rollout_side_never_imports_megatron(path):
    bad = [n for n in imports(path) if n.split(".")[0] == "megatron" or n.startswith("slime_lite.backends.megatron")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", files("backends", "megatron"), ids=lambda p: p.name)
def test_train_side_never_imports_the_engine(path):
    bad = [n for n in imports(path)
           if n.startswith("slime_lite.engine") and not n.startswith("slime_lite.engine_client")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", files("backends", "megatron"), ids=lambda p: p.name)
def test_train_side_imports_nothing_from_rollout(path):
    bad = [n for n in imports(path) if n == "slime_lite.rollout" or n.startswith("slime_lite.rollout.")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("name", ["types.py", "rl_math.py"])
def test_leaf_modules_import_nothing_of_the_project(name):
    assert not [n for n in imports(PKG / name) if n.startswith("slime_lite")]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_cli_imports_the_debug_tools(module):
    """debug/ holds the user-facing tools (the top layer): the run's own checks are in checks/, below the driver."""
    if module == "slime_lite.cli" or module == "slime_lite.debug" or module.startswith("slime_lite.debug."):
        return
    bad = sorted(d for d in project_deps(MODULES[module]) if d == "slime_lite.debug" or d.startswith("slime_lite.debug."))
    assert not bad, f"{module} imports {bad}"
