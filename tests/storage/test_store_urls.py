"""Store URLs: the Writer takes what zarr takes, and an unknown scheme never becomes a local directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.buffer import default_buffer_prototype

import napari_tileshard
from napari_tileshard import Dim, Layout, StoreExistsError, Writer
from napari_tileshard.storage.sinks import ZarrStoreSink
from napari_tileshard.storage.urls import open_sink, resolve_store

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


def test_an_s3_url_without_obstore_names_the_s3_extra_not_s3fs(tmp_path):
    """Without obstore (and without s3fs, fsspec's fallback) an s3:// URL is refused with the
    command that installs the client this package records with, for the writer and the readers.
    A fresh interpreter, because fsspec keeps a filesystem class once any code has imported it."""
    script = """
import sys
sys.modules["obstore"] = None  # what Python does for a package that is not installed
sys.modules["s3fs"] = None
from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.storage.urls import resolve_store

layout = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
for attempt in (lambda: Writer("s3://bucket/run.zarr", layout, backend="cpu"),
                lambda: resolve_store("s3://bucket/run.zarr")):
    try:
        attempt()
    except ValueError as exc:
        print(exc)
"""
    # the package under test, wherever it is imported from (a relative PYTHONPATH would not survive cwd)
    source = str(Path(napari_tileshard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    messages = done.stdout.splitlines()
    assert len(messages) == 2, done.stdout + done.stderr
    for message in messages:
        assert "'s3'" in message and "obstore" in message
        assert "pip install obstore" in message and 'pip install -e ".[s3]"' in message
        assert "s3fs" not in message  # fsspec's "Install s3fs to access S3" is not the advice
    assert list(tmp_path.iterdir()) == []


def test_a_private_memory_store_is_written_inline_with_the_same_objects():
    """``memory://``'s MemoryStore is the sink's alone: its coroutines run on the writing thread
    (no round trip through zarr's event loop per shard), and the objects are those of a
    recording into a caller's MemoryStore, written through zarr's loop."""
    from napari_tileshard.storage._zarr_sync import run_inline

    def objects(store) -> dict:
        async def collect():
            prototype = default_buffer_prototype()
            return {key: (await store.get(key, prototype)).to_bytes() async for key in store.list()}

        return asyncio.run(collect())

    private = open_sink("memory://")
    shared = zarr.storage.MemoryStore()
    for target in (private, shared):
        with Writer(target, LAYOUT, backend="cpu") as writer:
            writer.append(FRAMES)
    assert objects(private.store) == objects(shared)
    np.testing.assert_array_equal(zarr.open_array(private.store, mode="r")[:], FRAMES)

    async def steps():
        await asyncio.sleep(0)  # a bare yield: stepped over
        return 7

    async def waits():
        await asyncio.sleep(0.01)  # a timer: needs a running loop

    assert run_inline(steps()) == 7
    with pytest.raises(RuntimeError):
        run_inline(waits())
