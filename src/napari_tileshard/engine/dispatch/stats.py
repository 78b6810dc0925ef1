"""The dispatcher's telemetry (the data plane): per-worker figures and the totals of a run."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["COUNTERS", "DispatchStats", "WorkerStats", "quantile"]

#: the dispatcher's counters, shared by its core and its strategy (``DispatchState.counts``)
COUNTERS = (
    "shards",
    "bytes",
    "moves",
    "steals",
    "hedges",
    "hedge_wins",
    "retries",
    "duplicate_bytes",
    "fallback_rounds",
    "replaced",
    "dropped",
    "timeouts",
)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted), 0 when empty: the lowest value with at least
    that share of the values at or below it."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class WorkerStats:
    """Telemetry of one worker (the data plane)."""

    worker: int
    shards: int = 0  # writes that succeeded (duplicates included)
    bytes: int = 0
    busy_s: float = 0.0
    errors: int = 0
    duplicates: int = 0  # hedged copies this worker wrote
    retired: bool = False  # replaced for being far slower than the others
    latencies: deque = field(default_factory=lambda: deque(maxlen=1024), repr=False)

    def as_dict(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "worker": self.worker,
            "shards": self.shards,
            "bytes": self.bytes,
            "busy_s": round(self.busy_s, 6),
            "errors": self.errors,
            "duplicates": self.duplicates,
            "retired": self.retired,
            "throughput_mbps": round(self.bytes / self.busy_s / 1e6, 3) if self.busy_s else 0.0,
            "p50_s": round(quantile(lat, 0.5), 6),
            "p95_s": round(quantile(lat, 0.95), 6),
        }


@dataclass
class DispatchStats:
    mode: str
    workers: list[dict]
    shards: int
    bytes: int
    moves: int
    steals: int
    hedges: int
    hedge_wins: int
    duplicate_bytes: int
    retries: int
    rounds: int
    fallback_rounds: int
    replaced: int  # workers retired and replaced
    latencies_s: list[float] = field(repr=False)  # per shard: first start -> first success
    dropped: int = 0  # queued writes dropped after a failure (they could never be published)
    timeouts: int = 0  # writes failed by the io_timeout watchdog

    @property
    def straggler_gap_s(self) -> float:
        busy = [w["busy_s"] for w in self.workers]
        return max(busy) - min(busy) if busy else 0.0
