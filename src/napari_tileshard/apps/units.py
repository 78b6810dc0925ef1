"""How the command line and the widgets write amounts: byte sizes and counts of things.

Amounts of data (what was recorded, read, converted) are in decimal units, as the GB/s beside them:
``data_size(8_388_608)`` is ``"8.39 MB"``.  Memory (budgets, buffers, tile and shard sizes, which
are powers of two) is in binary units: ``memory_size(8 << 20)`` is ``"8.0 MiB"``.  Either picks the
unit that keeps the number readable, so a small recording never reads "(0.00 GB)".
"""

from __future__ import annotations

__all__ = ["data_size", "duration", "memory_size", "plural"]

_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def data_size(nbytes: float) -> str:
    """``nbytes`` in B, kB, MB, GB, ... (powers of 1000), three significant figures from kB on."""
    value, unit = _scaled(nbytes, 1000, _DECIMAL)
    if unit == "B":
        return f"{value:.0f} B"
    if float(f"{value:.3g}") >= 1000 and unit != _DECIMAL[-1]:  # 999.7 MB reads 1.00 GB, not 1000 MB
        value, unit = value / 1000, _DECIMAL[_DECIMAL.index(unit) + 1]
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{decimals}f} {unit}"


def memory_size(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB, GiB, ... (powers of 1024), one decimal from KiB on."""
    value, unit = _scaled(nbytes, 1024, _BINARY)
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def duration(seconds: float) -> str:
    """``seconds`` as a person reads them: ``"4.70 ms"`` under a second (never ``"0.00 s"``),
    ``"12.35 s"`` from there on."""
    if seconds < 1:
        ms = seconds * 1000
        return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
    return f"{seconds:.2f} s"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``"1 shard"``, ``"16 shards"`` (``nouns``: the plural where it is not ``noun + "s"``)."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def _scaled(nbytes: float, base: int, units: tuple[str, ...]) -> tuple[float, str]:
    value = float(nbytes)
    for unit in units[:-1]:
        if abs(value) < base:
            return value, unit
        value /= base
    return value, units[-1]
