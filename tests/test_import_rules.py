"""The package graph is a tree: common at the bottom, scheduler / router / gpu_worker each on common only,
pagedserve/ composing them. Every import is checked, function-local ones included, by walking the AST."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
OURS = {"common", "scheduler", "router", "gpu_worker", "pagedserve", "loadtest", "tests"}
ALLOWED = {
    "common": {"common"},
    "scheduler": {"common", "scheduler"},
    "router": {"common", "router"},
    "gpu_worker": {"common", "gpu_worker"},
    "pagedserve": {"common", "scheduler", "router", "gpu_worker", "pagedserve"},
}


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the module, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def forbidden_imports(package: str, source: str) -> list[str]:
    return [f"line {line}: {package} imports {target}" for line, target in imported_packages(source)
            if target in OURS and target not in ALLOWED[package]]


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_tree_allows(package: str) -> None:
    files = modules(package)
    assert files, f"no modules found under {package}/"
    errors = [f"{path.relative_to(REPO)} {e}" for path in files for e in forbidden_imports(package, path.read_text())]
    assert not errors, "\n".join(errors)


def test_the_checker_sees_function_local_and_nested_imports() -> None:
    """The rule would be worthless if a hidden import slipped through: each form below must be caught."""
    source = '''
import torch
from common.protocol import encode
def run():
    from gpu_worker.model_runner import ModelRunner
    import scheduler.executor
class X:
    def f(self):
        if True:
            from pagedserve import LLM
'''
    errors = forbidden_imports("scheduler", source)
    assert errors == ["line 5: scheduler imports gpu_worker", "line 10: scheduler imports pagedserve"]
    assert forbidden_imports("common", "from scheduler.sequence import Sequence\n") == \
        ["line 1: common imports scheduler"]
    assert forbidden_imports("pagedserve", source) == []
