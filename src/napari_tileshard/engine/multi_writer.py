"""Several camera streams at once: one Writer per stream, each on its own GPU, in one collection.

A lightsheet rig with two cameras records two independent streams (their own frame shapes,
dtypes and rates).  :class:`MultiWriter` gives each its own :class:`~napari_tileshard.engine.writer.Writer`
— its own staging, backend, I/O threads and GPU — and puts them in one OME-Zarr collection:

    run.ome.zarr/
        zarr.json        group: ome.bioformats2raw.layout = 3 (the collection convention that
                         ome-zarr-py, napari-ome-zarr and bioformats read); tileshard_collection.streams
                         maps each stream's name to its path
        OME/zarr.json    group: ome.series = ["0", "1", ...]
        0/               stream 0: an OME-Zarr image (multiscales named after the stream)
        1/               stream 1 ...

(``ome=False`` puts bare sharded arrays at ``0/``, ``1/`` under a plain group instead.)  The
numbered paths are what ``bioformats2raw.layout`` requires; the names live in the metadata.
The collection's ``zarr.json`` is written once every stream's Writer is set up, so it never
names an image that does not exist; each image publishes its own shape as its shards land.

Streams are appended to from any thread, one thread per stream (a camera callback each): the
Writers share nothing but the collection's root.  GPUs are dealt round-robin from ``devices``
(two streams on one GPU share it; no GPU: the CPU backend for every stream).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from ..format.array_spec import ARRAY_KEYWORDS, ArraySpec
from ..format.layout import Layout
from ..format.metadata import metadata_bytes
from ..format.ome import COLLECTION_KEY, COLLECTION_LAYOUT, stream_paths
from ..storage.sinks import Sink, check_key
from ..storage.urls import open_sink
from .backends import gpu_unavailable_reason, resolve_devices
from .options import EngineOptions, engine_options, writer_settings
from .writer import Writer, WriterError, WriterStats


def stream_devices(count: int, backend: str, devices) -> list[tuple[int] | None]:
    """The device list of each of ``count`` streams: GPUs dealt round-robin (``devices``, default
    every GPU when the backend may use one), None for the CPU backend."""
    if backend == "cpu":
        if devices is not None:
            raise ValueError(f"devices={devices!r} selects GPUs: it needs backend='gpu' or 'auto' (got 'cpu')")
        return [None] * count
    if devices is None:
        if gpu_unavailable_reason() is not None:
            return [None] * count  # auto falls back to the CPU; gpu raises its own clear error
        devices = "all"
    gpus = resolve_devices(devices)  # validates, naming the bad value
    return [(gpus[k % len(gpus)],) for k in range(count)]


def _stream_settings(
    streams: Mapping[str, Layout | ArraySpec], options: EngineOptions | None, keywords: dict
) -> tuple[dict[str, ArraySpec], EngineOptions]:
    """Each stream's ArraySpec (OME by default, named after the stream, its name in the attributes)
    and the EngineOptions they share, from the MultiWriter's arguments."""
    array = {"ome": True, **{k: v for k, v in keywords.items() if k in ARRAY_KEYWORDS}}
    engine = {k: v for k, v in keywords.items() if k not in ARRAY_KEYWORDS}
    options = engine_options(options, **engine)  # one for every stream (their GPUs are dealt later)
    specs: dict[str, ArraySpec] = {}
    for name, layout in streams.items():
        if isinstance(layout, Layout):
            spec, _ = writer_settings(layout, options, **array)
        elif isinstance(layout, ArraySpec):
            spec, _ = writer_settings(layout, options, **{k: v for k, v in array.items() if k != "ome"})
        else:
            raise TypeError(f"stream {name!r}: layout must be a Layout, got {type(layout).__name__}")
        if spec.ome is not None:
            spec = dataclasses.replace(spec, ome=dataclasses.replace(spec.ome, image_name=name))
        specs[name] = dataclasses.replace(spec, attributes={**spec.attributes, "stream": name})
    return specs, options


def _group(ome: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": {"ome": ome}}


class PrefixedSink(Sink):
    """One stream's objects under ``prefix/`` of the collection's sink (a root given as a Sink).

    A view into the parent's store, which one MultiWriter owns: ``release``, ``discard`` and
    ``cancel`` leave the parent alone (they are no-ops here).  The other streams still write
    through it, and the MultiWriter releases or discards the whole collection itself; a view
    cannot remove objects, as a Sink has no delete."""

    def __init__(self, parent: Sink, prefix: str):
        self.parent, self.prefix = parent, check_key(prefix)

    def __repr__(self):
        return f"PrefixedSink({self.parent!r}, {self.prefix!r})"

    @property
    def location(self) -> str:
        return f"{self.parent.location.rstrip('/')}/{self.prefix}"

    def write(self, key: str, buffers) -> None:
        self.parent.write(f"{self.prefix}/{check_key(key)}", buffers)


def _child(root, key: str):
    if isinstance(root, Sink):
        return PrefixedSink(root, key)
    if isinstance(root, str) and "://" in root:
        return f"{root.rstrip('/')}/{key}"
    return Path(root).expanduser() / key


class MultiWriter:
    """N independent streams into one collection at ``path``: ``streams`` maps a stream's name to
    its :class:`Layout`.  ``devices`` (``"all"`` or GPU indices) deals GPUs to streams in order;
    the other options are the Writer's and apply to every stream (``ome`` defaults to True)::

        with MultiWriter("run.ome.zarr", {"left": layout, "right": layout}, devices="all") as multi:
            multi.append("left", frames_left)      # from the left camera's thread
            multi.append("right", frames_right)    # from the right camera's thread

    ``multi.stats`` maps names to each Writer's :class:`WriterStats`; ``multi[name]`` is the
    stream's Writer (``frame_buffer()``, ``sync()``...).  :meth:`close` finishes every stream even
    when one failed, then raises the first failure.
    """

    def __init__(
        self,
        path,
        streams: Mapping[str, Layout | ArraySpec],
        options: EngineOptions | None = None,
        *,
        overwrite: bool = False,
        **keywords,
    ):
        if not isinstance(streams, Mapping) or not streams:
            raise ValueError(f"streams must map at least one stream name to a Layout, got {streams!r}")
        for name in streams:
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"stream names must be non-empty strings, got {name!r}")
        for option in ("attributes", "image_name"):
            if option in keywords:
                raise TypeError(f"MultiWriter sets {option!r} per stream itself")
        specs, options = _stream_settings(streams, options, keywords)
        self.names = list(streams)
        self.ome = all(spec.ome is not None for spec in specs.values())
        self.paths = {name: str(k) for k, name in enumerate(self.names)}
        per_stream = stream_devices(len(self.names), options.backend, options.devices)
        # The root first: it takes the overwrite decision (only a collection of ours is replaced)
        # and holds the lock, so two MultiWriters cannot interleave their streams.
        self._sink: Sink = open_sink(path, overwrite)
        self.location = self._sink.location
        # paths and URLs: each stream a store of its own (own lock); a Store or Sink: prefixes in it
        root = path if isinstance(path, (str, os.PathLike)) else self._sink
        self.writers: dict[str, Writer] = {}
        try:
            for name, devices in zip(self.names, per_stream):
                self.writers[name] = Writer(
                    _child(root, self.paths[name]), specs[name], dataclasses.replace(options, devices=devices)
                )
            self._write_collection_metadata()
        except BaseException:
            for writer in self.writers.values():
                writer.abandon()
            self._sink.discard()
            raise
        self._closed = False

    @staticmethod
    def warm_up(streams: Mapping[str, Layout | ArraySpec], options: EngineOptions | None = None, **keywords) -> None:
        """Arm each stream's GPU ahead of a :class:`MultiWriter` with the same arguments (as
        :meth:`Writer.warm_up` does for one stream): buffers, kernels and the CUDA context are then
        ready when the cameras start, instead of being prepared under their first frames.  One
        set is kept per GPU, so streams sharing a GPU warm only the last of them."""
        keywords.pop("overwrite", None)
        specs, options = _stream_settings(streams, options, keywords)
        per_stream = stream_devices(len(specs), options.backend, options.devices)
        for spec, devices in zip(specs.values(), per_stream):
            if devices is not None:
                Writer.warm_up(spec.layout, dataclasses.replace(options, devices=devices))

    def _write_collection_metadata(self) -> None:
        attributes: dict = {COLLECTION_KEY: {"streams": self.paths}}
        if self.ome:
            attributes["ome"] = {"version": "0.5", "bioformats2raw.layout": COLLECTION_LAYOUT}
            series = {"version": "0.5", "series": list(self.paths.values())}
            self._sink.write("OME/zarr.json", [metadata_bytes(_group(series))])
        root = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        self._sink.write("zarr.json", [metadata_bytes(root)])

    def __getitem__(self, name: str) -> Writer:
        try:
            return self.writers[name]
        except KeyError:
            raise KeyError(f"no stream {name!r}; the streams are {', '.join(map(repr, self.names))}") from None

    def append(self, name: str, frames) -> None:
        """Append ``frames`` to stream ``name`` (call it from that stream's thread)."""
        self[name].append(frames)

    @property
    def stats(self) -> dict[str, WriterStats]:
        return {name: writer.stats for name, writer in self.writers.items()}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish every stream (each writes its partial last shards and publishes its shape),
        then release the collection.  The first failure is raised once all are closed."""
        if self._closed:
            return
        self._closed = True
        failures: list[tuple[str, BaseException]] = []
        for name, writer in self.writers.items():
            try:
                writer.close()
            except BaseException as exc:  # noqa: BLE001 - the other streams must still be finished
                failures.append((name, exc))
        self._sink.release()
        if failures:
            name, first = failures[0]
            others = f" ({len(failures) - 1} other streams failed too)" if len(failures) > 1 else ""
            raise WriterError(f"stream {name!r} failed: {first}{others}") from first

    def abandon(self) -> None:
        """Undo the collection instead of finishing it (as :meth:`Writer.abandon` does for one
        stream): every stream's objects and the collection's own go again."""
        if self._closed:
            return
        self._closed = True
        try:
            for writer in self.writers.values():
                writer.abandon()
        finally:
            self._sink.discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return f"MultiWriter({self.location!r}, streams={self.names})"


def collection_streams(path) -> dict[str, str]:
    """``{stream name: path}`` of the collection at local ``path`` (empty if it is none)."""
    import json

    try:
        meta = json.loads((Path(path) / "zarr.json").read_text())
    except (OSError, ValueError):
        return {}
    return stream_paths(meta.get("attributes") or {}) or {}


__all__ = ["MultiWriter", "PrefixedSink", "collection_streams", "stream_devices"]
