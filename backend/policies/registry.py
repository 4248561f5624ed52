"""The registry: every policy by name, the single source the parser, the CLI, the app, the docs and the
tests read. A policy class joins it with ``@register``; a server operator adds policies without editing
the package by naming modules in ``KVLENS_PLUGINS`` (imported at start-up by the app and the CLI; nothing
a visitor types ever imports code).
"""
from __future__ import annotations

import importlib
import os
import re

POLICIES: dict = {}  # name -> policy class, in registration order (the order lists and tables show)
PLUGINS_ENV = "KVLENS_PLUGINS"


class PluginError(RuntimeError):
    """A plugin named by the operator cannot be loaded; the message says which and why, in one line."""


def register(cls):
    """Class decorator: add a policy class to the registry under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"{cls.__name__}: a policy needs a lowercase name of letters, digits and _, got {name!r}")
    if name in POLICIES and POLICIES[name].__qualname__ != cls.__qualname__:
        raise ValueError(f"policy name {name!r} is taken by {POLICIES[name].__module__}.{POLICIES[name].__qualname__}")
    POLICIES[name] = cls
    return cls


def load_plugins(names: str | None = None) -> list[str]:
    """Import the comma-separated modules of ``names`` (default ``$KVLENS_PLUGINS``); their ``@register``
    classes join the registry. Returns the modules imported; PluginError names one that fails."""
    text = os.environ.get(PLUGINS_ENV, "") if names is None else names
    modules = [m.strip() for m in text.split(",") if m.strip()]
    for module in modules:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module):
            raise PluginError(f"{PLUGINS_ENV}: {module!r} is not a module name")
        try:
            importlib.import_module(module)
        except Exception as err:  # the operator's module: say which one failed, and why
            raise PluginError(f"{PLUGINS_ENV}: could not import {module}: {type(err).__name__}: {err}") from None
    return modules
