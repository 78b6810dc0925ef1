"""The interface between the Writer and a backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...format import codecs
from ...format.layout import Layout
from ...format.pyramid import Pyramid
from ..shards import EncodedEpoch

__all__ = ["Backend", "CODECS", "MemoryBudget", "Ticket"]

CODECS = codecs.names()  # the Writer validates names against these until it asks codecs.get()

Ticket = Any  # what submit() returns (CpuTicket, GpuTicket: each backend's own dataclass); opaque to the Writer


@dataclass(frozen=True)
class MemoryBudget:
    """Upper bounds, in bytes, on the memory a Writer holds (None: no bound).

    ``host``: the backend's host buffers (pinned memory with the GPU backend; staging plus
    compressed shards waiting for storage with the CPU backend); ``device``: GPU memory.
    """

    host: int | None = None
    device: int | None = None

    def admits(self, estimate: dict[str, int]) -> bool:
        """True when an estimate (``{"host": ..., "device": ...}``) stays within every bound."""
        return all(bound is None or estimate[kind] <= bound for kind, bound in vars(self).items())


class Backend(ABC):
    """Encodes batches of tile epochs.

    The Writer fills a staging buffer (from :meth:`allocate_staging`) with whole tile epochs in
    row-major order, then calls :meth:`submit`; it calls :meth:`result` for each ticket, in
    submission order, from its collector thread.  Before refilling a staging buffer it calls
    :meth:`staging_free` with that buffer's last ticket.

    With a :class:`Pyramid` of several levels, the backend also computes every reduced level of
    each batch and encodes its tiles with level 0's; :meth:`result` returns one list of epochs per
    level.

    A backend composes the stages of ``backends/stages/`` (tile, reduce, compress, aggregate) and
    owns only their scheduling: threads or streams, buffers, tickets.  Its constructor takes
    ``(layout, codec, level)`` and keyword-only options, and names an option it does not know.
    """

    name = "?"
    #: batch size the backend is efficient with; the Writer rounds it to whole tile epochs
    preferred_batch_bytes = 64 << 20
    #: staging buffers the Writer allocates by default
    preferred_staging_buffers = 2
    #: batches the backend can work on at once (the GPU's device slots); the Writer lets this
    #: many, or as many as it has staging buffers, into the pipeline
    batches_in_flight = 0

    def staging_copy_helpers(self) -> int | None:
        """Threads that help the caller's thread copy frames into staging (None: as many as
        :func:`~napari_tileshard.engine.staging.copy_threads` says)."""
        return None

    def first_batch_epochs(self, batch_epochs: int) -> int:
        """Tile epochs of a recording's first batch, where the Writer's batches start smaller and
        double up to ``batch_epochs`` (a ramp; ``batch_epochs``: none)."""
        return batch_epochs

    def __init__(
        self, layout: Layout, codec: str | codecs.Codec = "zstd", level: int = 1, pyramid: Pyramid | None = None
    ):
        #: the configured :class:`~napari_tileshard.format.codecs.Codec` (level and element size applied)
        self.codec = codecs.get(codec).configure(level, layout.dtype)
        if layout.tile_bytes > self.codec.max_chunk_bytes:
            raise ValueError(
                f"tile of {layout.tile_bytes} bytes exceeds codec {self.codec.name!r}'s limit of "
                f"{self.codec.max_chunk_bytes} bytes per chunk; use smaller tiles"
            )
        if pyramid is not None and pyramid.layouts[0] != layout:
            raise ValueError("the pyramid's level 0 must be the layout")
        self.layout = layout
        self.level = self.codec.level
        self.pyramid = pyramid or Pyramid.single(layout)

    def allocate_staging(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    #: True if write_device() takes device (CuPy) arrays without a round trip through the host
    accepts_device_arrays = False

    @abstractmethod
    def submit(self, staging: np.ndarray, epochs: int, host_ranges=None, rows: int | None = None) -> Ticket:
        """Start encoding the first ``epochs`` tile epochs held in ``staging``.

        ``host_ranges``: the ``(start, stop)`` byte ranges filled from host memory (None: all);
        the rest was filled with :meth:`write_device`.  ``rows``: rows along dim 0 that hold data
        when the last epoch is a zero-padded partial one (None: all); reductions along the
        append dim leave the padding out.
        """

    def write_device(self, staging: np.ndarray, offset: int, data) -> None:
        raise NotImplementedError(f"the {self.name} backend takes host arrays only")

    @abstractmethod
    def result(self, ticket: Ticket) -> list[list[EncodedEpoch]]:
        """Wait for ``ticket`` and return its epochs, in order, for each pyramid level."""

    def staging_free(self, ticket: Ticket, block: bool = True) -> bool:
        """True once the staging buffer given to ``submit`` may be overwritten."""
        return True

    def memory_estimate(self, batch_bytes: int, staging_buffers: int) -> dict[str, int]:
        """Bytes of host and device memory this backend holds for the given batching."""
        return {"host": staging_buffers * batch_bytes, "device": 0}

    #: True when :meth:`memory_estimate`'s host bytes already hold the compressed shards waiting
    #: for storage (the GPU's pinned output buffers); else the Writer adds them
    estimate_holds_shards = False

    def default_budget(self, physical_memory: int | None = None) -> MemoryBudget:
        """The memory budget when the Writer is given none (no bound here; the GPU's is machine-derived)."""
        return MemoryBudget()

    def memory_held(self) -> dict[str, int]:
        """Bytes of host and device memory the backend's buffers hold now."""
        return {"host": 0, "device": 0}

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        pass
