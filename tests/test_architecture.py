"""The shape of the code, checked: the worker and the model never reach into the engine or the entry points
(the engine/worker contract is plain data, tinyvllm/contract.py), no two modules import each other through
any chain, and nothing points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyvllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The tinyvllm modules the file imports, at the top or inside a function (a lazy import that dodges a
    cycle is still a cycle). `from package import name` imports the submodule `name` if there is one, else
    the package."""
    found = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def test_worker_and_model_import_nothing_from_engine_or_entrypoints() -> None:
    bad = [(module, target) for module, targets in import_graph().items()
           if module.startswith(("tinyvllm.worker", "tinyvllm.model")) for target in targets
           if target.startswith(("tinyvllm.engine", "tinyvllm.entrypoints"))]
    assert not bad, f"the worker/model side imports the engine side: {bad}"


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"\.\./shared|(?<![\w/])shared/(DESIGN|BENCHMARKS|TOOLCHAIN|STYLE)\.md")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *PACKAGE.rglob("*.py"),
             *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "tests").rglob("*.py")]
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files if f != Path(__file__)
            for i, line in enumerate(f.read_text().splitlines(), start=1) if outside.search(line)]
    assert not hits, f"paths outside the repository: {hits}"
