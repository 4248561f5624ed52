"""``kvlens`` in lm-evaluation-harness's model registry from the moment lm-eval is imported, without importing it.

lm-eval (0.4.13) looks models up only in its own registry (``lm_eval.api.registry``) and discovers no third-party
ones: no entry points, no imports of its own. ``register_on_lm_eval_import`` (what ``import kvlens`` calls) puts
the name there as lm-eval's lazy placeholder, ``module:Class``, so ``lm_eval.simple_evaluate(model="kvlens")``
and ``lm_eval.api.registry.get_model("kvlens")`` work, and the model's module (``lm_eval_model``, which imports
lm-eval's model stack) loads only when lm-eval looks the name up. Where lm-eval is imported already the name
goes in at once; otherwise a finder on ``sys.meta_path`` waits for ``import lm_eval`` and puts it in as lm-eval
finishes loading, so a program that never imports lm-eval pays nothing and needs no lm-eval installed.
"""
from __future__ import annotations

import importlib.abc
import sys
import warnings

NAME = "kvlens"
TARGET = "backend.experiments.lm_eval_model:KVLensLM"  # the class @register_model("kvlens") registers


def register() -> None:
    """``kvlens`` in lm-eval's model registry as a lazy placeholder (lm-eval imported here, if it was not)."""
    # lm-eval's own models go in first: get_model imports them only while the registry is empty, and ``kvlens``
    # alone in it would hide them.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _AfterLmEval(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``lm_eval`` it hands on the spec the other finders give, with a loader that
    registers ``kvlens`` once lm-eval's package has run, then steps off the path."""

    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_package = loader.exec_module

        def exec_then_register(module):
            run_package(module)
            _leave(self)
            try:
                register()
            except Exception as err:  # an lm-eval whose registry differs: lm-eval itself still imports
                warnings.warn(f"KV Lens could not register its lm-eval model {NAME!r}: {err}", stacklevel=2)

        loader.exec_module = exec_then_register  # this spec's own loader: lm-eval's later imports are untouched
        return spec


def _leave(finder: _AfterLmEval) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def register_on_lm_eval_import() -> None:
    """``kvlens`` in lm-eval's registry now if lm-eval is imported, else as soon as it is (see the module's
    docstring); lm-eval not installed, nothing happens."""
    if "lm_eval" in sys.modules:
        register()
    elif not any(isinstance(finder, _AfterLmEval) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLmEval())
