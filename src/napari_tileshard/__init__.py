"""napari-tileshard: stream microscope frames into sharded Zarr v3 arrays, on the GPU or the CPU.

What users call is here: the writers (:class:`Writer`, :class:`MultiWriter`, :func:`convert`,
pymmcore-plus's :class:`TileShardSink`), their settings (:class:`Layout`/:class:`Dim`,
:class:`ArraySpec`, :class:`EngineOptions`), the reader (:class:`ShardReader`), :func:`verify`, the
errors a recording can end with, and the names of the codecs and backends.
"""

from .apps.camera import SyntheticCamera
from .apps.convert import ConvertInterrupted, ConvertReport, ResumeMismatch, convert
from .apps.mmcore import SinkFellBehindError, TileShardSink
from .apps.verify import VerifyReport, verify
from .engine.backends import BACKENDS
from .engine.backends.gpu import release_gpu_memory
from .engine.errors import PipelineStalledError
from .engine.multi_writer import MultiWriter
from .engine.options import EngineOptions
from .engine.writer import CloseAbandoned, IncompleteFrameWarning, Writer, WriterError, WriterStats
from .format.array_spec import ArraySpec, OmeOptions
from .format.codecs import CODECS, CodecError
from .format.layout import MAX_RANK, SUPPORTED_DTYPES, Dim, Layout
from .format.shard_spec import ShardReadError
from .reader.shard_reader import ShardReader
from .storage.errors import (
    StorageTimeoutError,
    StoreExistsError,
    StoreLockedError,
    StoreVanishedError,
    TransientStorageError,
    WriteCancelledError,
)
from .storage.sinks import Sink

__version__ = "0.1.0"

#: the codecs a recording can write (``Writer(codec=...)``), and the backends (``backend=...``)
CODEC_NAMES = tuple(CODECS)
BACKEND_NAMES = BACKENDS

__all__ = [
    "BACKEND_NAMES",
    "CODEC_NAMES",
    "MAX_RANK",
    "SUPPORTED_DTYPES",
    "ArraySpec",
    "CloseAbandoned",
    "IncompleteFrameWarning",
    "CodecError",
    "ConvertInterrupted",
    "ConvertReport",
    "Dim",
    "EngineOptions",
    "Layout",
    "MultiWriter",
    "OmeOptions",
    "PipelineStalledError",
    "ResumeMismatch",
    "ShardReadError",
    "ShardReader",
    "Sink",
    "SinkFellBehindError",
    "StorageTimeoutError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreVanishedError",
    "SyntheticCamera",
    "TileShardSink",
    "TransientStorageError",
    "VerifyReport",
    "WriteCancelledError",
    "Writer",
    "WriterError",
    "WriterStats",
    "convert",
    "release_gpu_memory",
    "verify",
]
