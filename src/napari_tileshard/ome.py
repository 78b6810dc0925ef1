"""OME-Zarr 0.5 metadata: the group ``zarr.json`` of a ``Writer(..., ome=True)`` and how to read it back.

The Writer puts level ``k`` of its :class:`~napari_tileshard.pyramid.Pyramid` at ``k/`` as an
ordinary sharded array and describes them in the group's ``attributes.ome`` (``version``,
``multiscales`` with ``axes`` and per-level ``scale`` transformations).  User attributes sit
next to ``ome`` and may not replace it.
"""

from __future__ import annotations

import json

from .pyramid import Pyramid

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


def open_levels(path) -> list | None:
    """The level arrays (zarr-python, lazy) of the OME-Zarr multiscale at ``path``, or None when
    ``path`` (a path, a zarr Store or a :class:`~napari_tileshard.safe_read.StoreAccess`) holds a
    plain array or a group without OME multiscales.

    Every ``zarr.json`` is read through :mod:`napari_tileshard.safe_read` (regular files inside
    the store, size- and depth-limited) before zarr-python sees it.
    """
    from .safe_read import StoreAccess

    access = StoreAccess(path)
    return _levels(access, access.open_node(""))


def _levels(access, node) -> list | None:
    import zarr

    if not isinstance(node, zarr.Group):
        return None
    paths = multiscale_paths(dict(node.attrs))
    if paths is None:
        return None
    levels = [access.open_node(p) for p in paths]
    for p, level in zip(paths, levels):
        if not isinstance(level, zarr.Array):
            raise ValueError(f"{access.location}: multiscale dataset {p!r} is not an array")
    return levels


def open_level0(path):
    """The full-resolution array at ``path``: the array itself, or level 0 of an OME-Zarr group."""
    import zarr

    from .safe_read import StoreAccess

    access = StoreAccess(path)
    node = access.open_node("")
    levels = _levels(access, node)
    if levels:
        return levels[0]
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{access.location}: a group without OME-Zarr multiscales, not an array")
    return node
