"""OME-Zarr 0.5 metadata: the group ``zarr.json`` of a ``Writer(..., ome=True)`` and how to read it back.

The Writer puts level ``k`` of its :class:`~napari_tileshard.format.pyramid.Pyramid` at ``k/`` as an
ordinary sharded array and describes them in the group's ``attributes.ome`` (``version``,
``multiscales`` with ``axes`` and per-level ``scale`` transformations).  User attributes sit
next to ``ome`` and may not replace it.
"""

from __future__ import annotations

import json

from .pyramid import Pyramid

__all__ = [
    "COLLECTION_KEY",
    "COLLECTION_LAYOUT",
    "LAYOUT_KEY",
    "OME_VERSION",
    "SERIES_GROUP",
    "axes",
    "channel_axis",
    "group_metadata",
    "image_axes",
    "image_name",
    "is_bioformats2raw",
    "is_collection",
    "multiscale_paths",
    "omero_channels",
    "series_paths",
    "stream_paths",
]

OME_VERSION = "0.5"


def axes(pyramid: Pyramid) -> list[dict]:
    """OME-NGFF axes: name, type (from ``Dim.kind`` or the name) and unit when given."""
    result = []
    for dim in pyramid.layouts[0].dims:
        axis = {"name": dim.name, "type": dim.axis_kind}
        if dim.unit:
            axis["unit"] = dim.unit
        result.append(axis)
    return result


def group_metadata(pyramid: Pyramid, name: str, attributes: dict | None = None, ome_fields: dict | None = None) -> dict:
    """The group's ``zarr.json``: OME-NGFF 0.5 multiscales over the pyramid's levels.

    ``ome_fields`` are further keys of the ``ome`` object itself (such as ``omero`` with channel
    names and display windows); they may not replace ``version`` or ``multiscales``."""
    attributes = dict(attributes or {})
    ome_fields = dict(ome_fields or {})
    reserved = sorted({"version", "multiscales"} & set(ome_fields))
    if reserved:
        raise ValueError(f"ome_fields may not contain {reserved}: the Writer writes them itself")
    json.dumps(ome_fields)
    if "ome" in attributes:
        raise ValueError("attributes may not contain 'ome': the Writer writes the OME-NGFF metadata itself")
    json.dumps(attributes)  # JSON-serialisable, or a TypeError naming the offending value
    base = [dim.scale for dim in pyramid.layouts[0].dims]
    datasets = [
        {
            "path": str(k),
            "coordinateTransformations": [{"type": "scale", "scale": [b * f for b, f in zip(base, factors)]}],
        }
        for k, factors in enumerate(pyramid.factors)
    ]
    multiscale = {
        "name": name,
        "axes": axes(pyramid),
        "datasets": datasets,
        "type": pyramid.method,
        "metadata": {"method": f"napari_tileshard 2x {pyramid.method}"},
    }
    ome = {**ome_fields, "version": OME_VERSION, "multiscales": [multiscale]}
    return {"zarr_format": 3, "node_type": "group", "attributes": {**attributes, "ome": ome}}


def multiscale_paths(group_attributes: dict) -> list[str] | None:
    """Dataset paths (highest resolution first) of the first multiscale, or None if not OME-Zarr.

    ValueError naming the path when a dataset's path would leave the group (empty, absolute, or
    with a ``..`` segment): such a group is OME-Zarr, but not one that may be read."""
    try:
        datasets = group_attributes["ome"]["multiscales"][0]["datasets"]
        paths = [str(d["path"]) for d in datasets]
    except (KeyError, IndexError, TypeError):
        return None
    if not paths:
        return None
    for path in paths:
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(
                f"OME-Zarr multiscale dataset path {path!r} is not inside the group (empty, absolute or with "
                "'..'): not read"
            )
    return paths


COLLECTION_LAYOUT = 3  # bioformats2raw.layout version


#: the root attribute (inside ``ome`` in 0.5, at the top in 0.4) that makes a group a collection of images
LAYOUT_KEY = "bioformats2raw.layout"


#: the group beside the images that lists them (``ome.series``, 0.4: ``series``)
SERIES_GROUP = "OME"


COLLECTION_KEY = "tileshard_collection"  # the root's attribute naming the streams (not the arrays' "tileshard" state)


def is_collection(group_attributes: dict) -> bool:
    """True for the attributes of a collection root written by :class:`MultiWriter`."""
    record = group_attributes.get(COLLECTION_KEY)
    streams = record.get("streams") if isinstance(record, dict) else None
    return isinstance(streams, dict) and all(isinstance(p, str) for p in streams.values())


def _inside(path) -> bool:
    """A relative path to a node below the group it is relative to (never the group itself: an
    image at "." would be the collection again)."""
    return isinstance(path, str) and all(part not in ("", ".", "..") for part in path.split("/"))


def stream_paths(group_attributes: dict) -> dict[str, str] | None:
    """``{stream name: path}`` of a :class:`MultiWriter` collection root, None for any other group
    (or one whose stream paths would leave it)."""
    if not is_collection(group_attributes):
        return None
    streams = group_attributes[COLLECTION_KEY]["streams"]
    return dict(streams) if all(_inside(p) for p in streams.values()) else None


def is_bioformats2raw(group_attributes: dict) -> bool:
    """True for the root of a ``bioformats2raw.layout`` collection (OME-NGFF 0.5: inside ``ome``;
    0.4: at the top of the attributes), whoever wrote it."""
    ome = group_attributes.get("ome")
    version = ome.get(LAYOUT_KEY) if isinstance(ome, dict) else None
    if version is None:
        version = group_attributes.get(LAYOUT_KEY)
    return version == COLLECTION_LAYOUT and not isinstance(version, bool)


def series_paths(series_attributes) -> list[str] | None:
    """The image paths that the collection's ``OME`` group lists (``ome.series``; 0.4: ``series``),
    or None when it lists none (the images are then ``0``, ``1``, ... as far as they exist)."""
    if not isinstance(series_attributes, dict):
        return None
    ome = series_attributes.get("ome")
    series = ome.get("series") if isinstance(ome, dict) else series_attributes.get("series")
    if not isinstance(series, list) or not all(_inside(p) for p in series):
        return None
    return list(dict.fromkeys(series))  # each image once


def image_name(group_attributes: dict) -> str | None:
    """The name an OME-Zarr image gives itself (its first multiscale's ``name``), or None."""
    try:
        name = group_attributes["ome"]["multiscales"][0]["name"]
    except (KeyError, IndexError, TypeError):
        try:  # OME-NGFF 0.4: multiscales at the top of the attributes
            name = group_attributes["multiscales"][0]["name"]
        except (KeyError, IndexError, TypeError):
            return None
    return name.strip() if isinstance(name, str) and name.strip() else None


def _ome_object(group_attributes: dict) -> dict:
    """The OME metadata of a group: ``attributes.ome`` (0.5) or the attributes themselves (0.4)."""
    ome = group_attributes.get("ome")
    return ome if isinstance(ome, dict) else group_attributes


def image_axes(group_attributes: dict) -> list[dict] | None:
    """The first multiscale's axes (``name``, ``type``, ``unit``), or None."""
    try:
        axes = _ome_object(group_attributes)["multiscales"][0]["axes"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(axes, list) or not all(isinstance(a, dict) and isinstance(a.get("name"), str) for a in axes):
        return None
    return axes


def channel_axis(group_attributes: dict) -> int | None:
    """The index of the image's channel axis (``type: channel``), or None when it has none."""
    axes = image_axes(group_attributes) or []
    found = [k for k, axis in enumerate(axes) if axis.get("type") == "channel"]
    return found[0] if len(found) == 1 else None


def omero_channels(group_attributes: dict) -> list[dict] | None:
    """The ``omero`` channel records (``label``, ``color``, ``window``) of an image, or None."""
    channels = _ome_object(group_attributes).get("omero", {})
    channels = channels.get("channels") if isinstance(channels, dict) else None
    if not isinstance(channels, list) or not all(isinstance(c, dict) for c in channels):
        return None
    return channels
