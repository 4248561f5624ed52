"""The data flows one way: backend never imports the app, viz or Gradio; its packages import only the layers
below them (function-level imports included), without cycles, so every front end sits on top of one backend.

The layers, lowest first: policies and traces (the data), the engine (computes traces), runs (replays or
computes), analysis (reads traces, never the engine), experiments (grids of runs), and the front door with
the command line on top."""
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


# What each package of backend may import from backend (besides itself).
MAY_IMPORT = {
    "policies": set(),
    "traces": set(),
    "engine": {"policies", "traces"},
    "analysis": {"policies", "traces", "texts"},
    "experiments": {"policies", "traces", "engine", "analysis", "runs", "texts", "limits"},
}


def _part(module: str) -> str | None:
    """backend.engine.runner -> engine; backend.api -> api; backend -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "backend" and len(parts) > 1 else None


def test_each_package_imports_only_the_layers_below_it():
    for module, imports in backend_imports().items():
        own = _part(module)
        if own not in MAY_IMPORT:
            continue
        used = {_part(name) for name in imports if name.split(".")[0] == "backend"} - {own, None}
        assert used <= MAY_IMPORT[own], f"{module} imports {sorted(used - MAY_IMPORT[own])}"


def test_analysis_never_imports_the_engine_or_torch_models():
    for module, imports in backend_imports().items():
        if _part(module) == "analysis":
            assert not any(name.startswith(("backend.engine", "backend.runs", "transformers")) for name in imports), module


def test_backend_keeps_a_handful_of_top_level_modules():
    modules = sorted(p.stem for p in (ROOT / "backend").glob("*.py") if p.stem not in ("__init__", "__main__"))
    packages = sorted(p.name for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 8, modules
    assert set(packages) == {*MAY_IMPORT}, packages


MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "OrderedDict", "defaultdict", "deque", "Counter"}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def module_level_statements(body):
    """A module's statements outside functions: inside if/try/with/for blocks and class bodies too."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from module_level_statements(getattr(node, field, []))


def mutable_value(node) -> bool:
    if isinstance(node, MUTABLE_LITERALS):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def test_viz_holds_no_state_plain_data_in_figures_out():
    """The app owns state (the runs it shows, their memos, its locks): viz imports neither Gradio nor
    threading, and keeps no mutable container at module level that a view could fill."""
    paths = sorted((ROOT / "viz").rglob("*.py"))
    assert paths
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # function-level imports included
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in ("gradio", "threading"), f"{path.name} imports {name}"
        for node in module_level_statements(tree.body):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                assert not mutable_value(node.value), f"{path.name}:{node.lineno} keeps a mutable container"


def test_viz_modules_keep_no_mutable_container_once_imported():
    """What the source check cannot see: a module-level value built by a helper (say, a dict of colours)."""
    import collections
    import importlib

    for path in sorted((ROOT / "viz").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            if not (key.startswith("__") and key.endswith("__")):  # __builtins__, __annotations__
                assert not isinstance(value, (dict, list, set, bytearray, collections.deque)), f"{name}.{key}"


def test_the_notebook_api_is_a_front_end_on_the_front_door():
    """kvlens.py (``import kvlens`` in a notebook) sits beside app.py: it runs requests through backend.api and
    draws with viz, and reaches neither what computes (the engine, runs, experiments) nor Gradio."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / "kvlens.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    assert "backend.api" in found
    computes = ("backend.engine", "backend.runs", "backend.experiments", "gradio")
    assert not [name for name in found if name.startswith(computes)], found
