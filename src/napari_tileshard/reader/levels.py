"""Opening what a reader reads: a store's root node and its OME-Zarr multiscale levels.

Every ``zarr.json`` goes through :mod:`~napari_tileshard.storage.safe_read` before zarr-python sees
it.  Each function takes a path, a store URL, a zarr ``Store``, a
:class:`~napari_tileshard.storage.safe_read.StoreAccess`, or a zarr ``Array``/``Group`` opened
already (by :meth:`StoreAccess.open_node <napari_tileshard.storage.safe_read.StoreAccess.open_node>`
or zarr-python): an opened node is used as it is, its metadata not read again, so a caller that
needs the root, its levels and a reader of each opens every ``zarr.json`` once.
"""

from __future__ import annotations

import zarr

from ..format.ome import multiscale_paths
from ..storage.safe_read import StoreAccess
from ..storage.urls import resolve_store

__all__ = ["node_access", "open_array", "open_level0", "open_levels", "open_root"]


def node_access(node: zarr.Array | zarr.Group) -> StoreAccess:
    """The checked access to the store of an opened zarr node (no I/O)."""
    return StoreAccess(node.store)


def open_root(source, *, storage_options: dict | None = None) -> tuple[StoreAccess, zarr.Array | zarr.Group]:
    """``(access, node)``: the node at ``source`` and the checked access to its store.

    An opened zarr ``Array`` or ``Group`` is returned as it is; a
    :class:`~napari_tileshard.storage.safe_read.StoreAccess` opens its root; anything else (a path,
    a store URL, with ``storage_options`` for it, a zarr ``Store``) is opened read-only first."""
    if isinstance(source, (zarr.Array, zarr.Group)):
        return node_access(source), source
    if isinstance(source, StoreAccess):
        access = source
    elif storage_options is not None:
        access = StoreAccess(resolve_store(source, storage_options=storage_options))
        access.location = str(source)  # the URL as given, not the Store's repr
    else:
        access = StoreAccess(source)
    return access, access.open_node("")


def open_levels(source) -> list | None:
    """The level arrays (zarr-python, lazy) of the OME-Zarr multiscale at ``source``, or None when
    ``source`` holds a plain array or a group without OME multiscales.  An opened ``Group`` is not
    read again; only its levels' ``zarr.json`` are."""
    return _levels(*open_root(source))


def _levels(access: StoreAccess, node) -> list | None:
    paths = _level_paths(node, access)
    if paths is None:
        return None
    return [_open_level(access, node, p) for p in paths]


def _level_paths(node, access: StoreAccess) -> list[str] | None:
    """The paths of ``node``'s OME multiscale levels (relative to it), None when it has none;
    ValueError naming the store for a level path that would leave the group."""
    if not isinstance(node, zarr.Group):
        return None
    try:
        return multiscale_paths(dict(node.attrs))
    except ValueError as exc:
        raise ValueError(f"{access.location}: {exc}") from None


def _open_level(access: StoreAccess, group: zarr.Group, path: str) -> zarr.Array:
    base = group.path.strip("/")
    level = access.open_node(f"{base}/{path}" if base else path)
    if not isinstance(level, zarr.Array):
        raise ValueError(f"{access.location}: multiscale dataset {path!r} is not an array")
    return level


def open_level0(source):
    """The full-resolution array at ``source``: the array itself (an opened ``Array`` is returned
    as it is), or level 0 of an OME-Zarr group."""
    access, node = open_root(source)
    levels = _levels(access, node)
    if levels:
        return levels[0]
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{access.location}: a group without OME-Zarr multiscales, not an array")
    return node


def open_array(source, pyramid_level: int | None = None, *, storage_options: dict | None = None):
    """``(access, array)``: the array at ``source`` and the checked access to its store.

    ``pyramid_level``: the OME-Zarr multiscale level of a group (default 0); a plain array has
    only level 0.  ValueError naming the value for a level the store does not have, and for a
    group without OME multiscales."""
    access, node = open_root(source, storage_options=storage_options)
    if isinstance(node, zarr.Array):
        if pyramid_level not in (None, 0):
            raise ValueError(f"{access.location}: a plain array has no pyramid_level {pyramid_level!r} (not OME-Zarr)")
        return access, node
    paths = _level_paths(node, access)
    if not paths:
        raise ValueError(f"{access.location}: a group without OME-Zarr multiscales, not an array")
    chosen = 0 if pyramid_level is None else pyramid_level
    if isinstance(chosen, bool) or not isinstance(chosen, int) or not 0 <= chosen < len(paths):
        raise ValueError(
            f"{access.location}: pyramid_level must be an integer in 0..{len(paths) - 1}, got {pyramid_level!r}"
        )
    return access, _open_level(access, node, paths[chosen])  # only the level read: one zarr.json
