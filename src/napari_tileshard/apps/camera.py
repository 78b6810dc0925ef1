"""A deterministic synthetic microscope camera.

Frames look like fluorescence images: a smooth background (a few broad Gaussian blobs),
bright diffraction-limited spots that blink and drift, and shot noise (Gaussian approximation
of Poisson noise, mean = variance) plus read noise.  A bank of distinct frames is rendered once
and replayed, so the camera can feed the writer at memory speed; ``fps`` paces it like a real
camera.  Frame ``i`` depends only on the seed and ``i``, whichever thread renders it and when.

The bank is rendered on demand (the frame asked for), all at once on several threads
(:meth:`SyntheticCamera.prepare`), or in the background while frames are already taken
(:meth:`SyntheticCamera.render_in_background`: a frame not rendered yet is waited for).  Cameras
of the same shape, dtype, seed and bank size share one bank in a process (the newest one stays
cached), so a bank rendered ahead of a recording (the recorder dock does so when its settings
change) serves the recording's camera at once.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref

import numpy as np

__all__ = ["SyntheticCamera"]

_BANK_BYTES = 512 << 20  # >= 48 frames of 2304x2304: longer than any tile depth used here
_MAX_BANK_FRAMES = 64
#: threads that render a bank (NumPy releases the GIL in the per-pixel work, so they scale)
_RENDER_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
_RENDERING = object()  # a bank slot another thread is rendering


class _Bank:
    """The frames of one (shape, dtype, seed, bank size), shared by the cameras that use it."""

    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _newest: _Bank | None = None  # kept while no camera holds it: a bank rendered ahead stays
    _registry_lock = threading.Lock()

    def __init__(self, key: tuple):
        self.key = key
        shape, dtype, seed, frames = key
        self.shape, self.dtype, self.seed = shape, np.dtype(dtype), seed
        self.slots: list = [None] * frames  # None, _RENDERING or the frame
        self.ready = 0
        self.changed = threading.Condition()
        self.background: threading.Thread | None = None
        self._scene: dict | None = None
        self._scene_lock = threading.Lock()

    @classmethod
    def of(cls, key: tuple) -> _Bank:
        with cls._registry_lock:
            bank = cls._live.get(key)
            if bank is None:
                bank = cls._live[key] = cls(key)
            cls._newest = bank
            return bank

    def frame(self, slot: int) -> np.ndarray:
        """The frame of ``slot``, rendered now unless another thread is rendering it (then waited for)."""
        with self.changed:
            while True:
                frame = self.slots[slot]
                if frame is None:
                    self.slots[slot] = _RENDERING
                    break
                if frame is not _RENDERING:
                    return frame
                self.changed.wait()
        return self._render_into(slot)

    def _render_into(self, slot: int) -> np.ndarray:
        try:
            frame = _render(self.scene(), self.shape, self.dtype, self.seed, slot)
        except BaseException:
            with self.changed:
                self.slots[slot] = None  # someone else may try again
                self.changed.notify_all()
            raise
        with self.changed:
            self.slots[slot] = frame
            self.ready += 1
            self.changed.notify_all()
        return frame

    def claim(self, limit: int) -> int | None:
        """A slot below ``limit`` nobody renders yet, now marked as being rendered (None when there is none)."""
        with self.changed:
            for slot, frame in enumerate(self.slots[:limit]):
                if frame is None:
                    self.slots[slot] = _RENDERING
                    return slot
        return None

    def render_all(self, threads: int, limit: int | None = None) -> None:
        """Render every slot (below ``limit``) not rendered yet on ``threads`` threads; returns
        when they are all ready."""
        limit = len(self.slots) if limit is None else min(limit, len(self.slots))

        def work() -> None:
            while (slot := self.claim(limit)) is not None:
                self._render_into(slot)

        def done() -> bool:
            return all(frame is not None and frame is not _RENDERING for frame in self.slots[:limit])

        self.scene()  # once, before the threads need it
        # Daemon threads (not a ThreadPoolExecutor, whose threads the interpreter joins at exit):
        # a recording interrupted while the bank renders exits at once.
        for number in range(1, threads):
            threading.Thread(target=work, name=f"tileshard-camera-render-{number}", daemon=True).start()
        while True:
            work()
            with self.changed:  # slots other threads are still rendering (or gave up: render them here)
                self.changed.wait_for(lambda: done() or any(frame is None for frame in self.slots[:limit]))
                if done():
                    return

    def scene(self) -> dict:
        with self._scene_lock:
            if self._scene is None:
                self._scene = _scene_parameters(self.shape, self.seed)
            return self._scene


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
        self._bank = _Bank.of((self.shape, self.dtype.str, self.seed, self.bank_frames))

    def __repr__(self):
        return f"SyntheticCamera(shape={self.shape}, dtype={self.dtype.name!r}, seed={self.seed}, fps={self.fps})"

    @property
    def frame_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rendered(self) -> int:
        """Frames of the bank rendered so far (of :attr:`bank_frames`)."""
        return self._bank.ready

    @property
    def prepared(self) -> bool:
        """Whether the whole bank is rendered: frames now come at memory speed."""
        return self._bank.ready == self.bank_frames

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` of the stream (read-only; frames repeat every ``bank_frames``)."""
        return self._bank.frame(index % self.bank_frames)

    def prepare(self, threads: int | None = None) -> None:
        """Render the whole frame bank now, on ``threads`` threads (default: up to 8, one core
        left free); it is otherwise rendered on first use."""
        self._bank.render_all(threads or _RENDER_THREADS)

    def render_in_background(self, frames: int | None = None, threads: int | None = None) -> None:
        """Start rendering the bank (its first ``frames`` frames, when only those will be taken) on
        threads of its own and return at once: :meth:`frame` waits only for a frame that is not
        rendered yet.  Harmless when the bank is (being) rendered."""
        bank = self._bank
        with bank.changed:
            if bank.background is not None or bank.ready == len(bank.slots):
                return
            bank.background = threading.Thread(
                target=bank.render_all,
                args=(threads or _RENDER_THREADS, frames),
                name="tileshard-camera-bank",
                daemon=True,
            )
        bank.background.start()

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


# -- rendering: frame ``index`` from the seed alone -------------------------------------
_SPOT_RADIUS = 4
_SPOT_KERNEL = np.exp(-(np.arange(-_SPOT_RADIUS, _SPOT_RADIUS + 1).astype(np.float32) ** 2) / np.float32(2 * 1.5**2))


def _scene_parameters(shape: tuple[int, ...], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    background = np.full(shape, 100.0, dtype=np.float32)
    for _ in range(4):  # broad blobs; separable, so an outer product of 1-D Gaussians
        blob = np.float32(rng.uniform(20, 80))
        for axis, n in enumerate(shape):
            x = np.linspace(0, 1, n, dtype=np.float32) - np.float32(rng.uniform(0, 1))
            profile = np.exp(-(x * x) / np.float32(2 * rng.uniform(0.2, 0.6) ** 2))
            blob = blob * profile.reshape([-1 if a == axis else 1 for a in range(len(shape))])
        background += blob
    n_spots = max(3, math.prod(shape) // 4000)
    return {
        "background": background,
        "spots": rng.uniform(0, 1, (n_spots, len(shape))),
        "brightness": rng.lognormal(6.0, 0.6, n_spots).astype(np.float32),
        "drift": rng.normal(0, 0.3, (n_spots, len(shape))),
    }


def _render(scene: dict, shape: tuple[int, ...], dtype: np.dtype, seed: int, index: int) -> np.ndarray:
    rng = np.random.default_rng((seed, index))
    signal = scene["background"].copy()
    positions = scene["spots"] * np.array(shape) + scene["drift"] * index
    on = rng.random(len(positions)) < 0.9  # blinking
    _add_spots(signal, np.rint(positions[on]).astype(int), scene["brightness"][on])
    # Shot noise (variance = signal) and read noise (sigma 2) in one Gaussian draw.
    noise = rng.standard_normal(shape, dtype=np.float32)
    spread = np.add(signal, np.float32(4.0))
    noise *= np.sqrt(spread, out=spread)
    signal += noise
    return _to_dtype(signal, dtype)


def _add_spots(signal: np.ndarray, centres: np.ndarray, brightness: np.ndarray) -> None:
    """Add a Gaussian spot of ``brightness`` around each centre, spot after spot (the float32 sums
    of overlapping spots in that order), clipped at the edges: one ``np.add.at`` for all spots."""
    rank = signal.ndim
    width = 2 * _SPOT_RADIUS + 1
    offsets = np.indices((width,) * rank).reshape(rank, -1).T - _SPOT_RADIUS  # (width**rank, rank)
    points = centres[:, None, :] + offsets[None, :, :]  # (spots, width**rank, rank)
    inside = np.all((points >= 0) & (points < np.array(signal.shape)), axis=2)
    # The spot's values: brightness times each axis's kernel, multiplied axis by axis in float32.
    spot: np.ndarray = brightness.astype(np.float32).reshape((-1,) + (1,) * rank)
    for axis in range(rank):
        spot = spot * _SPOT_KERNEL.reshape([1] + [-1 if a == axis else 1 for a in range(rank)])
    values = spot.reshape(len(centres), -1)
    flat = np.ravel_multi_index(tuple(points[inside].T), signal.shape)
    np.add.at(signal.reshape(-1), flat, values[inside])


def _to_dtype(image: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        out = image.astype(dtype)
    else:
        info = np.iinfo(dtype)
        if info.max < 1000:  # 8-bit cameras: scale the ~100..2000 photon range down
            image = image / 8.0
        rounded = np.rint(image, out=image)
        out = np.clip(rounded, info.min, info.max, out=rounded).astype(dtype)
    out.flags.writeable = False
    return out
