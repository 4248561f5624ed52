"""Full attention: nothing is ever dropped. The reference every other policy is measured against."""
from dataclasses import dataclass

from .base import FullPolicy
from .registry import register


@register
@dataclass(frozen=True)
class Full(FullPolicy):
    """No eviction: every query reads every earlier token (an infinite multi-state, TOVA Sec. 3.2)."""

    name = "full"
    summary = 'no eviction (the reference)'
    paper = ''
    color = "#444444"
