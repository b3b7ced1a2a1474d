"""The speculative decoder: a call, its rounds, its trees and plain paths; the oracle bound and plots of a run.

    from decoder.loop import SpeculativeDecoder, oracle_bound
"""

from ._decoder import AUTO_K, FIXED_K, SpeculativeDecoder
from ._oracle import OracleResult, oracle_bound, simulated_seconds
from ._plot import plot_stats
from ._stats import SpecOutput, SpecStats

__all__ = ["AUTO_K", "FIXED_K", "OracleResult", "oracle_bound", "plot_stats", "simulated_seconds", "SpecOutput",
           "SpecStats", "SpeculativeDecoder"]
