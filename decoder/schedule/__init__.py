"""The round scheduler (per round and row: which drafter, how many tokens) and the cost model it plans with.

    from decoder.schedule import CostModel, DraftPlan, Scheduler
"""

from ._cost import CostModel
from ._paths import NGRAM_PATHS, PATHS, PathChoice
from ._sched import ALTERNATIVES, Choice, DraftPlan, RowFix, Scheduler

__all__ = ["ALTERNATIVES", "Choice", "CostModel", "DraftPlan", "NGRAM_PATHS", "PATHS", "PathChoice", "RowFix",
           "Scheduler"]
