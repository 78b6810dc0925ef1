"""A deterministic synthetic microscope camera.

Frames look like fluorescence images: a smooth background (a few broad Gaussian blobs),
bright diffraction-limited spots that blink and drift, and shot noise (Gaussian approximation
of Poisson noise, mean = variance) plus read noise.  A bank of distinct frames is generated
once, lazily, and replayed, so the camera can feed the writer at memory speed; ``fps`` paces
it like a real camera.
"""

from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["SyntheticCamera"]

_BANK_BYTES = 512 << 20  # >= 48 frames of 2304x2304: longer than any tile depth used here
_MAX_BANK_FRAMES = 64


class SyntheticCamera:
    def __init__(
        self,
        shape=(2048, 2048),
        dtype="uint16",
        seed: int = 0,
        fps: float | None = None,
        bank_frames: int | None = None,
    ):
        shape = tuple(int(s) for s in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"camera frame shape must have positive sizes, got {shape}")
        if fps is not None and not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive number or None, got {fps!r}")
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.seed = int(seed)
        self.fps = fps
        frame_bytes = math.prod(shape) * self.dtype.itemsize
        self.bank_frames = bank_frames or int(max(4, min(_MAX_BANK_FRAMES, _BANK_BYTES // frame_bytes)))
        self._bank: list[np.ndarray] = []
        self._scene: dict | None = None

    def __repr__(self):
        return f"SyntheticCamera(shape={self.shape}, dtype={self.dtype.name!r}, seed={self.seed}, fps={self.fps})"

    @property
    def frame_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` of the stream (read-only; frames repeat every ``bank_frames``)."""
        slot = index % self.bank_frames
        while len(self._bank) <= slot:  # render in order so every frame depends on seed and index only
            self._bank.append(self._render(len(self._bank)))
        return self._bank[slot]

    def prepare(self) -> None:
        """Render the whole frame bank now (it is otherwise rendered on first use)."""
        self.frame(self.bank_frames - 1)

    def frames(self, n: int | None = None):
        """Yield ``n`` frames (forever if None), paced at ``fps`` when set."""
        start = time.perf_counter()
        index = 0
        while n is None or index < n:
            if self.fps:
                delay = start + index / self.fps - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            yield self.frame(index)
            index += 1

    def stack(self, n: int) -> np.ndarray:
        """The first ``n`` frames as one array (for tests and references)."""
        return np.stack([self.frame(i) for i in range(n)]) if n else np.empty((0,) + self.shape, self.dtype)

    # -- rendering ---------------------------------------------------------------------
    def _scene_parameters(self):
        if self._scene is None:
            rng = np.random.default_rng(self.seed)
            background = np.full(self.shape, 100.0, dtype=np.float32)
            for _ in range(4):  # broad blobs; separable, so an outer product of 1-D Gaussians
                blob = np.float32(rng.uniform(20, 80))
                for axis, n in enumerate(self.shape):
                    x = np.linspace(0, 1, n, dtype=np.float32) - np.float32(rng.uniform(0, 1))
                    profile = np.exp(-(x * x) / np.float32(2 * rng.uniform(0.2, 0.6) ** 2))
                    blob = blob * profile.reshape([-1 if a == axis else 1 for a in range(len(self.shape))])
                background += blob
            n_spots = max(3, math.prod(self.shape) // 4000)
            self._scene = {
                "background": background,
                "spots": rng.uniform(0, 1, (n_spots, len(self.shape))),
                "brightness": rng.lognormal(6.0, 0.6, n_spots).astype(np.float32),
                "drift": rng.normal(0, 0.3, (n_spots, len(self.shape))),
            }
        return self._scene

    def _render(self, index: int) -> np.ndarray:
        scene = self._scene_parameters()
        rng = np.random.default_rng((self.seed, index))
        signal = scene["background"].copy()
        positions = scene["spots"] * np.array(self.shape) + scene["drift"] * index
        on = rng.random(len(positions)) < 0.9  # blinking
        offsets = np.arange(-4, 5)
        kernel_1d = np.exp(-(offsets.astype(np.float32) ** 2) / np.float32(2 * 1.5**2))
        for position, brightness in zip(positions[on], scene["brightness"][on]):
            centre = np.rint(position).astype(int)
            region = tuple(slice(max(0, c - 4), min(n, c + 5)) for c, n in zip(centre, self.shape))
            if any(r.stop <= r.start for r in region):
                continue
            spot = np.float32(brightness)
            for axis, (c, r) in enumerate(zip(centre, region)):
                profile = kernel_1d[r.start - (c - 4) : r.stop - (c - 4)]
                spot = spot * profile.reshape([-1 if a == axis else 1 for a in range(len(self.shape))])
            signal[region] += spot
        # Shot noise (variance = signal) and read noise (sigma 2) in one Gaussian draw.
        noise = rng.standard_normal(self.shape, dtype=np.float32)
        noise *= np.sqrt(signal + np.float32(4.0))
        signal += noise
        return _to_dtype(signal, self.dtype)


def _to_dtype(image: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        out = image.astype(dtype)
    else:
        info = np.iinfo(dtype)
        if info.max < 1000:  # 8-bit cameras: scale the ~100..2000 photon range down
            image = image / 8.0
        out = np.clip(np.rint(image), info.min, info.max).astype(dtype)
    out.flags.writeable = False
    return out
