"""Store URLs: the Writer takes what zarr takes, and an unknown scheme never becomes a local directory."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, StoreExistsError, Writer
from napari_tileshard.store import ZarrStoreSink, open_sink, resolve_store

LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
FRAMES = np.arange(4 * 64, dtype=np.uint16).reshape(4, 8, 8)


def test_file_url_is_a_local_directory_with_its_protections(tmp_path):
    url = (tmp_path / "u.zarr").as_uri()
    with Writer(url, LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "u.zarr", mode="r")[:], FRAMES)
    (tmp_path / "u.zarr" / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError, match="notes.txt"):
        Writer(url, LAYOUT, backend="cpu", overwrite=True)
    assert (tmp_path / "u.zarr" / "notes.txt").exists()


def test_memory_url_and_store_objects(tmp_path):
    assert isinstance(open_sink("memory://rec"), ZarrStoreSink)
    store = zarr.storage.MemoryStore()
    with Writer(store, LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    np.testing.assert_array_equal(zarr.open_array(store, mode="r")[:], FRAMES)


def test_unknown_scheme_is_an_error_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no installed store handles 'nosuch' URLs"):
        Writer("nosuch://bucket/x.zarr", LAYOUT, backend="cpu")
    with pytest.raises(ValueError, match="'nosuch'"):
        resolve_store("nosuch://bucket/x.zarr")
    assert list(tmp_path.iterdir()) == []  # no ./nosuch:/bucket/x.zarr
