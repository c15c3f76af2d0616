"""DESIGN's import layering, checked on the source: the rollout side never imports Megatron, the train side never
imports the engine, and types.py / rl_math.py import nothing of the project."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "slime_lite"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def files(*parts: str) -> list[Path]:
    return sorted((PKG.joinpath(*parts)).glob("*.py"))


@pytest.mark.parametrize("path", files("rollout") + files("engine") + [PKG / "engine_client.py",
                                                                        PKG / "weight_transport.py"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rollout_side_never_imports_megatron(path):
    bad = [n for n in imports(path) if n.split(".")[0] == "megatron" or n.startswith("slime_lite.backends.megatron")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", files("backends", "megatron"), ids=lambda p: p.name)
def test_train_side_never_imports_the_engine(path):
    bad = [n for n in imports(path)
           if n.startswith("slime_lite.engine") and not n.startswith("slime_lite.engine_client")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("name", ["types.py", "rl_math.py"])
def test_leaf_modules_import_nothing_of_the_project(name):
    assert not [n for n in imports(PKG / name) if n.startswith("slime_lite")]
