"""Percentiles without numpy: nearest-rank on the sorted sample."""

from __future__ import annotations

import math
from collections.abc import Sequence

QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "p99.9": 0.999, "max": 1.0}


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max of `values` (empty dict for no values), rounded to 0.1."""
    if not values:
        return {}
    ordered = sorted(values)
    found = {}
    for name, q in QUANTILES.items():
        rank = max(1, math.ceil(q * len(ordered)))
        found[name] = round(ordered[rank - 1], 1)
    found["count"] = len(ordered)
    return found
