"""An offline Micro-Manager stack for examples, tests and benchmarks: a ``UniMMCore`` with pure-Python
devices (camera, Z stage, XY stage), a ``Channel`` group and a pixel size, no Micro-Manager
installation needed.

The camera's frames come from :class:`~napari_tileshard.apps.camera.SyntheticCamera` (fluorescence-like
spots on a background, shot and read noise).  Importing this module imports pymmcore-plus (the
``mmcore`` extra); nothing else in the package does so at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

_root_level = logging.getLogger().level
from pymmcore_plus.experimental.unicore import (  # noqa: E402 (the root level is read before)
    ShutterDevice,
    SimpleCameraDevice,
    StageDevice,
    UniMMCore,
    XYStageDevice,
)

from ..camera import SyntheticCamera  # noqa: E402

# pymmcore-plus sets the root logger to DEBUG when imported (its _logger.configure_logging), which
# makes every library's debug records get formatted (botocore's then raise); put it back.
logging.getLogger().setLevel(_root_level)

__all__ = [
    "DEFAULT_CHANNELS",
    "PythonShutter",
    "PythonXYStage",
    "PythonZStage",
    "SyntheticCameraDevice",
    "demo_core",
]

DEFAULT_CHANNELS = {"DAPI": 10.0, "FITC": 20.0}  # preset name -> exposure in ms


class SyntheticCameraDevice(SimpleCameraDevice):
    """A Micro-Manager camera whose ``n``-th snap is ``SyntheticCamera.frame(n)``."""

    def __init__(self, shape=(512, 512), dtype="uint16", seed: int = 0, bank_frames: int | None = None):
        super().__init__()
        self.camera = SyntheticCamera(shape=shape, dtype=dtype, seed=seed, bank_frames=bank_frames)
        self._exposure_ms = 10.0
        self.snaps = 0

    def sensor_shape(self) -> tuple[int, int]:
        height, width = self.camera.shape
        return (height, width)

    def dtype(self):
        return self.camera.dtype

    def get_exposure(self) -> float:
        return self._exposure_ms

    def set_exposure(self, exposure: float) -> None:
        self._exposure_ms = float(exposure)

    def snap(self, buffer: np.ndarray) -> Mapping:
        buffer[...] = self.camera.frame(self.snaps)
        self.snaps += 1
        return {}


class _InstantStage:
    """What a stage that moves instantly does on home/stop/origin: nothing to wait for."""

    def home(self) -> None:
        self.set_origin()

    def stop(self) -> None:
        pass

    def set_origin(self) -> None:
        raise NotImplementedError


class PythonZStage(_InstantStage, StageDevice):
    """A focus drive that moves instantly."""

    def __init__(self) -> None:
        super().__init__()
        self._z = 0.0

    def set_position_um(self, val: float) -> None:
        self._z = float(val)

    def get_position_um(self) -> float:
        return self._z

    def set_origin(self) -> None:
        self._z = 0.0


class PythonXYStage(_InstantStage, XYStageDevice):
    """An XY stage that moves instantly."""

    def __init__(self) -> None:
        super().__init__()
        self._xy = (0.0, 0.0)

    def set_position_um(self, x: float, y: float) -> None:
        self._xy = (float(x), float(y))

    def get_position_um(self) -> tuple[float, float]:
        return self._xy

    def set_origin_x(self) -> None:
        self._xy = (0.0, self._xy[1])

    def set_origin_y(self) -> None:
        self._xy = (self._xy[0], 0.0)

    def set_origin(self) -> None:
        self._xy = (0.0, 0.0)


class PythonShutter(ShutterDevice):
    """A light-path shutter that opens instantly."""

    def __init__(self) -> None:
        super().__init__()
        self._open = False

    def get_open(self) -> bool:
        return self._open

    def set_open(self, open: bool) -> None:
        self._open = bool(open)


def demo_core(
    shape=(256, 256),
    dtype="uint16",
    *,
    pixel_size_um: float = 0.65,
    channels: Mapping[str, float] | None = None,
    seed: int = 0,
    bank_frames: int | None = None,
) -> UniMMCore:
    """A ``UniMMCore`` with a ``Camera`` (:class:`SyntheticCameraDevice`), a ``Z`` focus stage, an
    ``XY`` stage, a ``Channel`` group whose presets set the exposure (``channels``: name -> ms)
    and a pixel size.  Runs offline: pymmcore-plus logs that no Micro-Manager installation was
    found, and acquires anyway."""
    core = UniMMCore()
    for label, device in (
        ("Camera", SyntheticCameraDevice(shape, dtype, seed=seed, bank_frames=bank_frames)),
        ("Z", PythonZStage()),
        ("XY", PythonXYStage()),
        ("Shutter", PythonShutter()),
    ):
        core.loadPyDevice(label, device)
        core.initializeDevice(label)
    core.setCameraDevice("Camera")
    core.setFocusDevice("Z")
    core.setXYStageDevice("XY")
    core.setShutterDevice("Shutter")
    for name, exposure_ms in (channels or DEFAULT_CHANNELS).items():
        core.defineConfig("Channel", name, "Camera", "Exposure", str(exposure_ms))
    core.setChannelGroup("Channel")
    # The C++ core validates pixel size configs against its own devices, so this one keys on a
    # property of the Core itself.
    core.definePixelSizeConfig("px", "Core", "AutoShutter", "1")
    core.setPixelSizeUm("px", pixel_size_um)
    core.setPixelSizeConfig("px")
    return core
