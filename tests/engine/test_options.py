"""The settings objects: ArraySpec (what is written) and EngineOptions (how), validated once, and
the one place the Writer's keyword shorthand becomes them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from napari_tileshard import Dim, Layout, MultiWriter, Writer
from napari_tileshard.engine.options import EngineOptions, normalize_devices, writer_settings
from napari_tileshard.format.array_spec import ArraySpec, OmeOptions
from napari_tileshard.format.codecs import Zstd

LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")


def test_array_spec_resolves_the_codec_once_and_validates_everything():
    spec = ArraySpec.of(LAYOUT, "zstd", 3, ome=True, downsample="max", attributes={"sample": "beads"})
    assert isinstance(spec.codec, Zstd) and spec.codec.level == 3 and spec.codec.typesize == 2
    assert spec.ome == OmeOptions(downsample="max") and spec.pyramid.levels >= 1
    assert spec.attributes == {"sample": "beads"}
    with pytest.raises(ValueError, match="zstd level must be in -7..22, got 99"):
        ArraySpec.of(LAYOUT, "zstd", 99)
    with pytest.raises(ValueError, match="codec 'lzma' is not one of"):
        ArraySpec.of(LAYOUT, "lzma")
    with pytest.raises(ValueError, match="downsample 'median' is not one of"):
        ArraySpec.of(LAYOUT, ome=True, downsample="median")
    with pytest.raises(ValueError, match="NaN"):
        ArraySpec.of(LAYOUT, attributes={"x": float("nan")})
    with pytest.raises(TypeError, match="codec must be a codec object"):
        ArraySpec(LAYOUT, "zstd")  # type: ignore[arg-type]
    flat = Layout([Dim("x", 64, 16, 2)], "uint8")
    with pytest.raises(ValueError, match="pyramid"):
        ArraySpec.of(flat, ome=True)  # refused when the spec is made, not when recording starts


def test_engine_options_validate_and_name_the_value():
    assert EngineOptions().backend == "auto" and EngineOptions().io_timeout == 60.0
    for bad, message in [
        ({"backend": "tpu"}, "backend 'tpu' is not one of"),
        ({"io_threads": 0}, "io_threads must be a positive integer, got 0"),
        ({"io_dispatch": "random"}, "io_dispatch must be one of"),
        ({"io_timeout": -1}, "io_timeout must be a positive number of seconds or None, got -1"),
        ({"staging_buffers": 1}, "staging_buffers must be an integer >= 2, got 1"),
        ({"devices": [0], "backend": "cpu"}, r"devices=\[0\] selects GPUs"),
        ({"devices": [0, -1]}, r"GPU numbers, got \[0, -1\]"),
        ({"max_latency_s": float("inf")}, "max_latency_s must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineOptions(**bad)
    with pytest.raises(TypeError, match="io_telemetry_lost must be a callable"):
        EngineOptions(io_telemetry_lost=3)  # type: ignore[arg-type]
    assert normalize_devices(2) == (0, 1) and normalize_devices("all") == "all" and normalize_devices([1]) == (1,)


def test_the_keyword_shorthand_becomes_the_same_objects():
    spec, options = writer_settings(LAYOUT, codec="blosc-lz4", level=5, backend="cpu", io_threads=2)
    assert spec == ArraySpec.of(LAYOUT, "blosc-lz4", 5) and options == EngineOptions(backend="cpu", io_threads=2)
    with pytest.raises(TypeError, match="unknown writer option tile_size"):
        writer_settings(LAYOUT, tile_size=4)
    with pytest.raises(TypeError, match="codec given with an ArraySpec"):
        writer_settings(spec, codec="zstd")
    with pytest.raises(TypeError, match="backend given with EngineOptions"):
        writer_settings(LAYOUT, options, backend="gpu")


def test_writer_and_multiwriter_take_the_objects(tmp_path):
    frames = np.arange(4 * 32 * 32, dtype=np.uint16).reshape(4, 32, 32)
    spec, options = ArraySpec.of(LAYOUT, "zstd", 1), EngineOptions(backend="cpu", io_threads=1)
    with Writer(tmp_path / "a.zarr", spec, options) as writer:
        writer.append(frames)
    with Writer(tmp_path / "b.zarr", LAYOUT, codec="zstd", level=1, backend="cpu", io_threads=1) as shorthand:
        shorthand.append(frames)
    a = (tmp_path / "a.zarr" / "c" / "0" / "0" / "0").read_bytes()
    assert a == (tmp_path / "b.zarr" / "c" / "0" / "0" / "0").read_bytes()
    assert writer.spec == shorthand.spec and writer.options == shorthand.options
    with MultiWriter(tmp_path / "m.zarr", {"left": LAYOUT, "right": spec.with_layout(LAYOUT)}, options) as multi:
        multi.append("left", frames)
        multi.append("right", frames)
    assert multi["left"].spec.ome is not None  # a collection's images are OME by default
    assert multi["right"].spec.ome is None and multi["right"].spec.attributes == {"stream": "right"}
    assert dataclasses.replace(options, devices=None) == multi["left"].options
