"""Timing shared by the benchmark scripts: the median wall time of a JAX call, warmed up first."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_time(fn: Callable[[], Any], runs: int) -> float:
    """Median seconds of `fn()` over `runs` calls, each waited for; one call first compiles and
    warms up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)
