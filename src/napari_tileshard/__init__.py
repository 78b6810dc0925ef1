"""napari-tileshard: stream microscope frames into sharded Zarr v3 arrays, on the GPU or the CPU."""

from .backends import release_gpu_memory
from .camera import SyntheticCamera
from .layout import MAX_RANK, SUPPORTED_DTYPES, Dim, Layout
from .multi_writer import MultiWriter
from .read import ShardReader
from .store import Sink, StoreExistsError, StoreLockedError, StoreVanishedError
from .verify import VerifyReport, verify
from .writer import Writer, WriterError, WriterStats

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
