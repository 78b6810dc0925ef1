"""napari-tileshard: stream microscope frames into sharded Zarr v3 arrays, on the GPU or the CPU."""

from .apps.camera import SyntheticCamera
from .apps.verify import VerifyReport, verify
from .engine.backends.gpu import release_gpu_memory
from .engine.multi_writer import MultiWriter
from .engine.writer import Writer, WriterError, WriterStats
from .format.layout import MAX_RANK, SUPPORTED_DTYPES, Dim, Layout
from .reader.shard_reader import ShardReader
from .storage.errors import StoreExistsError, StoreLockedError, StoreVanishedError
from .storage.sinks import Sink

__version__ = "0.1.0"

__all__ = [
    "Dim",
    "Layout",
    "Writer",
    "MultiWriter",
    "ShardReader",
    "WriterError",
    "WriterStats",
    "SyntheticCamera",
    "verify",
    "VerifyReport",
    "MAX_RANK",
    "SUPPORTED_DTYPES",
    "Sink",
    "StoreExistsError",
    "StoreLockedError",
    "StoreVanishedError",
    "release_gpu_memory",
]
