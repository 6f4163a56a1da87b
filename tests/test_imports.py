"""The package's modules import one another without a circle: every import is read from the
source, those inside functions included (an import moved into a function to dodge a circle still
counts), and the graph must be acyclic. The library never imports the command line."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "needle_wgpu"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set) -> set:
    """The package modules ``name`` imports, anywhere in its source (``from . import x`` names
    the submodule x where there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "needle_wgpu"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "needle_wgpu":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def graph() -> dict:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycle(edges: dict) -> list | None:
    """One cycle of the graph, as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_imports_without_a_circle():
    found = cycle(graph())
    assert found is None, "import circle: " + " -> ".join(found)


def test_a_planted_circle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_library_does_not_import_the_command_line():
    edges = graph()
    reach, todo = set(), ["needle_wgpu"]
    while todo:
        node = todo.pop()
        for nxt in edges.get(node, ()):
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    assert not {m for m in reach if m == "needle_wgpu.cli" or m.startswith("needle_wgpu.cli.")}


def test_pyproject_ships_every_package():
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(PACKAGE.parent).parts)
               for p in PACKAGE.rglob("__init__.py")}
    assert present <= listed and listed - present == {"needle_wgpu.shaders"}
