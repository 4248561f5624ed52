"""One colour per policy, the same in every figure and HTML view.

A policy's colour comes from its *family* (the registry name before ``:`` in a spec, e.g. ``tova``
in ``tova:budget=64``), so TOVA is blue whether or not Full or H2O share the figure. When one family
appears several times in ``names`` (two TOVA budgets, say), the later ones get lighter/darker shades
of the family colour, in the order given. Names of no known family take the extra palette in order.
The app should call ``policy_colors`` once on every policy it shows and pass the mapping to each
figure (``colors=``); figures called without it compute the same mapping from their own names.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

EXTRA_COLORS = ("#44AA99", "#332288", "#AA4499", "#117733", "#DDCC77", "#6699CC", "#661100", "#888888")


def family_colors() -> dict[str, str]:
    """Each registered policy's colour (the registry is the source): its own ``color`` (colour-blind-friendly
    Okabe-Ito and Tol-like hues for the built-ins), else the next extra colour no policy uses yet."""
    from backend.policies import POLICIES

    out = {name: cls.color for name, cls in POLICIES.items() if cls.color}
    free = [c for c in EXTRA_COLORS if c not in out.values()] or list(EXTRA_COLORS)
    for i, name in enumerate(n for n in POLICIES if n not in out):
        out[name] = free[i % len(free)]
    return out


# The built-ins; policy_colors asks the registry again (plugins).
FAMILY_COLORS: Mapping[str, str] = MappingProxyType(family_colors())
# Other names the papers use for the same family (``streamingllm`` is a policy of its own: re-rotated sinks).
ALIASES = MappingProxyType({"a2s": "h2o", "ideal": "oracle"})
# Shade steps for the 2nd, 3rd, ... policy of one family: > 0 mixes with white, < 0 with black.
SHADES = (0.0, 0.4, -0.35, 0.65, -0.55, 0.2, -0.2)

# Colours of cache states, shared by the heatmaps and the text highlight.
KEPT_COLOR = "#2B5C8A"
EVICTED_COLOR = "#F2C9C2"
HIGHLIGHT_RGB = (255, 190, 30)  # text highlighter for tokens still cached


def family(name: str) -> str:
    """``'tova:budget=64'`` -> ``'tova'``; ``'A2SF (alpha=0.3)'`` -> ``'a2sf'``; ``'Full'`` -> ``'full'``."""
    head = name.strip().lower().split(":", 1)[0]
    match = re.match(r"[a-z0-9_]+", head)
    fam = match.group(0) if match else head
    return ALIASES.get(fam, fam)


def shade(hex_color: str, amount: float) -> str:
    """Mix ``hex_color`` with white (amount > 0) or black (amount < 0); ``amount`` in [-1, 1]."""
    rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    target = 255 if amount > 0 else 0
    mixed = [round(c + (target - c) * abs(amount)) for c in rgb]
    return "#" + "".join(f"{c:02X}" for c in mixed)


def policy_colors(names: Iterable[str]) -> dict[str, str]:
    """Map each name to a hex colour: family hue, shaded for repeats of a family, extras for unknowns."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    extra = 0
    families = family_colors()
    for name in names:
        if name in out:
            continue
        fam = family(name)
        if fam not in families:
            out[name] = EXTRA_COLORS[extra % len(EXTRA_COLORS)]
            extra += 1
            continue
        rank = seen.get(fam, 0)
        seen[fam] = rank + 1
        base = families[fam]
        out[name] = shade(base, SHADES[rank % len(SHADES)]) if rank else base
    return out


def rgba(hex_color: str, alpha: float) -> str:
    """``'#RRGGBB'`` + alpha -> ``'rgba(r,g,b,a)'`` (for fills and highlights)."""
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha:.3g})"
