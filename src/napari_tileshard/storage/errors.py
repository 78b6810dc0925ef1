"""The exceptions a recording can end with, in one place below every layer that raises them.

Storage errors are :class:`OSError` subclasses (what the standard library and obstore raise for
the same situations), so ``except OSError`` in a caller keeps catching them.
"""

from __future__ import annotations

__all__ = [
    "StorageTimeoutError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreVanishedError",
    "TransientStorageError",
    "WriteCancelledError",
]


class TransientStorageError(OSError):
    """A write the storage refused for now (S3 "503 SlowDown", throttling): worth retrying."""


class StorageTimeoutError(TimeoutError):
    """A write got no answer within the I/O deadline (``io_timeout``): a frozen endpoint, a hung
    mount.  The recording stops; what the store claims stays exact."""


class WriteCancelledError(OSError):
    """A write that was dropped or cut off because the recording had already failed (or was
    abandoned): it could never have been published."""


class StoreExistsError(FileExistsError):
    """The store exists and may not be replaced (not empty without ``overwrite``, or not ours)."""


class StoreLockedError(StoreExistsError):
    """Another writer holds the store's lock file."""


class StoreVanishedError(OSError):
    """The store directory was deleted or replaced while a sink was writing into it."""

    def __str__(self):
        return self.strerror
