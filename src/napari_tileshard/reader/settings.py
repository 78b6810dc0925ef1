"""The reader's ``TILESHARD_*`` environment settings, each validated where it is read.

An argument given to the reader wins over the environment; a malformed value is an error naming
the variable and the value, never silently the default.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_MAX_READ_BYTES",
    "batch_bytes_setting",
    "cache_bytes_setting",
    "max_read_bytes_setting",
    "pool_bytes_setting",
    "reader_setting",
    "workers_setting",
]

#: the most bytes of one read (``TILESHARD_READ_BYTES``)
DEFAULT_MAX_READ_BYTES = 2 << 30
#: the most decoded bytes of one batch (its device pool; ``TILESHARD_GPU_BATCH_BYTES``): 512 MiB
#: is 2048 chunks of 256 KiB per nvCOMP call, and a 4 GiB read still pipelines over 8 batches
DEFAULT_BATCH_BYTES = 512 << 20


def reader_setting() -> str:
    """``TILESHARD_READER``: ``tileshard`` (default) or ``zarr`` (zarr-python, for rollback)."""
    value = os.environ.get("TILESHARD_READER", "tileshard").strip().lower() or "tileshard"
    if value not in ("tileshard", "zarr"):
        raise ValueError(f"TILESHARD_READER must be 'tileshard' or 'zarr', got {value!r}")
    return value


def workers_setting(value: int | None = None) -> int:
    """Decode threads: ``value``, else ``TILESHARD_READ_WORKERS``, else the CPU count."""
    if value is None:
        text = os.environ.get("TILESHARD_READ_WORKERS")
        value = int(text) if text and text.strip().isdigit() else (os.cpu_count() or 1)
        if text and not text.strip().isdigit():
            raise ValueError(f"TILESHARD_READ_WORKERS must be a positive integer, got {text!r}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"workers must be a positive integer, got {value!r}")
    return int(value)


def cache_bytes_setting(value: int | None = None, default: int = 0) -> int:
    """The decoded-chunk cache's cap: ``value``, else ``TILESHARD_CACHE_BYTES``, else ``default``."""
    if value is None:
        text = os.environ.get("TILESHARD_CACHE_BYTES")
        if not text:
            return default
        if not text.strip().isdigit():
            raise ValueError(f"TILESHARD_CACHE_BYTES must be a non-negative number of bytes, got {text!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"cache_bytes must be a non-negative integer, got {value!r}")
    return int(value)


def pool_bytes_setting(default: int) -> int:
    """The most bytes of reused output memory the CPU reader keeps (``TILESHARD_POOL_BYTES``; 0:
    none, every output is fresh memory), else ``default``."""
    text = os.environ.get("TILESHARD_POOL_BYTES")
    if not text:
        return default
    if not text.strip().isdigit():
        raise ValueError(f"TILESHARD_POOL_BYTES must be a non-negative number of bytes, got {text!r}")
    return int(text)


def max_read_bytes_setting(value: int | None = None) -> int:
    """The read cap: ``value``, else ``TILESHARD_READ_BYTES``, else 2 GiB (validated)."""
    if value is None:
        text = os.environ.get("TILESHARD_READ_BYTES")
        if not text:
            return DEFAULT_MAX_READ_BYTES
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"TILESHARD_READ_BYTES must be an integer number of bytes, got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"max_read_bytes must be a positive integer, got {value!r}")
    return int(value)


def batch_bytes_setting() -> int:
    """``TILESHARD_GPU_BATCH_BYTES`` (decoded bytes per nvCOMP call), else 512 MiB."""
    text = os.environ.get("TILESHARD_GPU_BATCH_BYTES")
    if not text:
        return DEFAULT_BATCH_BYTES
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"TILESHARD_GPU_BATCH_BYTES must be a positive number of bytes, got {text!r}")
    return int(text)
