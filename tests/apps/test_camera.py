import time

import numpy as np
import pytest

from napari_tileshard import SyntheticCamera


def test_deterministic_for_a_seed():
    a = SyntheticCamera((64, 48), "uint16", seed=3).stack(10)
    b = SyntheticCamera((64, 48), "uint16", seed=3).stack(10)
    c = SyntheticCamera((64, 48), "uint16", seed=4).stack(10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_frames_look_like_fluorescence():
    frames = SyntheticCamera((256, 256), "uint16", seed=0).stack(8).astype(np.float64)
    frame = frames[0]
    assert 80 < np.median(frame) < 400  # a background level, not zeros
    assert frame.max() > 5 * np.median(frame)  # bright spots
    assert len({tuple(f.ravel()[:64]) for f in frames}) == 8  # frames differ (noise, blinking)
    # Poisson-like: temporal variance ~ mean in the background.
    mean, var = frames.mean(axis=0), frames.var(axis=0, ddof=1)
    background = mean < np.percentile(mean, 50)
    assert 0.5 < np.median(var[background] / mean[background]) < 2.0
    # Smooth background: far from uniform noise (neighbouring pixels correlate through the signal).
    assert np.corrcoef(mean[:, :-1].ravel(), mean[:, 1:].ravel())[0, 1] > 0.5


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32", "uint64"])
def test_dtypes(dtype):
    frame = SyntheticCamera((32, 32), dtype, seed=1).frame(0)
    assert frame.dtype == np.dtype(dtype) and frame.std() > 0


def test_fps_paces_the_stream():
    camera = SyntheticCamera((16, 16), "uint16", fps=50)
    start = time.perf_counter()
    assert len(list(camera.frames(11))) == 11
    assert time.perf_counter() - start >= 0.19


def test_fast_when_unpaced():
    camera = SyntheticCamera((1024, 1024), "uint16", seed=0)
    camera.prepare()
    start = time.perf_counter()
    n = sum(f.nbytes for f in camera.frames(2000))
    assert n / (time.perf_counter() - start) > 5e9  # replayed from the bank, >= 5 GB/s


@pytest.mark.parametrize("bad", [dict(shape=(0, 4)), dict(shape=(4, 4), fps=0), dict(shape=(4, 4), fps=float("nan"))])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        SyntheticCamera(**bad)


def test_frames_rendered_on_threads_or_in_the_background_equal_those_rendered_in_order():
    """Frame i depends on the seed and i alone, whichever thread renders it and when (banks of
    different sizes are different banks, so each is rendered here its own way)."""
    in_order = SyntheticCamera((96, 80), "uint16", seed=5, bank_frames=8)
    expected = [in_order.frame(i) for i in range(8)]
    threaded = SyntheticCamera((96, 80), "uint16", seed=5, bank_frames=9)
    threaded.prepare(threads=3)
    assert threaded.prepared and threaded.rendered == 9
    background = SyntheticCamera((96, 80), "uint16", seed=5, bank_frames=10)
    background.render_in_background(threads=2)
    for i, frame in enumerate(expected):
        np.testing.assert_array_equal(threaded.frame(i), frame)
        np.testing.assert_array_equal(background.frame(i), frame)


def test_cameras_of_the_same_parameters_share_one_bank():
    """What the recorder dock renders before Start is what the recording's camera replays."""
    ahead = SyntheticCamera((64, 48), "uint16", seed=2)
    ahead.prepare()
    later = SyntheticCamera((64, 48), "uint16", seed=2, fps=100)
    assert later.prepared and later.frame(3) is ahead.frame(3)
    assert not SyntheticCamera((64, 48), "uint16", seed=3).prepared


def test_rendering_in_the_background_returns_at_once_and_renders_only_the_frames_asked_for():
    camera = SyntheticCamera((512, 512), "uint16", seed=11)
    camera.render_in_background(frames=4, threads=1)
    assert not camera.prepared  # 64 frames of 512x512 take far longer than returning
    assert len(list(camera.frames(4))) == 4  # each waited for as it is rendered
    time.sleep(0.2)
    assert camera.rendered == 4
