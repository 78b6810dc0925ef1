"""OME-Zarr multiscale levels opened for reading: every ``zarr.json`` goes through
:mod:`~napari_tileshard.storage.safe_read` before zarr-python sees it."""

from __future__ import annotations

import zarr

from ..format.ome import multiscale_paths
from ..storage.safe_read import StoreAccess

__all__ = ["open_level0", "open_levels"]


def open_levels(path) -> list | None:
    """The level arrays (zarr-python, lazy) of the OME-Zarr multiscale at ``path``, or None when
    ``path`` (a path, a zarr Store or a :class:`~napari_tileshard.storage.safe_read.StoreAccess`) holds a
    plain array or a group without OME multiscales.

    Every ``zarr.json`` is read through :mod:`napari_tileshard.storage.safe_read` (regular files inside
    the store, size- and depth-limited) before zarr-python sees it.
    """
    access = StoreAccess(path)
    return _levels(access, access.open_node(""))


def _levels(access, node) -> list | None:
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
    access = StoreAccess(path)
    node = access.open_node("")
    levels = _levels(access, node)
    if levels:
        return levels[0]
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{access.location}: a group without OME-Zarr multiscales, not an array")
    return node
