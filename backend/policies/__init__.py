"""Every policy, by name (``registry.py``), and parsing of specs like ``tova:budget=64,heads=head``.

Specs are parsed at the edges (CLI, app, sweep) into policy objects; a policy prints its own spec
(``Policy.spec``). Importing this package registers the built-in policies, in the order lists show them.
"""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, fields

from .base import (CacheView, CompressionPolicy, EvictionPolicy, FullPolicy, Policy, Reform, SelectionPolicy,
                   ratio_budget)
from .registry import POLICIES, PluginError, load_plugins, register
# Registration order = the order the app, the CLI and the docs list them.
from .full import Full  # noqa: E402,I001
from .window import Window  # noqa: E402
from .sinks import Sinks  # noqa: E402
from .h2o import H2O  # noqa: E402
from .tova import TOVA  # noqa: E402
from .a2sf import A2SF  # noqa: E402
from .oracle import Oracle  # noqa: E402
from .sparq import SparQ  # noqa: E402
from .reattention import ReAttention  # noqa: E402
from .snapkv import SnapKV  # noqa: E402
from .pyramidkv import PyramidKV  # noqa: E402
from .adakv import AdaKV  # noqa: E402
from .knorm import Knorm  # noqa: E402
from .keydiff import KeyDiff  # noqa: E402
from .chunkkv import ChunkKV  # noqa: E402
from .lagkv import LagKV  # noqa: E402
from .cur import CUR  # noqa: E402
from .compactor import Compactor  # noqa: E402
from .leverage import Leverage  # noqa: E402
from .simlayerkv import SimLayerKV  # noqa: E402
from .criticalkv import CriticalKV  # noqa: E402
from .finch import FINCH  # noqa: E402
from .scissorhands import Scissorhands  # noqa: E402
from .keyformer import Keyformer  # noqa: E402
from .kvzip import KVzip  # noqa: E402
from .random_eviction import Random  # noqa: E402
from .quest import Quest  # noqa: E402
from .streamingllm import StreamingLLM  # noqa: E402
from .expected_attention import ExpectedAttention  # noqa: E402
from .rkv import RKV  # noqa: E402
from .think import ThinK  # noqa: E402
from .cam import CaM  # noqa: E402
from .merging import Merging  # noqa: E402
from .kivi import KIVI  # noqa: E402
from .gear import GEAR  # noqa: E402


class SpecError(ValueError):
    """A policy spec the user typed is not valid; the message says why in one line."""


# Plain decimal forms only: Python's int() and float() also take "1_0", "nan", "inf" and full-width digits.
_INT = re.compile(r"[+-]?[0-9]{1,9}")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")


def _convert(policy: str, key: str, raw: str, typ):
    """Typed value of a parameter (field types are ints, floats, booleans or strings)."""
    typ = getattr(typ, "__name__", typ)
    if typ == "bool":
        if raw.lower() not in ("true", "false"):
            raise SpecError(f"{policy}: parameter {key} must be true or false, got {raw!r}")
        return raw.lower() == "true"
    if typ == "int":
        if not _INT.fullmatch(raw):
            raise SpecError(f"{policy}: parameter {key} must be an integer of at most 9 digits, got {raw!r}")
        return int(raw)
    if typ == "float":
        if not _FLOAT.fullmatch(raw) or not math.isfinite(float(raw)):
            raise SpecError(f"{policy}: parameter {key} must be a decimal number, got {raw!r}")
        return float(raw)
    return raw


# Before the text is read a ratio stands for its budget on a context this long, so that specs can be checked
# and told apart (two ratios are two policies) before the context is known.
NOMINAL_CONTEXT = 1 << 20


def parse_spec(spec: str, context: int | None = None) -> Policy:
    """``name[:key=value,...]`` -> a policy instance, or SpecError with a one-line reason.

    ``preset=NAME`` takes a named set of parameters the policy offers (``Policy.presets``, e.g. kvpress's
    settings); parameters given beside it override the set's. ``ratio=R`` (0 <= R < 1) instead of ``budget``
    is a compression ratio: the budget is ``ratio_budget(R, context)``, ``context`` being the tokens the
    policy compresses (the prompt in generate mode, the text in prompt mode; ``NOMINAL_CONTEXT`` until they
    are known), with the other parameters the policy's own for that budget (``for_budget``); a policy that
    compresses otherwise takes the ratio its own way (``for_ratio``: KIVI's bits)."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise SpecError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    known = {f.name: f for f in fields(cls)}
    kwargs, preset, ratio = {}, None, None
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError(f"{name}: expected key=value, got {item!r}")
        if key == "budget" and _takes_no_budget(cls):
            raise SpecError(_no_budget_message(name, cls))
        if key == "ratio" and "budget" in known:
            if ratio is not None or "budget" in kwargs:
                raise SpecError(f"{name}: give one ratio or one budget, not both")
            ratio = _convert(name, key, raw.strip(), "float")
            if not 0.0 <= ratio < 1.0:
                raise SpecError(f"{name}: ratio must be at least 0 and below 1 (the share of the context removed), "
                                f"got {raw.strip()}")
            continue
        if key == "preset" and "preset" not in known:
            if preset is not None or raw.strip() not in cls.presets:
                offered = ", ".join(cls.presets) or "none"
                raise SpecError(f"{name}: preset must be given once and be one of: {offered}; got {raw.strip()!r}")
            preset = raw.strip()
            continue
        if key not in known:
            allowed = ", ".join(known) or "none"
            raise SpecError(f"{name}: unknown parameter {key!r} (parameters: {allowed})")
        if key in kwargs or (key == "budget" and ratio is not None):
            raise SpecError(f"{name}: parameter {key} is given twice" if key in kwargs
                            else f"{name}: give one ratio or one budget, not both")
        kwargs[key] = _convert(name, key, raw.strip(), known[key].type)
    try:
        base = {} if ratio is None else cls.for_ratio(ratio, context or NOMINAL_CONTEXT).params()
        return cls(**{**base, **cls.presets.get(preset, {}), **kwargs})
    except ValueError as err:
        raise SpecError(str(err)) from None


def _takes_no_budget(cls) -> bool:
    """Does the policy hold every token, so that no budget applies (its declared budget is None: Full, KIVI)?"""
    known = {f.name: f for f in fields(cls)}
    return (known["budget"].default if "budget" in known else cls.budget) is None


def _no_budget_message(name: str, cls) -> str:
    """Why a budget given to a policy without one is refused, and what the policy takes instead."""
    params = [f.name for f in fields(cls)]
    # A budget field, though None, lets a ratio stand in for the budget (``for_ratio``: KIVI's bits); Full has none.
    takes = [p for p in params if p != "budget"] + (["ratio"] if "budget" in params else [])
    offered = f"its parameters: {', '.join(takes)}" if takes else "it takes no parameters"
    return f"{name}: {cls.__name__} holds every token and takes no budget ({offered})"


def policy_of(meta: dict) -> Policy | None:
    """The policy a trace's metadata names (None when it is no longer registered, e.g. a plugin's)."""
    cls = POLICIES.get(meta.get("policy"))
    try:
        return cls(**meta.get("params", {})) if cls else None
    except (TypeError, ValueError):
        return None


def policy_table() -> str:
    """The policy table of docs/policies.md (Markdown), generated from the registry; a test keeps the page in step."""
    lines = ["| name | policy | paper |", "|---|---|---|"]
    lines += [f"| `{name}` | {cls.summary} | {cls.paper} |" for name, cls in POLICIES.items()]
    return "\n".join(lines)


def describe() -> str:
    """One line per policy with its parameters and defaults (for --help and the docs)."""
    lines = []
    for name, cls in POLICIES.items():
        params = ", ".join(
            f"{f.name}={f.default}" for f in fields(cls) if f.default is not MISSING
        ) or "no parameters"
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        presets = "".join(f"\n           preset={key}: " + ", ".join(f"{k}={v}" for k, v in values.items())
                          for key, values in cls.presets.items())
        lines.append(f"  {name:<8} {params}\n           {summary}{presets}")
    return "\n".join(lines)


__all__ = ["POLICIES", "Policy", "EvictionPolicy", "SelectionPolicy", "FullPolicy", "SpecError", "parse_spec",
           "ratio_budget",
           "describe", "policy_table", "policy_of", "register", "load_plugins", "PluginError",
           "Full", "Window", "Sinks", "H2O", "TOVA", "A2SF", "Oracle", "SparQ", "ReAttention", "SnapKV", "PyramidKV", "AdaKV",
           "Knorm", "CompressionPolicy", "CacheView", "Reform", "ThinK", "CaM", "Merging", "KIVI", "GEAR"]
