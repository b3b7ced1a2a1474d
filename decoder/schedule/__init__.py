"""The round scheduler (per round and row: which drafter, how many tokens) and the cost model it plans with.

    from decoder.schedule import CostModel, DraftPlan, Scheduler
"""

from ._cost import CostModel, PathChoice
from ._sched import DraftPlan, Scheduler

__all__ = ["CostModel", "DraftPlan", "PathChoice", "Scheduler"]
