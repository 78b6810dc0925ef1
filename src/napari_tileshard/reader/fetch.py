"""Getting a reader's bytes: shard indexes and ranges read through the checked store, into
recycled buffers, a few reads ahead of the decoder."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from ..format.shard_spec import ShardReadError, ShardSpec
from ..storage._zarr_sync import sync
from ..storage.places import in_memory_file_system
from ..storage.safe_read import LocalFiles, StoreAccess
from .memory import output_pool
from .plan import Read
from .stats import ReadStats

__all__ = [
    "DISK_FETCH_AHEAD_BYTES",
    "DISK_FETCH_THREADS",
    "DiskFetches",
    "FREE_BUFFER_BYTES",
    "WILL_NEED_BYTES",
    "ReadBuffers",
    "StoreObjects",
    "hinted_ahead",
    "prefetched",
]

#: the most bytes of read buffers a reader keeps for reuse
FREE_BUFFER_BYTES = 256 << 20

#: how far (bytes) beyond the reads being fetched the OS is asked to read local files into its
#: page cache (``posix_fadvise(WILLNEED)``; 0: never).  A disk serves one reader thread at a
#: fraction of its rate: on the 2-core VM one thread read the recording's files at 0.61-0.76 GB/s
#: and four at 1.06-1.28 (``bench_read.disk_ceiling``); the reader's own fetch from the evicted
#: disk went from 0.89 / 0.93 to 1.00 / 1.15 GB/s with the hints (``read_probes.py fetch-cold``).
WILL_NEED_BYTES = 64 << 20

#: threads that fetch a large read's ranges of local files on a disk ahead of its decode: a disk
#: serves several requests at once faster than one (the 2-core VM's: 0.75-0.79 GB/s with one
#: thread, 1.42-1.46 with four, ``bench_read.disk_ceiling``), and a decode thread that fetched
#: its own reads left its core idle while it waited (the hints above did not fill that wait)
DISK_FETCH_THREADS = 4

#: how far (bytes) the disk threads fetch ahead of the reads the decode threads take: enough to
#: keep a disk busy (four shard reads in flight), near enough that a read is still in the CPU's
#: caches when it is decoded, and a bound on the read buffers held
DISK_FETCH_AHEAD_BYTES = 16 << 20


def _cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of ``fd`` is in the OS page cache: a one-byte read that may
    not wait for the disk (Linux's ``RWF_NOWAIT``; elsewhere: False, not known).  Asking the OS to
    read ahead what it holds already walked the range's pages: a hint cost 51 us per 2.3 MB read
    of a cached disk file on the 2-core VM, 16 us with this check first."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, nowait) == 1
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP and the like: cannot tell
        return False


def _read_into(view: memoryview, start: int, fd: int) -> int:
    """Bytes ``start ..`` of ``fd`` into ``view`` until it is full or the file ends: how many."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + (1 << 30)]], start + done)
        if n <= 0:
            break
        done += n
    return done


R = TypeVar("R")
B = TypeVar("B")


class StoreObjects:
    """Ranged reads of a store's objects: ``(size, bytes)`` of shard indexes, a range into a buffer;
    each request counted in ``stats`` (index reads apart from chunk data, with the time spent).

    Local stores are read with ``os.preadv`` straight into the read's buffer through descriptors
    opened by :class:`~napari_tileshard.storage.safe_read.LocalFiles` (regular files inside the
    store only, a few system calls each): no Python bytes object per read, no join, no event-loop
    round trip per request, which zarr's ``LocalStore.get`` costs.  Other stores go through
    zarr's ``Store.get`` with byte ranges, the indexes of many shards in one gather.
    """

    def __init__(self, access: StoreAccess, stats: ReadStats):
        self.access, self.stats = access, stats
        self.local = access.root is not None
        self.files = LocalFiles(access.root) if self.local else None
        #: whether :meth:`will_need` asks the OS anything: local files where ``posix_fadvise``
        #: exists (not macOS, not Windows), not held in memory (tmpfs: each hint cost six system
        #: calls per shard for nothing, on the thread that queues the decode tasks)
        self.hints = self.local and hasattr(os, "posix_fadvise") and not in_memory_file_system(access.root)

    def index(self, key: str, spec: ShardSpec) -> tuple[int, bytes] | None:
        """(object size, the index bytes), or None when the shard does not exist."""
        return self.indexes([key], spec)[0]

    def indexes(self, keys: list[str], spec: ShardSpec) -> list[tuple[int, bytes] | None]:
        """:meth:`index` of each of ``keys``: local files one after the other (a few system
        calls each), other stores in one gather of concurrent requests (an object store's
        latency is paid once, not once per shard)."""
        started = time.perf_counter()
        if self.local:
            found = [self._local_index(key, spec) for key in keys]
        else:
            found = sync(self._remote_indexes(keys, spec))
        self.stats.add(
            index_requests=len(keys),
            index_bytes=sum(len(f[1]) for f in found if f is not None),
            request_seconds=time.perf_counter() - started,
        )
        return found

    def _local_index(self, key: str, spec: ShardSpec) -> tuple[int, bytes] | None:
        nbytes = spec.index_nbytes
        assert self.files is not None

        def index(fd: int) -> tuple[int, bytes]:
            size = os.fstat(fd).st_size
            return size, (os.pread(fd, nbytes, spec.index_offset(size)) if size >= nbytes else b"")

        try:  # the shard stays open for its chunks' reads (LocalFiles.use)
            return self.files.use(key, index)
        except (FileNotFoundError, NotADirectoryError):
            return None

    async def _remote_indexes(self, keys: list[str], spec: ShardSpec) -> list[tuple[int, bytes] | None]:
        import asyncio

        from zarr.abc.store import RangeByteRequest
        from zarr.buffer import default_buffer_prototype

        store, nbytes = self.access.store, spec.index_nbytes

        async def one(key: str) -> tuple[int, bytes] | None:
            try:
                size = await store.getsize(key)
            except FileNotFoundError:
                return None
            if size < nbytes:
                return size, b""
            start = spec.index_offset(size)
            buffer = await store.get(
                key, default_buffer_prototype(), byte_range=RangeByteRequest(start, start + nbytes)
            )
            return size, b"" if buffer is None else buffer.to_bytes()

        return list(await asyncio.gather(*(one(key) for key in keys)))

    def read_into(self, key: str, start: int, out: np.ndarray) -> None:
        """Bytes ``start .. start + len(out)`` of ``key`` into ``out``; ShardReadError if short."""
        started = time.perf_counter()
        if self.local:
            assert self.files is not None
            done = self.files.use(key, functools.partial(_read_into, memoryview(out.data).cast("B"), start))
        else:
            from zarr.abc.store import RangeByteRequest
            from zarr.buffer import default_buffer_prototype

            buffer = sync(
                self.access.store.get(
                    key, default_buffer_prototype(), byte_range=RangeByteRequest(start, start + len(out))
                )
            )
            data = np.zeros(0, np.uint8) if buffer is None else buffer.as_numpy_array().view(np.uint8)
            done = len(data)
            out[:done] = data[: len(out)]
        self.stats.add(data_requests=1, data_bytes=done, request_seconds=time.perf_counter() - started)
        if done != len(out):
            raise ShardReadError(key, None, f"bytes {start}..{start + len(out)} asked, {done} read: shard truncated")

    def cached(self, key: str, offset: int) -> bool:
        """Whether byte ``offset`` of ``key`` is in the OS page cache (local files on Linux; else
        False, not known; a missing or refused file: False, its read says why)."""
        if not self.local:
            return False
        assert self.files is not None
        try:  # the file stays open for the read that follows (LocalFiles.use)
            return self.files.use(key, functools.partial(_cached, offset=offset))
        except Exception:  # noqa: BLE001 - the read itself says what is wrong with the file
            return False

    def will_need(self, key: str, start: int, size: int) -> bool:
        """Ask the OS to start reading bytes ``start .. start + size`` of ``key`` into its page
        cache (where :attr:`hints`; elsewhere nothing).  A hint: nothing is read here and nothing
        fails (a missing or refused file fails when it is read).  Returns whether the OS was
        asked (False: the range is cached already, or no hint can be given)."""
        if not self.hints:
            return False
        assert self.files is not None

        def hint(fd: int) -> bool:
            if _cached(fd, start) and _cached(fd, start + size - 1):
                return False
            os.posix_fadvise(fd, start, size, os.POSIX_FADV_WILLNEED)
            return True

        try:  # the file stays open for the read that follows (LocalFiles.use)
            return self.files.use(key, hint)
        except Exception:  # noqa: BLE001 - the read itself says what is wrong with the file
            return False

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


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
        return output_pool().empty(size, np.uint8)  # fresh: small pages (NumPy asks for huge ones)

    def recycle(self, buffers: Iterable[np.ndarray]) -> None:
        """Give back buffers once decoded (views of a taken buffer give back the whole buffer)."""
        with self._lock:
            for buffer in buffers:
                base = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
                if self._free_bytes + base.size <= self.max_bytes:
                    self._free.append(base)
                    self._free_bytes += base.size


#: after this many reads in a row found in the page cache already, :func:`hinted_ahead` looks at
#: only one read in ``CACHED_SAMPLE`` (and at every read again once one is not cached): each look
#: opens the file and makes two system calls on the thread that queues the reads, and with 16
#: decode threads each system call's return waits for the GIL
CACHED_RUN = 16
CACHED_SAMPLE = 16


class _CachedRuns:
    """Which reads to look at in the page cache: every one until ``CACHED_RUN`` in a row were
    found cached, then those at positions divisible by ``CACHED_SAMPLE``, every one again after
    a look finds one that is not."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def look(self, position: int) -> bool:
        return self.in_a_row < CACHED_RUN or position % CACHED_SAMPLE == 0

    def saw(self, cached: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if cached else 0


def hinted_ahead(reads: list[Read], objects: StoreObjects) -> Iterator[Read]:
    """A plan's ``reads`` in order; as each is taken (to be fetched), the OS is asked to read
    the ones after it into its page cache, up to ``WILL_NEED_BYTES`` ahead
    (:meth:`StoreObjects.will_need`): a disk then has many requests in flight, not only the
    reader's own.  Where reads keep being cached already, only a sample is looked at
    (``CACHED_RUN``)."""
    if not WILL_NEED_BYTES:
        yield from reads
        return
    hinted = 0  # reads[:hinted] were hinted or taken
    ahead = 0  # bytes of the reads hinted after the one being taken
    runs = _CachedRuns()
    for i, read in enumerate(reads):
        if i < hinted:
            ahead -= read.size  # hinted earlier; taken now
        else:
            hinted = i + 1
        while hinted < len(reads) and ahead < WILL_NEED_BYTES:
            later = reads[hinted]
            if runs.look(hinted):
                runs.saw(cached=not objects.will_need(later.key, later.start, later.size))
            ahead += later.size
            hinted += 1
        yield read


class DiskFetches:
    """The reads of a large read of local files on a disk, fetched by ``pool`` (the reader's disk
    threads) ahead of the decode threads that take them, at most ``ahead_bytes`` ahead.

    ``reads`` in the order the decode takes them.  A read the page cache holds (its start, by
    :meth:`StoreObjects.cached`) is left to the decode thread, which copies it just before it
    decodes it; where reads keep being cached, only a sample is looked at (``CACHED_RUN``, as
    :func:`hinted_ahead`).  :meth:`take` hands a read's buffer over and fetches further ahead;
    :meth:`close` cancels what was not taken."""

    def __init__(
        self,
        reads: Sequence[Read],
        objects: StoreObjects,
        fetch: Callable[[Read], np.ndarray],
        pool: ThreadPoolExecutor,
        ahead_bytes: int = 0,
    ):
        self._reads = reads
        self._position = {read.index: k for k, read in enumerate(reads)}
        self._objects, self._fetch, self._pool = objects, fetch, pool
        self._ahead_bytes = ahead_bytes or DISK_FETCH_AHEAD_BYTES
        self._futures: dict[int, Future] = {}  # by read index: submitted, not taken
        self._next = 0  # reads[:_next] were submitted, left to the decode or taken
        self._ahead = 0  # bytes submitted and not taken
        self._runs = _CachedRuns()
        self._closed = False
        self._lock = threading.Lock()
        with self._lock:
            self._advance()

    def take(self, read: Read) -> np.ndarray | None:
        """The buffer of ``read`` once fetched, or None: the caller fetches it."""
        with self._lock:
            future = self._futures.pop(read.index, None)
            if future is not None:
                self._ahead -= read.size
            else:  # never submitted: reads up to it are the caller's (a decode thread ran ahead)
                self._next = max(self._next, self._position.get(read.index, -1) + 1)
            self._advance()
        return None if future is None else future.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.cancel()

    def _advance(self) -> None:
        """Submit the next reads the page cache lacks while less than ``ahead_bytes`` wait (lock held)."""
        while not self._closed and self._next < len(self._reads) and self._ahead < self._ahead_bytes:
            read = self._reads[self._next]
            self._next += 1
            if not self._runs.look(self._next):
                continue
            cached = self._objects.cached(read.key, read.start)
            self._runs.saw(cached)
            if cached:
                continue
            self._futures[read.index] = self._pool.submit(self._fetch, read)
            self._ahead += read.size


def prefetched(
    reads: Iterable[R], fetch: Callable[[R], B], prefetch: int, pool: ThreadPoolExecutor | None = None
) -> Iterator[tuple[R, B]]:
    """``(read, fetch(read))`` in order, up to ``prefetch`` reads fetched ahead on ``pool`` (a
    reader's, kept across reads: starting threads for every read cost ~0.2 ms, a tenth of a
    scrubbing step's budget) or, without one, on up to ``prefetch`` threads of its own (at most
    8: one thread copies ~5-8 GB/s out of the page cache, less than 16 decode threads or a GPU
    take).  Reads not yet consumed when the caller stops are cancelled."""
    if not prefetch:
        for read in reads:
            yield read, fetch(read)
        return
    if pool is None:
        with ThreadPoolExecutor(min(8, prefetch), thread_name_prefix="tileshard-read") as own:
            yield from prefetched(reads, fetch, prefetch, own)
        return
    pending: list[tuple[R, Future]] = []
    try:
        for read in reads:
            pending.append((read, pool.submit(fetch, read)))
            if len(pending) > prefetch:
                done, future = pending.pop(0)
                yield done, future.result()
        while pending:
            done, future = pending.pop(0)
            yield done, future.result()
    finally:
        for _, future in pending:
            future.cancel()
