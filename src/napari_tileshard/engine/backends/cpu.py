"""CPU backend: the stages with NumPy and the codec objects, scheduled on thread pools.

Work is split into one task per (tile epoch, shard [piece]): the task walks its tiles one
cache-sized box at a time (:meth:`Layout.shard_boxes`), running :func:`~.stages.tile.tile_cpu` (one
NumPy copy out of the staging buffer into its thread's reused tile buffer) and
:func:`~.stages.compress.compress_cpu` (one codec call for the box's tiles, which releases the GIL
for the whole box, so tasks run truly in parallel), then :func:`~.stages.aggregate.slot_sizes`.
Pyramid levels come from :func:`~.stages.reduce.reduce_cpu` on a reducer thread, while level 0
compresses, and are encoded the same way.  This module only schedules: what each stage computes lives in ``stages/``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from .base import Backend
from .stages.aggregate import aggregate_cpu, slot_sizes
from .stages.compress import compress_cpu
from .stages.reduce import reduce_cpu
from .stages.tile import tile_cpu

__all__ = ["MANY_THREADS", "CpuBackend", "CpuTicket", "EncodeTasks", "box_bytes_for"]

#: one level's encode tasks of a batch: ``[epoch][inner shard][piece]``, each giving
#: ``(chunks, padded slot sizes)``
EncodeTasks = list[list[list[Future]]]

#: bytes of tiles a task cuts and compresses at a time, so they are still in the core's cache when
#: libzstd reads them.  On the 2-core box, one thread cutting and compressing 32x128x128 tiles: the
#: tile copy cost 0.40 CPU-s/GB into a 64 MiB piece (a whole shard) and 0.19-0.21 with boxes of
#: 0.5-4 MiB; larger boxes mean fewer Python calls per GB (which hold the GIL).  Two encode
#: threads writing 64 / 256 KiB tiles: 4 MiB boxes 0.93 / 0.95x of 2 MiB ones.
_BOX_BYTES = 2 << 20
#: ... and with at least MANY_THREADS encode threads, where each box's taking the GIL back (the
#: caller's frame copy waits for it among 16 threads): 16 cores, 64 KiB tiles, 4 MiB boxes
#: 1.04 (1.02-1.11)x of 2 MiB ones, 8 MiB 1.04-1.10x; 256 KiB / 1 MiB / default 1.04 / 1.02 / 0.99
#: (benchmarks/results/cpu_16core_2026-11-27g/, calls 5 and 6)
_MANY_THREADS_BOX_BYTES = 4 << 20
MANY_THREADS = 8


def box_bytes_for(threads: int) -> int:
    """Bytes of tiles an encode task cuts and compresses at a time, with ``threads`` encode threads."""
    return _MANY_THREADS_BOX_BYTES if threads >= MANY_THREADS else _BOX_BYTES


#: threads helping the caller copy frames into staging (the GPU backend's default: up to 7).  On
#: the 16-core host the caller's copy with 7 helpers was what every write waited for: py-spy put
#: the caller's thread in that copy, or waiting for its helpers (each part a task on a pool,
#: each taking the GIL back beside 16 encode threads), in 85 % of its samples, never waiting
#: for a staging buffer.  Alone it takes the GIL back once per frame: 7 helpers ran 0.91-0.96x
#: and 2 helpers 0.93-0.97x of it (16 cores), 1 helper 0.93-1.00x (2 cores)
STAGING_COPY_HELPERS = 0
#: whether a recording's first batches go to the encode threads after 1, 2, 4, ... tile epochs
#: (up to the full batch) instead of the first only once the caller has copied a whole batch:
#: with 16 threads a batch is 8 epochs (128 MiB of 2048² uint16 frames), and every encode thread
#: idled while the caller copied the first of them into fresh staging memory.  Only for batches of
#: RAMP_MIN_BATCH_BYTES or more (a smaller one is copied in a few milliseconds).  16 cores, 2 GiB
#: writes: 0.98-1.04x the rate without it, inside the noise; kept because the first shards reach
#: the store after one epoch (benchmarks/results/cpu_16core_2026-12-07c/)
RAMP_UP = True
RAMP_MIN_BATCH_BYTES = 64 << 20


@dataclass
class CpuTicket:
    """What :meth:`CpuBackend.submit` returns."""

    #: level 0's encode tasks, queued at submit
    level0: EncodeTasks
    #: the reduction chain of the other levels (None without a pyramid): gives their EncodeTasks
    reduce: Future | None = None


class CpuBackend(Backend):
    name = "cpu"
    #: the least input per batch.  Two staging buffers of it (the caller fills one while the other
    #: is encoded) fit in a server's last-level cache (32+ MiB), so the encode threads cut tiles out
    #: of frames the caller copied moments before, and a Writer faults in little fresh staging.  On
    #: the 2-core box (48 MiB L3, 64 KiB and 256 KiB tiles 2 frames deep) the caller's copy into
    #: staging (its thread and the copy helper) cost 0.58-0.69 CPU-s per GB with 64 MiB batches
    #: and 0.24-0.25 with 16 MiB ones, as much as tensorstore's harness copying the same frames
    #: into 2 x 16 MiB of slabs (0.19-0.20; ``benchmarks/ab_cpu_write.py``).
    preferred_batch_bytes = 16 << 20
    _MAX_BATCH_BYTES = 256 << 20

    @classmethod
    def batch_bytes_for(cls, layout, threads: int | None = None) -> int:
        """Input per batch by default: whole tile epochs, enough that each of ``threads`` encode
        threads (default: one per CPU) gets two (epoch, shard) tasks, and at least
        :attr:`preferred_batch_bytes` (at most ``_MAX_BATCH_BYTES`` unless one epoch is more)."""
        threads = threads or os.cpu_count() or 1
        epochs = -(-2 * threads // layout.inner_shard_count)
        return max(cls.preferred_batch_bytes, min(cls._MAX_BATCH_BYTES, epochs * layout.epoch_bytes))

    def __init__(self, layout, codec="zstd", level=1, *, threads: int | None = None, pyramid=None):
        super().__init__(layout, codec, level, pyramid)
        self.threads = threads or os.cpu_count() or 1
        self.box_bytes = box_bytes_for(self.threads)  # tiles an encode task cuts and compresses at a time
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tileshard-cpu")
        self._scratch = threading.local()  # per pool thread: the buffer its tasks cut tiles into
        self._plans: dict = {}  # (layout, epochs) -> how a batch's tasks are split (:meth:`task_plan`)
        # Reductions run on their own thread: an encode task never waits on a reduction queued
        # behind it in the same pool.
        self._reducer = (
            ThreadPoolExecutor(1, thread_name_prefix="tileshard-reduce") if self.pyramid.levels > 1 else None
        )
        # Tasks per (epoch, shard [piece]): a few epochs per batch so every thread has work.
        self.preferred_batch_bytes = self.batch_bytes_for(layout, self.threads)

    def memory_estimate(self, batch_bytes: int, staging_buffers: int) -> dict[str, int]:
        estimate = super().memory_estimate(batch_bytes, staging_buffers)
        if not self.codec.encoded_tiles_alias_input:  # each pool thread's tile buffer: one box of tiles
            estimate["host"] += self.threads * max(
                min(max(1, self.box_bytes // lay.tile_bytes), lay.tiles_per_shard_inner) * lay.tile_bytes
                for lay in self.pyramid.layouts
            )
        return estimate

    def describe(self) -> str:
        return f"cpu ({self.threads} threads)"

    def staging_copy_helpers(self) -> int | None:
        return STAGING_COPY_HELPERS

    def first_batch_epochs(self, batch_epochs: int) -> int:
        ramps = RAMP_UP and batch_epochs * self.layout.epoch_bytes >= RAMP_MIN_BATCH_BYTES
        return 1 if ramps else batch_epochs

    def submit(self, staging, epochs, host_ranges=None, rows=None) -> CpuTicket:
        layout = self.layout
        batch = staging[: epochs * layout.epoch_bytes].view(layout.dtype)
        batch = batch.reshape((epochs * layout.epoch_rows,) + layout.shape[1:])
        ticket = CpuTicket(self._encode(layout, batch, epochs))
        if self._reducer is not None:
            # Level k comes from level k-1: one chain on the reducer thread, each level's encode
            # tasks queued when it is ready.  The staging buffer stays busy until the chain ran.
            ticket.reduce = self._reducer.submit(self._reduce_and_encode, batch, epochs, rows)
        return ticket

    def _reduce_and_encode(self, batch, epochs, rows) -> list[EncodeTasks]:
        levels = reduce_cpu(self.pyramid, batch, epochs, rows)
        return [self._encode(lay, level, epochs) for lay, level in zip(self.pyramid.layouts[1:], levels)]

    def _encode(self, layout, batch, epochs) -> EncodeTasks:
        batch = batch.reshape((epochs, layout.epoch_rows) + layout.shape[1:])
        pieces, piece_bytes = self.task_plan(layout, epochs)
        return [
            [
                [
                    self._pool.submit(self._encode_piece, layout, batch[e], shard, piece, boxes, piece_bytes)
                    for piece, boxes in pieces
                ]
                for shard in range(layout.inner_shard_count)
            ]
            for e in range(epochs)
        ]

    def task_plan(self, layout, epochs: int) -> tuple[list[tuple[slice, list]], int]:
        """How each (epoch, shard) task of a batch of ``epochs`` is split: its pieces (a range of
        tile rows ``w_1`` and the boxes that cut it, :meth:`Layout.shard_boxes`), and the most
        bytes of tiles in one piece.  The same for every batch of a recording: planned once."""
        key = (layout, epochs)
        plan = self._plans.get(key)
        if plan is None:
            # Split shards along w_1 when (epoch, shard) tasks alone would leave threads idle.
            tasks = epochs * layout.inner_shard_count
            tps_1 = layout.tiles_per_shard[1] if layout.rank > 1 else 1
            count = max(1, min(tps_1, -(-2 * self.threads // tasks)))
            bounds = [tps_1 * i // count for i in range(count + 1)]  # as even as whole tile rows go
            box_tiles = max(1, self.box_bytes // layout.tile_bytes)
            pieces = [(slice(a, b), layout.shard_boxes(slice(a, b), box_tiles)) for a, b in zip(bounds, bounds[1:])]
            rows = max(b - a for a, b in zip(bounds, bounds[1:]))
            plan = self._plans[key] = (pieces, rows * (layout.tiles_per_shard_inner // tps_1) * layout.tile_bytes)
        return plan

    def _encode_piece(self, layout, epoch_rows: np.ndarray, shard: int, within_1: slice, boxes: list, piece_bytes: int):
        if self.codec.encoded_tiles_alias_input:  # the chunks are the tiles: one fresh array for all
            chunks, sizes = compress_cpu(self.codec, tile_cpu(layout, epoch_rows, shard, within_1))
            return chunks, slot_sizes(layout, shard, within_1, sizes)
        # Cut and compress one cache-sized box of tiles at a time: the codec reads the tiles
        # while they are still in this core's cache, instead of from memory after a whole piece
        # (up to 64 MiB with deep tiles) was cut.  The chunks and their order are the piece's.
        box_tiles = max(1, self.box_bytes // layout.tile_bytes)
        scratch = self._tile_scratch(min(box_tiles * layout.tile_bytes, piece_bytes))
        chunks, sizes = [], []
        for box in boxes:
            tiles = tile_cpu(layout, epoch_rows, shard, box, out=scratch)
            if len(tiles):
                box_chunks, box_sizes = compress_cpu(self.codec, tiles)
                chunks += box_chunks
                sizes += box_sizes
        return chunks, slot_sizes(layout, shard, within_1, sizes)

    def _tile_scratch(self, nbytes: int) -> np.ndarray | None:
        """This thread's reusable buffer for the tiles of one task (None: a new array per task).

        The tiles live only until the codec returned their chunks, so each pool thread reuses one
        buffer: a fresh multi-MiB array per task costs as much CPU in page faults as the copy
        itself.  Not when the codec's chunks are views of the tiles (``none``).
        """
        if self.codec.encoded_tiles_alias_input:
            return None
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        return buffer

    def result(self, ticket: CpuTicket):
        levels = [ticket.level0]
        if ticket.reduce is not None:
            levels += ticket.reduce.result()
        # One wake-up for the whole batch: waiting task by task woke the caller (the collector
        # thread) once per task, and each wake-up takes a core from an encode thread for a moment.
        wait([future for tasks in levels for per_shard in tasks for pieces in per_shard for future in pieces])
        return [
            aggregate_cpu([[[future.result() for future in pieces] for pieces in per_shard] for per_shard in tasks])
            for tasks in levels
        ]

    def staging_free(self, ticket: CpuTicket, block=True):
        # Level 0's encode tasks and the reduction chain read the staging buffer.
        futures = [f for per_shard in ticket.level0 for pieces in per_shard for f in pieces]
        if ticket.reduce is not None:
            futures.append(ticket.reduce)
        if block:
            wait(futures)
            return True
        return all(f.done() for f in futures)

    def close(self):
        if self._reducer is not None:
            self._reducer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
