"""The data flows one way: backend never imports the app, viz or Gradio, and backend modules import each
other without cycles (function-level imports included), so every front end sits on top of one backend."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def backend_imports() -> dict[str, set[str]]:
    """Module name -> every module it imports anywhere in its file (relative imports resolved)."""
    graph = {}
    for path in sorted((ROOT / "backend").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
                found.add(module)
                found |= {f"{module}.{alias.name}" for alias in node.names}
        graph[name] = found
    return graph


def test_backend_never_imports_the_app_viz_or_gradio_except_the_cli_figure():
    for module, imports in backend_imports().items():
        roots = {name.split(".")[0] for name in imports}
        allowed_viz = module == "backend.cli"  # the CLI is a front end like app.py: it writes sweep.html
        assert "gradio" not in roots and "app" not in roots, module
        assert "viz" not in roots or allowed_viz, module


def test_backend_modules_import_each_other_without_cycles():
    graph = backend_imports()
    edges = {m: {i for i in imports if i in graph and i != m} for m, imports in graph.items()}
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for other in edges[module]:
            assert state.get(other) != "open", " -> ".join([*path, module, other])
            if other not in state:
                visit(other, [*path, module])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])
