"""The napari reader claims Zarr stores only: its manifest patterns name stores (never "*"), and
``napari_get_reader`` answers None for everything that is not one, so other readers get their turn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.apps.napari_reader import napari_get_reader

npe2 = pytest.importorskip("npe2")

MANIFEST = Path(__file__).resolve().parents[2] / "src" / "napari_tileshard" / "napari.yaml"


@pytest.fixture(scope="module")
def readers():
    """npe2's own matching of paths to readers, with only this plugin registered."""
    manager = npe2.PluginManager()
    manager.register(npe2.PluginManifest.from_file(MANIFEST))
    return lambda path: [r.command for r in manager.iter_compatible_readers(str(path))]


def test_the_manifest_claims_zarr_stores_not_every_file(readers, tmp_path):
    (reader,) = npe2.PluginManifest.from_file(MANIFEST).contributions.readers
    assert "*" not in reader.filename_patterns and reader.accepts_directories
    ours = ["napari-tileshard.get_reader"]
    for path in ("run.zarr", "run.ome.zarr", "RUN.ZARR", "s3://bucket/run.ome.zarr", "s3://bucket/run.ome.zarr/0"):
        assert readers(path) == ours, path
    for path in ("cells.tif", "notes.txt", "movie.nd2", "s3://bucket/cells.tif"):
        assert readers(path) == [], path
    assert readers(tmp_path) == ours  # directories: offered whatever their name; napari_get_reader decides


def test_napari_get_reader_takes_a_zarr_store_and_nothing_else(tmp_path):
    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 8, 8, 1), Dim("x", 8, 8, 1)], "uint8")
    store = tmp_path / "recording"  # a store not named .zarr is still one
    with Writer(store, layout, backend="cpu") as writer:
        writer.append(np.ones((8, 8), np.uint8))
    assert napari_get_reader(str(store)) is not None
    assert napari_get_reader(store) is not None and napari_get_reader([str(store)]) is not None

    (tmp_path / "cells.tif").write_bytes(b"II*\x00")
    (tmp_path / "file.zarr").write_text("not a directory")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "image.png").write_bytes(b"\x89PNG")
    v2 = tmp_path / "v2.zarr"
    v2.mkdir()
    (v2 / ".zgroup").write_text('{"zarr_format": 2}')
    broken = tmp_path / "broken.zarr"
    broken.mkdir()
    (broken / "zarr.json").write_text("{not json")
    declined = [
        tmp_path / "cells.tif",
        tmp_path / "file.zarr",
        plain,
        v2,
        broken,
        tmp_path / "missing.zarr",
        "https://example.org/data.zarr",
        [str(store), str(store)],  # a stack of stores is not one store
        None,
    ]
    for path in declined:
        assert napari_get_reader(str(path) if isinstance(path, Path) else path) is None, path
