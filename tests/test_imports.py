"""The house's shape: no module of beeswarm imports another in a loop, not even for annotations only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "beeswarm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The beeswarm modules `path` imports anywhere (functions and TYPE_CHECKING blocks included)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x` in package a.b is a.b.x
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from pkg import name`: the submodule if it is one
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_module_imports_another_in_a_loop():
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    # a package's __init__ importing its own modules is how packages work; a module importing it back is not
    for name in graph:
        graph[name] = {m for m in graph[name] if not (paths[name].name == "__init__.py" and m.startswith(name + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not cycles, "import loops:\n" + "\n".join(" -> ".join(c) for c in cycles)
