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
    "OME_VERSION",
    "axes",
    "group_metadata",
    "is_collection",
    "multiscale_paths",
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
    """Dataset paths (highest resolution first) of the first multiscale, or None if not OME-Zarr."""
    try:
        datasets = group_attributes["ome"]["multiscales"][0]["datasets"]
        paths = [str(d["path"]) for d in datasets]
    except (KeyError, IndexError, TypeError):
        return None
    if not paths or any(not p or p.startswith("/") or ".." in p.split("/") for p in paths):
        return None  # refuse paths that would leave the group
    return paths


COLLECTION_LAYOUT = 3  # bioformats2raw.layout version


COLLECTION_KEY = "tileshard_collection"  # the root's attribute naming the streams (not the arrays' "tileshard" state)


def is_collection(group_attributes: dict) -> bool:
    """True for the attributes of a collection root written by :class:`MultiWriter`."""
    record = group_attributes.get(COLLECTION_KEY)
    streams = record.get("streams") if isinstance(record, dict) else None
    return isinstance(streams, dict) and all(isinstance(p, str) for p in streams.values())
