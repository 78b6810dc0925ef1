"""``ReadStats``: what a :class:`~napari_tileshard.reader.shard_reader.ShardReader` has done so far.

Prefetch threads make the store requests and decode threads decode, so every count is added
under a lock (:meth:`ReadStats.add`): ``+=`` on an attribute from several threads loses updates.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["ReadStats"]


@dataclass
class ReadStats:
    """Counts of one reader: selections read, store requests (chunk data apart from shard
    indexes), decoding, and the time spent.

    ``busy_seconds`` is the time spent inside :meth:`~ShardReader.read`, ``iter_blocks`` and
    ``iter_reads`` (for the iterators: from each resume to the next yield, not the caller's time
    between blocks); :attr:`gbps` is the bytes handed out over it.  ``request_seconds`` is the
    time spent in store requests, summed over the threads that make them (it may exceed
    ``busy_seconds`` when requests overlap)."""

    #: selections read: calls of ``read``, ``iter_blocks`` and ``iter_reads``
    reads: int = 0
    #: range requests of chunk data and the bytes they returned
    data_requests: int = 0
    data_bytes: int = 0
    #: shard index reads (one per shard, then cached) and their bytes
    index_requests: int = 0
    index_bytes: int = 0
    chunks_decoded: int = 0
    bytes_decoded: int = 0
    #: of the chunks decoded, those decoded only as far as the read needed (the first frames of
    #: tiles several frames deep: a plane), which ``bytes_decoded`` counts in part
    partial_chunks: int = 0
    decode_seconds: float = 0.0
    #: batched GPU decompress calls (the GPU path decodes a whole batch of blocks per call)
    device_decode_calls: int = 0
    #: chunks taken from the decoded-chunk cache (not read, not decoded)
    cache_hits: int = 0
    #: bytes of the arrays handed to the caller (selections, blocks, decoded chunks)
    bytes_out: int = 0
    request_seconds: float = 0.0
    busy_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """Add ``counts`` (field name: amount) at once, safely from any thread."""
        with self._lock:
            for name, amount in counts.items():
                setattr(self, name, getattr(self, name) + amount)

    def reset(self) -> None:
        """Every count back to zero (for timing one part of a session)."""
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, type(getattr(self, f.name))())

    @property
    def requests(self) -> int:
        """All store requests: chunk data and shard indexes."""
        return self.data_requests + self.index_requests

    @property
    def bytes_read(self) -> int:
        """All bytes read from the store: chunk data and shard indexes."""
        return self.data_bytes + self.index_bytes

    @property
    def gbps(self) -> float:
        """Bytes handed out per second spent reading (``busy_seconds``), in GB/s."""
        return self.bytes_out / self.busy_seconds / 1e9 if self.busy_seconds else 0.0

    def __str__(self):
        return (
            f"{self.reads} reads: {self.data_bytes / 1e6:.1f} MB in {self.data_requests} data requests, "
            f"{self.index_requests} index requests ({self.index_bytes / 1e3:.1f} kB); {self.chunks_decoded} chunks "
            f"({self.bytes_decoded / 1e6:.1f} MB) decoded, {self.cache_hits} from the cache; "
            f"{self.bytes_out / 1e6:.1f} MB out in {self.busy_seconds:.3f} s, {self.gbps:.2f} GB/s"
        )
