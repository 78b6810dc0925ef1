"""Run a zarr Store coroutine from synchronous code: the one place we touch zarr's private API.

zarr-python 3 has no public way to run store coroutines.  Running them on an event loop of our
own would break stores whose sessions are bound to zarr's loop (fsspec's s3fs, gcsfs, ...), as
the same store objects are also read through zarr's public API.  So we use zarr's own ``sync``,
here only: a zarr release that moves it breaks this one import.

zarr's ``MemoryStore`` is a dict behind ``async`` methods that never suspend.  The one that
``memory://`` opens is private to its sink, so its coroutines are run to completion on the
calling thread (:func:`sync_for`), which saves a round trip through zarr's event-loop thread per
shard written.  A ``MemoryStore`` a caller passes in keeps zarr's loop: the caller may list it
while the I/O workers write, and zarr's loop is what serialises the two.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run_inline", "sync", "sync_for"]

T = TypeVar("T")


def sync(coroutine: Coroutine[Any, Any, T]) -> T:
    from zarr.core.sync import sync as zarr_sync

    return zarr_sync(coroutine)


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits on anything to completion on the calling thread.

    A bare ``yield`` (``asyncio.sleep(0)``) is stepped over; a coroutine that waits on a future
    needs an event loop and is refused (closed, ``RuntimeError``): use :func:`sync` for it.
    """
    while True:
        try:
            suspended = coroutine.send(None)
        except StopIteration as done:
            return done.value
        if suspended is not None:
            coroutine.close()
            raise RuntimeError(f"{coroutine!r} waits on {suspended!r}: it needs an event loop")


def sync_for(store, private: bool = False) -> Callable[[Coroutine[Any, Any, T]], T]:
    """How to run ``store``'s coroutines: inline for a ``private`` (no one else holds it) zarr
    ``MemoryStore`` (exactly that class: a subclass may wait on I/O), through zarr's event loop
    for any other store."""
    from zarr.storage import MemoryStore

    return run_inline if private and type(store) is MemoryStore else sync
