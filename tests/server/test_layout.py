"""The server is an add-on: the library (everything ``needle_wgpu`` reaches) never imports it,
so a plain install and Pyodide never need FastAPI; only the command line's ``serve`` does."""

from tests.test_imports import graph


def reached_from(edges: dict, start: str) -> set:
    reach, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    return reach


def test_the_library_does_not_import_the_server():
    edges = graph()
    library = {m for m in edges if not m.startswith(("needle_wgpu.server", "needle_wgpu.cli"))
               and m != "needle_wgpu.__main__"}  # the command line's entry point
    for module in library:
        assert not {m for m in reached_from(edges, module) if m.startswith("needle_wgpu.server")}, module


def test_the_server_is_reached_only_from_the_serve_command():
    edges = graph()
    importers = {m for m, targets in edges.items() if any(t.startswith("needle_wgpu.server") for t in targets)
                 and not m.startswith("needle_wgpu.server")}
    assert importers == {"needle_wgpu.cli.serve"}
