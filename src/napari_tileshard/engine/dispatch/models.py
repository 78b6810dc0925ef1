"""The adaptive dispatcher's predictors: the time of a shard write on one worker, learnt online.

:class:`RateModel` (exponentially weighted seconds per byte) is the one in use;
:class:`AffineModel` (overhead + bytes / bandwidth) was measured against it
(``benchmarks/bench_dispatch.py --predictors``) and does not pay.  :data:`PREDICTORS` is the
registry ``Dispatcher(predictor=...)`` picks from; a test may register its own.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["PREDICTORS", "AffineModel", "Predictor", "RateModel"]


class RateModel:
    """Online per-worker rate model: predicted seconds = nbytes x exponentially weighted seconds
    per byte (a fixed per-write cost folds into the rate; shards of one recording are of
    similar size)."""

    name = "rate"

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.samples = 0
        self._seconds_per_byte = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        rate = seconds / max(nbytes, 1)
        previous = self._seconds_per_byte if self.samples else rate
        self._seconds_per_byte = previous + self.alpha * (rate - previous)
        self.samples += 1

    def predict(self, nbytes: int) -> float:
        return self._seconds_per_byte * max(nbytes, 1)

    def predict_many(self, count: int, nbytes: int, units: int) -> float:
        """The predicted seconds of ``count`` writes of ``nbytes`` in all, ``units`` the sum of
        their ``max(nbytes, 1)``: the sum of :meth:`predict` over them, in O(1)."""
        return self._seconds_per_byte * units


class AffineModel:
    """A richer predictor: seconds = overhead + nbytes / bandwidth, fitted by exponentially
    forgetting least squares (falls back to the rate model while sizes do not vary)."""

    name = "affine"

    def __init__(self, forget: float = 0.9):
        self.forget = forget
        self.samples = 0
        self._sums = [0.0] * 5  # weight, x, y, xx, xy
        self._fallback = RateModel(1 - forget)

    def observe(self, nbytes: int, seconds: float) -> None:
        w, x, y, xx, xy = (s * self.forget for s in self._sums)
        self._sums = [w + 1, x + nbytes, y + seconds, xx + nbytes * nbytes, xy + nbytes * seconds]
        self._fallback.observe(nbytes, seconds)
        self.samples += 1

    def predict(self, nbytes: int) -> float:
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if spread <= 1e-9 * max(xx * w, 1.0):
            return self._fallback.predict(nbytes)
        slope = (w * xy - x * y) / spread
        overhead = (y - slope * x) / w
        if slope <= 0 or overhead < 0:
            return self._fallback.predict(nbytes)
        return overhead + slope * nbytes

    def predict_many(self, count: int, nbytes: int, units: int) -> float:
        """The sum of :meth:`predict` over ``count`` writes of ``nbytes`` in all (``units``: the
        sum of their ``max(nbytes, 1)``), in O(1)."""
        if not count:
            return 0.0
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if spread <= 1e-9 * max(xx * w, 1.0):
            return self._fallback.predict_many(count, nbytes, units)
        slope = (w * xy - x * y) / spread
        overhead = (y - slope * x) / w
        if slope <= 0 or overhead < 0:
            return self._fallback.predict_many(count, nbytes, units)
        return count * overhead + slope * nbytes


#: a worker's predictor (what ``PREDICTORS`` makes)
Predictor = RateModel | AffineModel

PREDICTORS: dict[str, Callable[[], Predictor]] = {"rate": RateModel, "affine": AffineModel}
