"""The operator's settings: every ``KVLENS_*`` environment variable, checked once at start-up by the app and
the CLI, so a malformed one stops the start with one line naming it (never a traceback later, mid-request).
"""
from __future__ import annotations

import os

RUNS_PER_ADDRESS = "KVLENS_RUNS_PER_ADDRESS"
# Variables read elsewhere that take any value: paths (an unusable store runs uncached), and a test switch.
FREE_FORM = ("KVLENS_STORE_DIR", "KVLENS_MODEL_CACHE", "KVLENS_UPDATE_SCREENSHOT")


class SettingError(ValueError):
    """A ``KVLENS_*`` variable is malformed or unknown; the message (one line) names it."""


def _positive_int(environ, name: str, default: int) -> int:
    text = environ.get(name)
    if text is None:
        return default
    if not text.strip().isdigit() or int(text) < 1:
        raise SettingError(f"{name}={text!r} must be a positive integer")
    return int(text)


def runs_per_address(environ=os.environ) -> int:
    """Model jobs one client address may have waiting or running (``KVLENS_RUNS_PER_ADDRESS``, default 4)."""
    return _positive_int(environ, RUNS_PER_ADDRESS, 4)


def check_environment(environ=os.environ) -> None:
    """Check every ``KVLENS_*`` variable and import the operator's plugins (``KVLENS_PLUGINS``); SettingError
    names the first that is malformed or unknown."""
    from .limits import MODELS_ENV, Limits
    from .policies import PluginError, load_plugins
    from .traces.store import ENV_MB, size_limit_from_env

    known = {*Limits.settings(), *FREE_FORM, MODELS_ENV, RUNS_PER_ADDRESS, ENV_MB, "KVLENS_PLUGINS", "KVLENS_MMAP_THRESHOLD"}
    for name in sorted(n for n in environ if n.startswith("KVLENS_")):
        if name not in known:
            raise SettingError(f"{name} is not a KV Lens setting; known: {', '.join(sorted(known))}")
    try:
        Limits.from_env(environ)
        size_limit_from_env(environ)
    except ValueError as err:
        raise SettingError(str(err)) from None
    runs_per_address(environ)
    threshold = environ.get("KVLENS_MMAP_THRESHOLD", "").strip()
    if threshold and not threshold.isdigit():
        raise SettingError(f"KVLENS_MMAP_THRESHOLD={threshold!r} must be a number of bytes (0 keeps glibc's)")
    try:
        load_plugins(environ.get("KVLENS_PLUGINS", ""))
    except PluginError as err:
        raise SettingError(str(err).splitlines()[0] if str(err) else "KVLENS_PLUGINS: cannot be loaded") from None
