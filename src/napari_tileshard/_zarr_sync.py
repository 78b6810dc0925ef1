"""Run a zarr Store coroutine from synchronous code: the one place we touch zarr's private API.

zarr-python 3 has no public way to run store coroutines.  Running them on an event loop of our
own would break stores whose sessions are bound to zarr's loop (fsspec's s3fs, gcsfs, ...), as
the same store objects are also read through zarr's public API.  So we use zarr's own ``sync``,
here only: a zarr release that moves it breaks this one import.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def sync(coroutine: Coroutine[Any, Any, T]) -> T:
    from zarr.core.sync import sync as zarr_sync

    return zarr_sync(coroutine)
