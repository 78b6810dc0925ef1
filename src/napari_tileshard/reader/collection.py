"""The images of an OME-Zarr collection (``bioformats2raw.layout``), opened for reading.

A collection's root is a group of images, not an image: ``0/``, ``1/``, ... are OME-Zarr images
(or, from ``MultiWriter(..., ome=False)``, bare arrays) and the ``OME`` group beside them lists
them (``ome.series``).  Other nodes may sit beside the images (a :class:`TileShardSink` keeps its
per-frame metadata tables in ``frame_metadata`` and ``frame_metadata_json``): they are not images
and are never listed as such.

Where the images are, first found first:

1. a :class:`~napari_tileshard.engine.multi_writer.MultiWriter` root names its streams
   (``tileshard_collection.streams``: name -> path);
2. the ``OME`` group's series list (``OME/zarr.json``; OME-NGFF 0.4: ``OME/.zattrs``);
3. otherwise, as the layout prescribes, ``0``, ``1``, ... for as long as they exist.

Every ``zarr.json`` is read through :mod:`~napari_tileshard.storage.safe_read`, as everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zarr

from ..format.ome import SERIES_GROUP, image_name, is_bioformats2raw, series_paths, stream_paths
from ..storage.safe_read import StoreAccess
from .levels import _levels

__all__ = ["MAX_COLLECTION_IMAGES", "CollectionImage", "collection_images", "images_of", "non_image_nodes"]

#: the most images a collection may list (a hostile series list must not open a million nodes)
MAX_COLLECTION_IMAGES = 10_000


@dataclass
class CollectionImage:
    """One image of a collection.

    ``name``: the stream's name, else the name the image gives itself (its multiscale's ``name``),
    else ``series <path>``; ``named``: whether that name came from the store (not made up here).
    ``levels``: its arrays, highest resolution first (one for a bare array), or None when it
    cannot be opened (``error`` says why).  ``attributes``: the image group's attributes."""

    name: str
    path: str
    levels: list | None
    named: bool = True
    error: str | None = None
    attributes: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.levels is not None


def collection_images(location) -> list[CollectionImage] | None:
    """The images of the collection at ``location`` (a path, URL, zarr Store or
    :class:`StoreAccess`), or None when it is no collection (an array, an OME-Zarr image, a plain group)."""
    access = StoreAccess(location)
    return images_of(access, access.open_node(""))


def images_of(access: StoreAccess, root) -> list[CollectionImage] | None:
    """The images of the collection whose root node (opened through ``access``) is ``root``, or None."""
    if not isinstance(root, zarr.Group):
        return None
    attributes = dict(root.attrs)
    streams = stream_paths(attributes)
    if streams is None and not is_bioformats2raw(attributes):
        return None
    listed: list[tuple[str | None, str]]
    if streams is not None:
        listed = list(streams.items())
    else:
        listed = [(None, path) for path in _series(access)]
    if len(listed) > MAX_COLLECTION_IMAGES:
        raise ValueError(
            f"{access.location}: the collection lists {len(listed)} images, more than this tool opens "
            f"(MAX_COLLECTION_IMAGES = {MAX_COLLECTION_IMAGES})"
        )
    return [_image(access, name, path) for name, path in listed]


def _series(access: StoreAccess) -> list[str]:
    for key in (f"{SERIES_GROUP}/zarr.json", f"{SERIES_GROUP}/.zattrs"):
        try:
            meta = access.read_metadata(key)
        except FileNotFoundError:
            continue
        attributes = meta.get("attributes") if key.endswith("zarr.json") and isinstance(meta, dict) else meta
        paths = series_paths(attributes)
        if paths is not None:
            return paths
    paths = []  # no list: 0, 1, ... as far as they go
    while len(paths) <= MAX_COLLECTION_IMAGES and _exists(access, str(len(paths))):
        paths.append(str(len(paths)))
    return paths


def _exists(access: StoreAccess, path: str) -> bool:
    for name in ("zarr.json", ".zattrs", ".zgroup", ".zarray"):
        try:
            access.read_metadata(f"{path}/{name}")
        except FileNotFoundError:
            continue
        return True
    return False


def _image(access: StoreAccess, stream: str | None, path: str) -> CollectionImage:
    fallback = f"series {path}"
    try:
        node = access.open_node(path)
    except FileNotFoundError:
        return CollectionImage(stream or fallback, path, None, stream is not None, "listed, but not in the store")
    except Exception as exc:  # noqa: BLE001 - an unreadable image is reported, the others still open
        return CollectionImage(stream or fallback, path, None, stream is not None, str(exc))
    attributes: dict[str, Any] = dict(node.attrs) if isinstance(node, zarr.Group) else {}
    own = image_name(attributes)
    name = stream or (own if own and own != path else None)  # a Writer names an unnamed image after its folder
    image = CollectionImage(name or fallback, path, None, name is not None, attributes=attributes)
    if isinstance(node, zarr.Array):
        image.levels = [node]
        return image
    try:
        image.levels = _levels(access, node)  # the image's levels, below its own path
    except Exception as exc:  # noqa: BLE001 - as above
        image.error = str(exc)
        return image
    if image.levels is None:
        image.error = "a group without OME-Zarr multiscales, not an image"
    return image


def non_image_nodes(access: StoreAccess, images: list[CollectionImage]) -> list[str]:
    """The collection root's children that are neither an image nor the ``OME`` group (tables
    such as ``frame_metadata``): what a tool going over the images leaves out."""
    tops = {image.path.split("/", 1)[0] for image in images} | {SERIES_GROUP}
    return [name for name in access.list_children("") if name not in tops]
