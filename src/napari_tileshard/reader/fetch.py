"""Getting a reader's bytes: shard indexes and ranges read through the checked store, into
recycled buffers, a few reads ahead of the decoder."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from ..format.shard_spec import ShardReadError, ShardSpec
from ..storage._zarr_sync import sync
from ..storage.safe_read import StoreAccess, open_local_file

__all__ = ["FREE_BUFFER_BYTES", "ReadBuffers", "StoreObjects", "prefetched"]

#: the most bytes of read buffers a reader keeps for reuse
FREE_BUFFER_BYTES = 256 << 20

R = TypeVar("R")
B = TypeVar("B")


class StoreObjects:
    """Ranged reads of a store's objects: ``(size, bytes)`` of an index, a range into a buffer.

    Local stores are read with ``os.preadv`` straight into the read's buffer through descriptors
    opened by :func:`~napari_tileshard.storage.safe_read.open_local_file` (regular files inside the
    store only): no Python bytes object per read, no join, no event-loop round trip per request,
    which zarr's ``LocalStore.get`` costs.  Other stores go through zarr's ``Store.get`` with byte
    ranges.
    """

    def __init__(self, access: StoreAccess):
        self.access = access
        self.local = access.root is not None
        self.requests = 0
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_read += n

    def index(self, key: str, spec: ShardSpec) -> tuple[int, bytes] | None:
        """(object size, the index bytes), or None when the shard does not exist."""
        nbytes = spec.index_nbytes
        if self.local:
            try:
                fd = open_local_file(self.access.root, key)
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                size = os.fstat(fd).st_size
                raw = os.pread(fd, nbytes, spec.index_offset(size)) if size >= nbytes else b""
            finally:
                os.close(fd)
            self._count(len(raw))
            return size, raw
        from zarr.abc.store import RangeByteRequest

        try:
            size = sync(self.access.store.getsize(key))
        except FileNotFoundError:
            return None
        if size < nbytes:
            return size, b""
        start = spec.index_offset(size)
        return size, self._get(key, RangeByteRequest(start, start + nbytes)).tobytes()

    def read_into(self, key: str, start: int, out: np.ndarray) -> None:
        """Bytes ``start .. start + len(out)`` of ``key`` into ``out``; ShardReadError if short."""
        if self.local:
            fd = open_local_file(self.access.root, key)
            try:
                done, view = 0, memoryview(out.data).cast("B")
                while done < len(view):
                    n = os.preadv(fd, [view[done : done + (1 << 30)]], start + done)
                    if n <= 0:
                        break
                    done += n
            finally:
                os.close(fd)
            self._count(done)
        else:
            from zarr.abc.store import RangeByteRequest

            data = self._get(key, RangeByteRequest(start, start + len(out)))
            done = len(data)
            out[:done] = data[: len(out)]
        if done != len(out):
            raise ShardReadError(key, None, f"bytes {start}..{start + len(out)} asked, {done} read: shard truncated")

    def _get(self, key, byte_range) -> np.ndarray:
        from zarr.buffer import default_buffer_prototype

        buffer = sync(self.access.store.get(key, default_buffer_prototype(), byte_range=byte_range))
        data = np.zeros(0, np.uint8) if buffer is None else buffer.as_numpy_array().view(np.uint8)
        self._count(len(data))
        return data


class ReadBuffers:
    """Read buffers for reuse, at most ``max_bytes`` of them kept.

    Reusing buffers saves the page faults of fresh memory on every read (on a VM, touching fresh
    memory cost more than copying the bytes out of the page cache)."""

    def __init__(self, max_bytes: int = FREE_BUFFER_BYTES):
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A buffer of ``size`` bytes: the smallest recycled one that is large enough, else a new one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= size]
            if fits:
                best = min(fits, key=lambda i: self._free[i].size)
                self._free_bytes -= self._free[best].size
                return self._free.pop(best)[:size]
        return np.empty(size, dtype=np.uint8)

    def recycle(self, buffers: Iterable[np.ndarray]) -> None:
        """Give back buffers once decoded (views of a taken buffer give back the whole buffer)."""
        with self._lock:
            for buffer in buffers:
                base = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
                if self._free_bytes + base.size <= self.max_bytes:
                    self._free.append(base)
                    self._free_bytes += base.size


def prefetched(reads: Iterable[R], fetch: Callable[[R], B], prefetch: int) -> Iterator[tuple[R, B]]:
    """``(read, fetch(read))`` in order, up to ``prefetch`` reads fetched ahead, on up to
    ``prefetch`` threads (at most 8: one thread copies ~5-8 GB/s out of the page cache, less than
    16 decode threads or a GPU take).  Reads not yet consumed when the caller stops are cancelled."""
    if not prefetch:
        for read in reads:
            yield read, fetch(read)
        return
    with ThreadPoolExecutor(min(8, prefetch), thread_name_prefix="tileshard-read") as io:
        pending: list[tuple[R, Future]] = []
        try:
            for read in reads:
                pending.append((read, io.submit(fetch, read)))
                if len(pending) > prefetch:
                    done, future = pending.pop(0)
                    yield done, future.result()
            while pending:
                done, future = pending.pop(0)
                yield done, future.result()
        finally:
            for _, future in pending:
                future.cancel()
