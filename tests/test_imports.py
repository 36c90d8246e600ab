"""Import structure of the product code, read from the source (AST), not by importing it.

Reference: ARCHITECTURE.md. No import cycle between our files (function-level imports count:
a cycle hidden in a function is still two files that need each other), and imports follow the
data flow router -> server -> engine -> kernels, with kernels importing nothing of ours. One
check imports for real (a subprocess): the router process must not load torch.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["server", "engine", "kernels", "connectors", "router"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tandem", *parts])


def import_graph() -> dict[str, set[str]]:
    """tandem module -> the tandem modules it imports (a `from package import name` counts as the
    submodule package.name where that is a module, else as the package)."""
    files = {_module_name(p): p for part in PARTS for p in (ROOT / part).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_reads_this_repository():
    graph = import_graph()
    assert "tandem.kernels.linear" in graph["tandem.engine.layers.linear"]


def test_a_server_to_router_import_is_caught():
    graph = {"tandem.server.api": {"tandem.router.registry", "tandem.engine.config"},
             "tandem.router.app": {"tandem.server.lifecycle"}}
    assert disallowed(graph, "server") == ["tandem.server.api -> tandem.router.registry"]
    assert disallowed(graph, "router") == []


def test_no_import_cycle_between_files():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# part -> the other parts it may import (ARCHITECTURE.md: data and imports flow client -> router ->
# server -> engine -> kernels, KV leaves through connectors; kernels imports nothing of ours). So
# router imports server (the lifecycle, API-key and text checks both serve with, and the registry
# messages instances send: server/registry_protocol.py) and server never imports router: `server
# --role router` execs `python -m tandem.router`, and --role disagg starts it as a child.
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels", "connectors"},
    "connectors": {"kernels", "engine"},
    "server": {"engine", "connectors", "kernels"},
    "router": {"server", "connectors"},
}


def disallowed(graph: dict[str, set[str]], part: str) -> list[str]:
    """'module -> dependency' for each import of `part`'s modules that ALLOWED forbids."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[1] == part
                  for d in deps if d.split(".")[1] not in ALLOWED[part] | {part})


@pytest.mark.parametrize("part", PARTS)
def test_imports_follow_the_data_flow(part):
    bad = disallowed(import_graph(), part)
    assert not bad, "\n".join(bad)


def test_router_starts_without_torch():
    """The router process (tandem.router.app, what `server --role router` runs) does not import
    torch (the engine's request types it shares are plain Python): a router is healthy in ~2 s
    instead of ~5.5 s on 2 cores."""
    import subprocess
    import sys
    code = "import sys, tandem.router.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing tandem.router.app imports torch"


def test_the_root_kernels_folder_does_not_shadow_hugging_face_kernels():
    """Run from the checkout's root (`python -m tandem.server` there, as the server's own children run), the root's
    kernels/ folder is on sys.path; transformers (5.25 and up) imports Hugging Face's `kernels` package by that name,
    so after tandem.engine's import finder `import kernels` is that package, and a transformers module that imports
    it loads (on our folder it raised ImportError). Where that package is not installed there is nothing to shadow."""
    import importlib.util
    import subprocess
    import sys
    spec = importlib.util.find_spec("kernels")
    if spec is None or Path(spec.origin or "").resolve().is_relative_to(ROOT):
        pytest.skip("Hugging Face's kernels package is not installed")
    code = ("import sys; sys.path.insert(0, '.'); import tandem.engine, kernels, transformers.activations; "
            "print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert not Path(out.stdout.strip()).resolve().is_relative_to(ROOT), out.stdout
