"""StreamingLLM / Window+i: attention sinks plus a recent window (Xiao et al., 2023; TOVA Sec. 3.3)."""
from dataclasses import dataclass

from .base import RunningScore
from .window import Window
from .registry import register


@register
@dataclass(frozen=True)
class Sinks(Window):
    """The first ``sinks`` tokens are kept for good; the rest of the budget is a FIFO window.

    budget: tokens each query reads, its own included.
    sinks: how many initial tokens (attention sinks) are never dropped; must be < budget.
    """

    name = "sinks"
    summary = 'first `sinks` tokens + recent window ("Window+i", StreamingLLM)'
    paper = 'Xiao et al., 2023; TOVA Sec. 3.3'
    color = "#56B4E9"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"sinks: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")

    @classmethod
    def for_budget(cls, budget: int) -> "Sinks":
        return cls(budget=budget, sinks=min(4, budget - 1))

    def protected(self, t):
        return slice(0, self.sinks)

    def running_score(self):
        return RunningScore(by_position=True, sinks=self.sinks)
