"""Every policy, by name, and parsing of specs like ``tova:budget=64,heads=head``."""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, fields

from .a2sf import A2SF
from .base import EvictionPolicy, FullPolicy, Policy, SelectionPolicy
from .full import Full
from .h2o import H2O
from .oracle import Oracle
from .reattention import ReAttention
from .sinks import Sinks
from .sparq import SparQ
from .tova import TOVA
from .window import Window

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Window, Sinks, H2O, TOVA, A2SF, Oracle, SparQ, ReAttention)}


class SpecError(ValueError):
    """A policy spec the user typed is not valid; the message says why in one line."""


# Plain decimal forms only: Python's int() and float() also take "1_0", "nan", "inf" and full-width digits.
_INT = re.compile(r"[+-]?[0-9]{1,9}")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")


def _convert(policy: str, key: str, raw: str, typ):
    """Typed value of a parameter (field types are ints, floats or strings)."""
    typ = getattr(typ, "__name__", typ)
    if typ == "int":
        if not _INT.fullmatch(raw):
            raise SpecError(f"{policy}: parameter {key} must be an integer of at most 9 digits, got {raw!r}")
        return int(raw)
    if typ == "float":
        if not _FLOAT.fullmatch(raw) or not math.isfinite(float(raw)):
            raise SpecError(f"{policy}: parameter {key} must be a decimal number, got {raw!r}")
        return float(raw)
    return raw


def parse_spec(spec: str) -> Policy:
    """``name[:key=value,...]`` -> a policy instance, or SpecError with a one-line reason."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise SpecError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError(f"{name}: expected key=value, got {item!r}")
        if key not in known:
            allowed = ", ".join(known) or "none"
            raise SpecError(f"{name}: unknown parameter {key!r} (parameters: {allowed})")
        if key in kwargs:
            raise SpecError(f"{name}: parameter {key} is given twice")
        kwargs[key] = _convert(name, key, raw.strip(), known[key].type)
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise SpecError(str(err)) from None


def describe() -> str:
    """One line per policy with its parameters and defaults (for --help and the docs)."""
    lines = []
    for name, cls in POLICIES.items():
        params = ", ".join(
            f"{f.name}={f.default}" for f in fields(cls) if f.default is not MISSING
        ) or "no parameters"
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"  {name:<8} {params}\n           {summary}")
    return "\n".join(lines)


__all__ = ["POLICIES", "Policy", "EvictionPolicy", "SelectionPolicy", "FullPolicy", "SpecError", "parse_spec",
           "describe", *(cls.__name__ for cls in POLICIES.values())]
