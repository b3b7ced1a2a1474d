"""Statistics the benchmarks share."""

from __future__ import annotations

import torch


def bootstrap_median(values: list[float], n: int = 2000) -> tuple[float, float]:
    """A 90 % bootstrap interval of the median of `values` (e.g. each round's own slowdown): how far a run pins
    the median down."""
    g = torch.Generator().manual_seed(0)
    v = torch.tensor(values)
    meds = v[torch.randint(len(v), (n, len(v)), generator=g)].median(dim=1).values.sort().values
    return float(meds[int(0.05 * n)]), float(meds[int(0.95 * n) - 1])
