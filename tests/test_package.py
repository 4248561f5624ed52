"""KV Lens as an installed package (pyproject.toml): the ``kvlens`` command is ``python -m backend`` under another
name, ``import kvlens`` works from any folder without importing lm-eval and still gives lm-eval its ``kvlens``
model, a wheel carries the packages and the assets they read, and the pins CI runs satisfy what the package
declares. The command and the import from another folder need the package installed, as ``make`` installs it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def subcommands(help_text: str) -> list[str]:
    """The subcommands argparse lists in a usage line: ``{run,sweep,...}``."""
    found = re.search(r"\{([a-z,-]+)\}", help_text)
    assert found, help_text
    return found.group(1).split(",")


def test_the_kvlens_command_has_the_subcommands_of_python_m_backend(monkeypatch, capsys):
    module, _, name = PROJECT["scripts"]["kvlens"].partition(":")
    entry = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(sys, "argv", ["kvlens", "--help"])  # what pip's script wrapper hands it
    with pytest.raises(SystemExit) as done:
        entry()
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: kvlens ")
    module_help = subprocess.run([sys.executable, "-m", "backend", "--help"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
    assert module_help.returncode == 0 and module_help.stdout.startswith("usage: python -m backend ")
    assert subcommands(shown) == subcommands(module_help.stdout)
    assert {"run", "sweep", "needle", "tasks", "evidence", "policies", "lm-eval"} <= set(subcommands(shown))


def test_the_installed_kvlens_command_runs_from_any_folder(tmp_path):
    script = Path(sys.executable).parent / "kvlens"
    if not script.exists():
        if os.environ.get("CI"):
            pytest.fail("the kvlens command is not installed (make installs the package into .venv)")
        pytest.skip("KV Lens is not installed in this environment: pip install -e . (make does)")
    result = subprocess.run([str(script), "policies"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| tova |" in result.stdout.replace("`", "")


def python_in(folder: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300)


def test_import_kvlens_leaves_lm_eval_unimported_and_lm_eval_then_finds_kvlens(tmp_path):
    """From another folder, as a notebook imports it: lm-eval loads only when the program imports it, and then
    its registry resolves ``kvlens`` to the model class, beside its own models."""
    result = python_in(tmp_path, (
        "import sys\n"
        "import kvlens\n"
        "assert 'lm_eval' not in sys.modules, 'import kvlens imported lm-eval'\n"
        "assert not any(m.startswith('backend.experiments.lm_eval_model') for m in sys.modules)\n"
        "import lm_eval\n"
        "model = lm_eval.api.registry.get_model('kvlens')\n"
        "print(model.__module__, model.__name__, lm_eval.api.registry.get_model('dummy').__name__)\n"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["backend.experiments.lm_eval_model", "KVLensLM", "DummyLM"]


def test_lm_eval_imported_before_kvlens_finds_kvlens_too(tmp_path):
    result = python_in(tmp_path, (
        "from lm_eval.api.registry import get_model\n"
        "import kvlens\n"
        "print(get_model('kvlens').__name__)\n"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["KVLensLM"]


def test_a_wheel_carries_the_packages_and_the_assets_they_read(tmp_path):
    """What ``pip install .`` installs: kvlens.py, backend, viz and kernels, and assets/ beside them (the code finds
    it from its own files), but not the app, the tests or the benchmarks."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "kvlens.py"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("backend", "viz", "kernels", "assets"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    # This environment's setuptools where it has one, else pip fetches the one pyproject.toml asks for.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kvlens-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(path.relative_to(ROOT)) for path in (ROOT / "assets").rglob("*") if path.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    modules = {str(path.relative_to(ROOT)) for folder in ("backend", "viz", "kernels")
               for path in (ROOT / folder).rglob("*.py")}
    assert "kvlens.py" in names and modules <= names, sorted(modules - names)[:5]
    assert not any(name.split("/")[0] in ("tests", "benchmarks", "docs") or name == "app.py" for name in names)
    metadata = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "kvlens = backend.__main__:main" in zipfile.ZipFile(wheel).read(metadata).decode()


def requirements(path: Path) -> dict[str, Requirement]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            found[requirement.name.lower()] = requirement
    return found


def test_the_pins_ci_runs_satisfy_what_the_package_declares():
    """requirements.txt pins what the app, CI and the Dockerfile install; each dependency the package declares,
    extras included, is pinned there, at a version the declaration allows."""
    pinned = requirements(ROOT / "requirements.txt")
    declared = [Requirement(text) for text in PROJECT["dependencies"]]
    declared += [Requirement(text) for extra, texts in PROJECT["optional-dependencies"].items() if extra != "all"
                 for text in texts]
    assert len(declared) > 10
    for requirement in declared:
        pin = pinned.get(requirement.name.lower())
        assert pin is not None, f"{requirement.name} is declared but not pinned in requirements.txt"
        exact = [spec.version for spec in pin.specifier if spec.operator == "=="]
        if exact:
            assert requirement.specifier.contains(exact[0]), f"{pin} does not satisfy {requirement}"
        else:  # a floor, the same in both
            assert requirement.specifier == pin.specifier, f"{pin} and {requirement} differ"
        assert requirement.extras <= pin.extras, f"{pin} lacks the extras of {requirement}"
    assert {name for name in pinned} == {r.name.lower() for r in declared}, "requirements.txt pins an undeclared package"
