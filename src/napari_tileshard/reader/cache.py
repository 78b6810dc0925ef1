"""The reader's two bounded LRU caches: validated shard indexes and decoded chunks.

Both are shared by the reader's decode and prefetch threads, so every operation holds a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..format.shard_spec import ShardIndex

__all__ = ["INDEX_CACHE_BYTES", "ChunkCache", "IndexCache"]

#: the most index bytes cached per reader (validated offsets and sizes, 16 bytes per chunk)
INDEX_CACHE_BYTES = 256 << 20


class IndexCache:
    """Validated shard indexes by shard key (None: the shard does not exist), least recently used
    dropped first once they hold more than ``max_bytes`` (``entry_bytes`` each: 16 per chunk of a
    shard); the newest entry is always kept."""

    def __init__(self, entry_bytes: int, max_bytes: int = INDEX_CACHE_BYTES):
        self.entry_bytes, self.max_bytes = entry_bytes, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, ShardIndex | None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> tuple[bool, ShardIndex | None]:
        """``(found, index)``: ``found`` tells a cached absent shard (``index`` None) from a miss."""
        with self._lock:
            if key not in self._entries:
                return False, None
            self._entries.move_to_end(key)
            return True, self._entries[key]

    def put(self, key: str, index: ShardIndex | None) -> None:
        with self._lock:
            if key not in self._entries:  # two threads may read the same index at once
                self.nbytes += self.entry_bytes
            self._entries[key] = index
            while self.nbytes > self.max_bytes and len(self._entries) > 1:
                self._entries.popitem(last=False)
                self.nbytes -= self.entry_bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


class ChunkCache:
    """A bounded LRU cache of decoded chunks (their bytes), keyed by shard key, chunk number and
    the chunk's place in the shard (offset, size): a shard written again has new places, so a
    stale entry is never hit, only aged out."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def get_many(self, keys: list[tuple]) -> list[np.ndarray | None]:
        """:meth:`get` of each of ``keys`` under one lock (a plane's plan looks up its 64-256 chunks)."""
        with self._lock:
            found = [self._entries.get(key) for key in keys]
            for key, decoded in zip(keys, found):
                if decoded is not None:
                    self._entries.move_to_end(key)
            return found

    def put(self, key: tuple, decoded: np.ndarray) -> None:
        if decoded.nbytes > self.max_bytes:
            return
        copy = decoded.copy()
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = copy
            self.nbytes += copy.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes

    def put_many(self, keys: list[tuple], decoded: np.ndarray, rows: list[int]) -> None:
        """``put(keys[i], decoded[rows[i]])`` for each key, with one copy of those rows: one allocation
        and one copy per decoded unit instead of one per chunk (a 2048² plane of 64 KiB chunks
        put 256 chunks a step).  The entries are views of that copy, which is freed once all
        of them are dropped, so an entry may keep up to one unit (8 MiB) more than ``max_bytes``
        alive while its neighbours age out."""
        if not keys or decoded[0].nbytes > self.max_bytes:
            return
        self._insert(keys, decoded[rows])  # one new array (NumPy's fancy indexing copies)

    def adopt_rows(self, keys: list[tuple], decoded: np.ndarray) -> None:
        """``put(keys[i], decoded[i])`` for every row of ``decoded``, which the cache then owns
        (the caller does not touch it again): no copy.  The rows are views of ``decoded``, freed
        once all of them are dropped, as for :meth:`put_many`."""
        if len(keys) and decoded[0].nbytes <= self.max_bytes:
            self._insert(keys, decoded)

    def _insert(self, keys, rows) -> None:
        with self._lock:
            for key, row in zip(keys, rows):
                if key in self._entries:
                    continue
                self._entries[key] = row
                self.nbytes += row.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
