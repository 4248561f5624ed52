"""The one set of limits every front end (app, CLI, sweep) enforces, so a public Space stays responsive.

Defaults fit a 2-vCPU Space: one run of the default model at the limits takes about half a minute and
under 2 GB. An operator may change any limit with an environment variable ``KVLENS_MAX_<FIELD>``
(e.g. ``KVLENS_MAX_ROW_TOKENS=40000`` for long sweeps on a workstation); visitors cannot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Limits:
    prompt_tokens: int = 1024  # tokens of the text (chat template included)
    text_chars: int = 32 * 1024  # characters, checked before tokenizing (no token is that short on average)
    new_tokens: int = 256  # generate mode
    policies: int = 8  # policies side by side in one run
    row_tokens: int = 5 * 1024  # one run: policies x (text tokens + new tokens)
    sweep_row_tokens: int = 16 * 1024  # one sweep: (policy, budget) pairs x (text tokens + new tokens)

    @classmethod
    def from_env(cls, environ=os.environ) -> "Limits":
        """Defaults, with ``KVLENS_MAX_<FIELD>`` overrides; ValueError names a malformed one."""
        changes = {}
        for field in fields(cls):
            name = f"KVLENS_MAX_{field.name.upper()}"
            text = environ.get(name)
            if text is None:
                continue
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"{name}={text!r} must be a positive integer")
            changes[field.name] = int(text)
        return replace(cls(), **changes)
